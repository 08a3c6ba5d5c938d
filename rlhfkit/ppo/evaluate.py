"""Step 3's held-out evaluation, and the metrics of a training step.

The held-out prompts are answered by the current actor with the evaluation settings (by default
``--eval_n_samples_per_prompt`` 4 responses each, sampled at temperature 1 from the policy's own
distribution; ``--eval_greedy``: one greedy response) and scored like training samples. Before the first
update the actor IS the step-1 model, so the evaluation at step 0 is the baseline.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Sequence

import torch

from rlhfkit import distributed as dist
from rlhfkit.algos import explained_variance, kl_estimate, masked_mean, masked_moments, masked_sum
from rlhfkit.data import collate_prompts
from rlhfkit.errors import ConfigError
from rlhfkit.experience import Experience
from rlhfkit.ppo.collect import Collected, ExperienceMaker, part_means
from rlhfkit.loaders import eval_batches
from rlhfkit.program import peak_rss_gb
from rlhfkit.rollout import empty_responses

# The weighted sums one evaluation batch adds (a padding prompt weighs 0), reduced over ranks into the metrics.
SUMS = ("reward", "prompt_reward", "prompt_reward_sq", "prompts", "samples", "kl_k3", "kl_k1", "tokens", "truncated", "empty")


# The evaluation's per-prompt mean rewards, in prompt order, and {reward part: per-prompt means} (gsm8k: accuracy,
# format): kept for paired comparisons, not logged as metrics.
PROMPT_REWARDS = "prompt_rewards"
PROMPT_PARTS = "prompt_parts"


def paired_gain(before: dict, after: dict, part: str | None = None) -> dict:
    """The held-out gain of ``after`` over ``before`` (two evaluations of the same prompts) in the reward, or in
    the reward component ``part``, paired by prompt: the mean of the per-prompt differences with its 95% t
    interval (``rlhfkit.eval_stats.mean_ci``)."""
    from rlhfkit.eval_stats import mean_ci

    def per_prompt(ev: dict) -> list:
        return ev.get(PROMPT_REWARDS, []) if part is None else ev.get(PROMPT_PARTS, {}).get(part, [])

    a, b = per_prompt(after), per_prompt(before)
    return mean_ci([x - y for x, y in zip(a, b)] if len(a) == len(b) else [])


def part_change_line(before: dict, after: dict, part: str) -> str:
    """The summary's line for reward component ``part``: its held-out mean before -> after, and the paired change
    with its 95% interval when at least 2 prompts were evaluated (one prompt has no interval)."""
    g = paired_gain(before, after, part)
    line = f"{before[part]:.3f} -> {after[part]:.3f}"
    if g["n"] < 2:
        return f"{line} ({g['n']} prompt{'' if g['n'] == 1 else 's'}: too few for a paired interval)"
    return f"{line}, change {g['mean']:+.3f}, 95% CI [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] paired over {g['n']} prompts"


class HeldOutEval:
    """``evaluate()`` -> the held-out metrics of the current actor, over all ranks (see :func:`eval_metrics`).

    Sampling is seeded with ``--seed`` + rank, the same at every evaluation (successive evaluations differ
    by the policy, not by the draw), inside a forked random state: the training's random stream is
    exactly what it would be without evaluation. A batch holds ``--per_device_eval_batch_size`` prompts,
    by default about as many sequences as a training generation batch (prompts x G), so evaluating needs no
    more memory than a rollout.
    """

    def __init__(self, maker: ExperienceMaker, features: Sequence[dict], rows: Sequence[Any], batch_size: int):
        cfg = maker.cfg
        if cfg.eval_n_samples_per_prompt < 1:
            raise ConfigError(f"--eval_n_samples_per_prompt must be >= 1, got {cfg.eval_n_samples_per_prompt}")
        self.maker, self.features, self.rows = maker, features, rows
        self.samples = maker.eval_samples
        per_rank = max(1, math.ceil(len(features) / dist.world_size()))
        default = max(1, batch_size * cfg.n_samples_per_prompt // self.samples)  # about a rollout's sequences
        self.batch_size = min(per_rank, cfg.per_device_eval_batch_size or default)  # prompts per batch
        self.seed = cfg.seed + dist.rank()

    def __len__(self) -> int:
        return len(self.features)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        self.maker.models.actor.eval()
        sums = torch.zeros(len(SUMS), dtype=torch.float64)
        parts: dict[str, list] = {}
        sample_weights, by_prompt = [], []
        collate = functools.partial(collate_prompts, pad_token_id=self.maker.pad)
        with self.own_random_state():
            for batch, weights in eval_batches(self.features, collate, self.batch_size):
                start = {k: len(v) for k, v in parts.items()}
                exp, _, _ = self.maker.make(batch, self.rows, parts, training=False)
                sample_weights.append(weights.repeat_interleave(self.samples))
                sums += batch_sums(exp, weights.double(), self.samples)
                means = {k: self.prompt_means(v[start.get(k, 0):]) for k, v in parts.items()}
                means[PROMPT_REWARDS] = self.prompt_means(exp.raw_scores)
                by_prompt += [(i, {k: m[j] for k, m in means.items()})
                              for j, (i, w) in enumerate(zip(batch["index"].tolist(), weights.tolist())) if w > 0]
        ordered = [m for _, m in sorted(dist.gather_lists(by_prompt), key=lambda x: x[0])]
        return {**eval_metrics(dist.all_reduce_sum(sums)),
                **part_means(parts, torch.cat(sample_weights) if sample_weights else None),
                PROMPT_REWARDS: [m[PROMPT_REWARDS] for m in ordered],
                PROMPT_PARTS: {k: [m[k] for m in ordered] for k in sorted(parts)}}

    def prompt_means(self, values: Any) -> list[float]:
        """Per prompt, the mean of its ``samples`` consecutive per-sample values."""
        return torch.as_tensor(values, dtype=torch.float64).view(-1, self.samples).mean(1).tolist()

    @contextlib.contextmanager
    def own_random_state(self) -> Iterator[None]:
        """Seed the evaluation's sampling; restore the random state the training had, on the CPU and the actor's GPU."""
        device = torch.device(self.maker.device)
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(self.seed)
            for d in cuda:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(self.seed)
            yield


def batch_sums(exp: Experience, prompt_weights: torch.Tensor, samples: int) -> torch.Tensor:
    """[len(SUMS)] fp64 on the CPU: one evaluation batch's weighted sums (``samples`` consecutive rows per
    prompt). The KL sums are over each response's tokens: k3 = exp(d) - d - 1, d = log p_ref - log p_actor
    (never negative), and k1 = -d, both on the actor's own samples."""
    w = prompt_weights.to(exp.raw_scores.device).repeat_interleave(samples)
    mask = exp.action_mask
    k3 = masked_sum(kl_estimate(exp.old_logprobs.float(), exp.ref_logprobs.float(), "k3"), mask, dim=-1).double()
    k1 = masked_sum(kl_estimate(exp.old_logprobs.float(), exp.ref_logprobs.float(), "k1"), mask, dim=-1).double()
    reward = exp.raw_scores.double()
    prompt_reward = reward.view(-1, samples).mean(1)
    pw = w.view(-1, samples)[:, 0].double()
    w = w.double()
    return torch.stack([(w * reward).sum(), (pw * prompt_reward).sum(), (pw * prompt_reward.square()).sum(), pw.sum(), w.sum(),
                        (w * k3).sum(), (w * k1).sum(), (w * mask.sum(-1).double()).sum(),
                        (w * exp.truncated.double()).sum(), (w * empty_responses(mask, exp.truncated).double()).sum()]).cpu()


