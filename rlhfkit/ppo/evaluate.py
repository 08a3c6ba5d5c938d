"""Step 3's held-out evaluation, and the metrics of a training step.

The held-out prompts are answered greedily by the current actor and scored like training samples.
Before the first update the actor IS the step-1 model, so the evaluation at step 0 is the baseline.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from rlhfkit import distributed as dist
from rlhfkit.algos import masked_mean, masked_sum
from rlhfkit.data import collate_prompts
from rlhfkit.ppo.collect import Collected, ExperienceMaker, part_means
from rlhfkit.loaders import eval_batches
from rlhfkit.program import peak_rss_gb


class HeldOutEval:
    """``evaluate()`` -> mean reward, KL to the reference (per sequence), response length, truncation
    rate and reward components of greedy responses to the held-out prompts, over all ranks."""

    def __init__(self, maker: ExperienceMaker, features: Sequence[dict], rows: Sequence[Any], batch_size: int):
        self.maker, self.features, self.rows, self.batch_size = maker, features, rows, batch_size

    def __len__(self) -> int:
        return len(self.features)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        self.maker.models.actor.eval()
        dev = self.maker.device
        sums = torch.zeros(5, dtype=torch.float64)
        parts: dict[str, list] = {}
        part_weights = []
        collate = functools.partial(collate_prompts, pad_token_id=self.maker.pad)
        for batch, weights in eval_batches(self.features, collate, self.batch_size):
            exp, _, _ = self.maker.make(batch, self.rows, parts, training=False)
            part_weights.append(weights)
            w = weights.to(dev).double()
            seq_kl = masked_sum(exp.old_logprobs - exp.ref_logprobs, exp.action_mask, dim=-1).double()
            sums += torch.stack([(w * exp.raw_scores.double()).sum(), (w * seq_kl).sum(),
                                 (w * exp.action_mask.sum(-1).double()).sum(), (w * exp.truncated.double()).sum(), w.sum()]).cpu()
        total = dist.all_reduce_sum(sums)
        n = max(total[4].item(), 1.0)
        return {"reward": total[0].item() / n, "kl_per_seq": total[1].item() / n, "response_len": total[2].item() / n,
                "truncated_rate": total[3].item() / n, "prompts": int(total[4].item()),
                **part_means(parts, torch.cat(part_weights) if part_weights else None)}


def step_metrics(c: Collected, train_stats: dict[str, float], *, step_s: float, training_s: float, kl_coef: float,
                 nonfinite_skipped: int) -> tuple[dict[str, float], int, float]:
    """The metrics of one training step (rewards, KL, advantages and lengths averaged over ranks, the
    update metrics, memory, timings and throughput), and the samples and response tokens it trained
    on, over all ranks."""
    exp, dev = c.exp, c.exp.sequences.device
    seq_kl = masked_sum(exp.kl, exp.action_mask, dim=-1)
    lengths = exp.action_mask.sum(-1)
    local = {"reward/score_mean": exp.raw_scores.mean().item(), "reward/score_std": exp.raw_scores.std().item() if len(exp) > 1 else 0.0,
             "reward/shaped_mean": exp.scores.mean().item(),
             "kl/per_token": masked_mean(exp.kl, exp.action_mask).item(), "kl/per_seq": seq_kl.mean().item(),
             "adv/mean": masked_mean(exp.advantages, exp.action_mask).item(),
             "adv/return_mean": masked_mean(exp.returns, exp.action_mask).item(),
             "gen/response_len": lengths.float().mean().item(), "gen/truncated_rate": exp.truncated.float().mean().item(),
             **train_stats}
    metrics = dist.mean_over_ranks(local, dev)
    n_samples = len(exp) * dist.world_size()
    n_tokens = dist.all_reduce_sum(lengths.sum().double()).item()
    metrics.update(dist.max_over_ranks({"mem/peak_rss_gb": peak_rss_gb()}, dev))
    metrics.update({f"reward/{k}": v for k, v in part_means(c.reward_parts).items()})
    metrics.update({"kl/coef": kl_coef, "nonfinite/skipped": nonfinite_skipped, "sampling/rounds": c.rounds,
                    "time/generation_s": c.generation_s, "time/experience_s": c.experience_s,
                    "time/training_s": training_s, "time/step_s": step_s, "time/generation_share": c.generation_s / max(step_s, 1e-9),
                    "perf/samples_per_s": n_samples / step_s, "perf/gen_tokens_per_s": n_tokens / max(c.generation_s, 1e-9)})
    return metrics, n_samples, n_tokens
