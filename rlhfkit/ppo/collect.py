"""Step 3's rollout and scoring: this rank's prompts -> responses -> an :class:`Experience` (scores,
the actor's and the reference's logprobs, the critic's values; advantages come later).

The G samples of a prompt are generated together on one rank and stay contiguous (a group never
spans ranks). With ``--dynamic_sampling`` (DAPO) groups whose rewards are all equal carry no signal:
they are dropped and more prompts are sampled until the batch is full, every rank running the same
number of rounds and keeping the same number of samples.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from rlhfkit import distributed as dist
from rlhfkit.algos import RunningMoments, floor_empty_scores, lowest_real_score, masked_moments, overlong_penalty
from rlhfkit.experience import Experience, actor_forward, critic_forward
from rlhfkit.models import sequence_scores
from rlhfkit.ppo.models import PPOModels
from rlhfkit.rewards import RewardFunctions
from rlhfkit.rollout import GenerationConfig, PromptBatch, RolloutBatch
from rlhfkit.faults import crash_point


@dataclass
class Collected:
    """One step's experience and how it was gathered."""

    exp: Experience  # the batch to train on (no advantages yet)
    rounds: int  # generation rounds run (more than --generation_batches only with dynamic sampling)
    generation_s: float  # seconds generating
    experience_s: float  # seconds in the no-grad forward passes and scoring
    reward_parts: dict[str, list] = field(default_factory=dict)  # per-sample reward components (gsm8k: accuracy, format)