def eval_metrics(total: torch.Tensor) -> dict[str, float]:
    """The held-out metrics from the summed :data:`SUMS`: ``reward`` (mean over responses) and ``reward_se`` (its
    standard error over prompts, each prompt's mean over its samples; with 2+ prompts), the KL to the reference
    in nats, k3 ``kl_per_token`` (total / response tokens, as training's ``kl/per_token``) and ``kl_per_seq``
    (mean over responses), k1 ``kl_k1_per_token`` / ``kl_k1_per_seq``, ``response_len``, ``truncated_rate``, ``empty_rate``,
    ``prompts`` and ``samples`` (responses)."""
    t = dict(zip(SUMS, total.tolist()))
    n, tokens, prompts = max(t["samples"], 1.0), max(t["tokens"], 1.0), t["prompts"]
    out = {"reward": t["reward"] / n, "kl_per_token": t["kl_k3"] / tokens, "kl_per_seq": t["kl_k3"] / n,
           "kl_k1_per_token": t["kl_k1"] / tokens, "kl_k1_per_seq": t["kl_k1"] / n, "response_len": t["tokens"] / n,
           "truncated_rate": t["truncated"] / n, "empty_rate": t["empty"] / n, "prompts": int(prompts), "samples": int(t["samples"])}
    if prompts >= 2:
        var = max(t["prompt_reward_sq"] - t["prompt_reward"] ** 2 / prompts, 0.0) / (prompts - 1)
        out["reward_se"] = math.sqrt(var / prompts)
    return out


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
             "gen/empty_rate": empty_responses(exp.action_mask, exp.truncated).float().mean().item(),
             **train_stats}
    metrics = dist.mean_over_ranks(local, dev)
    n_samples = len(exp) * dist.world_size()
    n_tokens = dist.all_reduce_sum(lengths.sum().double()).item()
    if exp.values is not None:  # how well the critic's values (before this step's update) predicted the returns
        mask = exp.action_mask
        moments = dist.all_reduce_sum(torch.cat([masked_moments(exp.returns, mask), masked_moments(exp.returns - exp.values, mask)]))
        metrics["value/explained_var"] = explained_variance(moments[:3], moments[3:])
    metrics.update(dist.max_over_ranks({"mem/peak_rss_gb": peak_rss_gb()}, dev))
    metrics.update({f"reward/{k}": v for k, v in part_means(c.reward_parts).items()})
    metrics.update({"kl/coef": kl_coef, "nonfinite/skipped": nonfinite_skipped, "sampling/rounds": c.rounds,
                    "time/generation_s": c.generation_s, "time/experience_s": c.experience_s,
                    "time/training_s": training_s, "time/step_s": step_s, "time/generation_share": c.generation_s / max(step_s, 1e-9),
                    "perf/samples_per_s": n_samples / step_s, "perf/gen_tokens_per_s": n_tokens / max(c.generation_s, 1e-9)})
    return metrics, n_samples, n_tokens