def part_means(parts: dict[str, list], weights: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Global (all ranks) weighted means of per-sample reward components; the same keys on every rank."""
    out = {}
    for name in sorted(parts):
        v = torch.tensor(parts[name], dtype=torch.float64)
        w = torch.ones_like(v) if weights is None else weights.double().cpu()
        total = dist.all_reduce_sum(torch.stack([(w * v).sum(), w.sum()]))
        out[name] = total[0].item() / max(total[1].item(), 1e-9)
    return out


class ExperienceMaker:
    """Turns prompt batches into experience with step 3's models, reward sources and settings."""

    def __init__(self, cfg: Any, models: PPOModels, tokenizer: Any, reward_fns: RewardFunctions):
        self.cfg, self.models, self.tokenizer, self.reward_fns = cfg, models, tokenizer, reward_fns
        self.pad = tokenizer.pad_token_id
        self.reward_norm = RunningMoments() if cfg.normalize_reward else None  # its state goes into training states
        self.device = models.actor.device
        self.train_gen = GenerationConfig(max_new_tokens=cfg.max_answer_seq_len, temperature=cfg.temperature, top_p=cfg.top_p,
                                          top_k=cfg.top_k, min_new_tokens=cfg.min_new_tokens, do_sample=not cfg.greedy_rollouts,
                                          eos_token_id=tokenizer.eos_token_id, pad_token_id=self.pad)
        # The held-out evaluation samples the policy's own distribution (temperature 1, no top-p / top-k), whatever the
        # rollout settings, so its KL to the reference is an estimate; or one greedy response (--eval_greedy).
        self.eval_gen = GenerationConfig(max_new_tokens=cfg.max_answer_seq_len, do_sample=not cfg.eval_greedy, temperature=1.0,
                                         top_p=1.0, top_k=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=self.pad)
        self.eval_samples = 1 if cfg.eval_greedy else cfg.eval_n_samples_per_prompt  # responses per held-out prompt

    def score(self, batch: RolloutBatch, rows: Sequence[dict], parts: dict[str, list], training: bool = True,
              messages: Optional[list] = None) -> torch.Tensor:
        """Sequence rewards [B]: the reward model (read at the last real token) and/or the reward functions and
        servers, weighted. ``parts`` collects per-sample reward components for the metrics, and in a held-out
        evaluation each ``--judge``'s scores (not in the reward); ``messages`` are the samples' prompt turns (for
        the servers)."""
        cfg = self.cfg
        total = torch.zeros(len(batch), device=self.device)
        if self.models.reward is not None:
            total += cfg.reward_model_weight * self.models.no_grad_forward("reward", sequence_scores, batch.sequences,
                                                                           batch.attention_mask)
        if self.reward_fns:
            prompts = self.tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
            responses = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            total += self.reward_fns.score(prompts, responses, list(rows), parts, self.device, dist.all_reduce_sum, training,
                                           gsm8k_kwargs={"format_bonus": cfg.format_bonus}, messages=messages)
        for name in self.models.judges if not training else ():
            judged = self.models.no_grad_forward(name, sequence_scores, batch.sequences, batch.attention_mask)
            parts.setdefault(name, []).extend(judged.float().cpu().tolist())
        return total

    def shaped(self, raw: torch.Tensor, batch: RolloutBatch, training: bool = True) -> torch.Tensor:
        """The scores the advantages see: in training an empty response's capped at the batch's lowest real
        score (--empty_reward min), then normalised by the running mean and std of all the training scores so
        far (--normalize_reward; a held-out evaluation reads them, never updates them), then a truncated
        or empty response's replaced (--truncated_reward, --empty_reward NUMBER), DAPO's overlong penalty
        added (--overlong_buffer_len)."""
        cfg, scores = self.cfg, raw.clone()
        if cfg.empty_reward == "min" and training:
            empty = batch.empty.to(scores.device)
            scores = floor_empty_scores(scores, empty, dist.all_reduce_min(lowest_real_score(scores, empty)))
        if self.reward_norm is not None:
            if training:
                self.reward_norm.update(*dist.all_reduce_sum(masked_moments(scores, torch.ones_like(scores))).tolist())
            scores = self.reward_norm.normalize(scores)
        if cfg.truncated_reward is not None:
            scores = torch.where(batch.truncated.to(self.device), torch.full_like(scores, cfg.truncated_reward), scores)
        if cfg.empty_reward not in ("min", "keep"):
            scores = torch.where(batch.empty.to(scores.device), torch.full_like(scores, float(cfg.empty_reward)), scores)
        if cfg.overlong_buffer_len:
            scores = scores + overlong_penalty(batch.response_lengths.to(self.device), cfg.max_answer_seq_len,
                                               cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        return scores

    @torch.no_grad()
    def make(self, prompt_batch: dict, source_rows: Sequence[Any], parts: dict[str, list], *,
             training: bool) -> tuple[Experience, float, float]:
        """Generate for this rank's prompts (training: each G times with the rollout settings; else the
        evaluation's ``eval_samples`` times with ``eval_gen``) and run the experience forward passes, the
        log-probabilities at the sampling temperature. Returns (experience without advantages, experience s,
        generation s). The samples of a prompt are consecutive rows."""
        cfg, models = self.cfg, self.models
        repeat = cfg.n_samples_per_prompt if training else self.eval_samples
        gen = self.train_gen if training else self.eval_gen
        groups = cfg.packed_group_size if training else 1
        ids = prompt_batch["input_ids"].to(self.device).repeat_interleave(repeat, 0)
        mask = prompt_batch["attention_mask"].to(self.device).repeat_interleave(repeat, 0)
        examples = [source_rows[i] for i in prompt_batch["index"].tolist() for _ in range(repeat)]
        rows = [ex.meta for ex in examples]
        t0 = time.time()
        if training:
            crash_point("generation")
        actor_view = models.views.get("actor")
        with actor_view.held() if actor_view is not None else contextlib.nullcontext():
            batch = models.rollout.generate(PromptBatch(ids, mask), gen)
            t_gen = time.time() - t0
            P, seqs, attn = batch.prompt_ids.shape[1], batch.sequences, batch.attention_mask
            temperature = gen.temperature if gen.do_sample else 1.0  # training: cfg.temperature; evaluation: 1
            old_lp = None
            if not (cfg.old_logprobs_from_training and training):  # evaluation needs them for its KL
                old_lp, _ = models.no_grad_forward("actor", actor_forward, seqs, attn, P, temperature, False, groups)
        ref_lp, _ = models.no_grad_forward("ref", actor_forward, seqs, attn, P, temperature, False, groups)
        # the held-out evaluation needs no values: a critic pass there would be a fifth forward for nothing
        values = (models.no_grad_forward("critic", critic_forward, seqs, attn, P)
                  if models.critic is not None and training else None)
        raw = self.score(batch, rows, parts, training, [ex.prompt for ex in examples])
        amask = batch.action_mask.float()
        loss_mask = amask * (~batch.truncated).float()[:, None].to(self.device) if cfg.mask_truncated else amask
        zeros = torch.zeros_like(amask)
        exp = Experience(sequences=seqs, attention_mask=attn, action_mask=amask, loss_mask=loss_mask, old_logprobs=old_lp,
                         ref_logprobs=ref_lp, values=values, scores=self.shaped(raw, batch, training), raw_scores=raw, rewards=zeros,
                         advantages=zeros, returns=zeros, kl=zeros, truncated=batch.truncated.to(self.device), prompt_len=P)
        return exp, time.time() - t0 - t_gen, t_gen

    def collect(self, prompt_iter: Iterator[dict], source_rows: Sequence[Any]) -> Collected:
        """Experience for one training step: ``--generation_batches`` rounds of prompts, or with
        ``--dynamic_sampling`` as many rounds (up to ``--max_sampling_rounds``) as it takes to fill the
        batch with groups whose rewards differ. Every rank ends with the same number of samples."""
        cfg = self.cfg
        G, target = cfg.n_samples_per_prompt, cfg.samples_per_rank
        parts, kept, rounds, t_gen, t_exp, reward_parts = [], 0, 0, 0.0, 0.0, {}
        max_rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else cfg.generation_batches
        while rounds < max_rounds:
            exp, te, tg = self.make(next(prompt_iter), source_rows, reward_parts, training=True)
            rounds, t_gen, t_exp = rounds + 1, t_gen + tg, t_exp + te
            if cfg.dynamic_sampling:
                groups = exp.scores.view(-1, G)
                keep = (groups.max(1).values - groups.min(1).values) > 1e-6
                exp = exp.select(keep.repeat_interleave(G).nonzero().squeeze(-1))
            parts.append(exp)
            kept += len(exp)
            if cfg.dynamic_sampling and dist.all_reduce_sum(torch.tensor([float(kept < target)], device=self.device)).item() == 0:
                break
        exp = Experience.concat([p for p in parts if len(p)] or parts[:1], self.pad)
        n = int(dist.all_reduce_min(torch.tensor([float(min(len(exp), target))], device=self.device)).item())
        n -= n % G
        exp = exp.select(torch.arange(n)) if n < len(exp) else exp
        return Collected(exp=exp, rounds=rounds, generation_s=t_gen, experience_s=t_exp, reward_parts=reward_parts)
