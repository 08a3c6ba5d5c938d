"""Step 3's training phase: advantages for a batch of experience, then ``ppo_epochs`` passes of
mini-batch updates of the actor (and the critic).

One update (:func:`ppo_update`) composes the pure losses of :mod:`rlhfkit.algos`:

    loss_actor  = policy_loss(PPO-clip)  [+ beta * KL(actor || ref) in the loss]  [+ unsup_coef * PTX SFT loss]
    loss_critic = clipped value loss

Each loss is normalised by the global token / sequence counts divided by the world size (the
contract at the top of :mod:`rlhfkit.algos.losses`), so DeepSpeed's gradient average over ranks
equals the gradient of the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.algos import aggregate_loss, clipped_value_loss, kl_estimate, kl_loss, masked_mean, sft_loss
from rlhfkit.experience import Experience, actor_forward, critic_forward, packs_groups
from rlhfkit.rl import AlgoSpec, compute_advantages, policy_loss
from rlhfkit.loaders import to_device
from rlhfkit.models.gathered import is_zero3_partitioned


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """What one update needs from step 3's config (:meth:`from_config`)."""

    clip_eps_low: float  # PPO ratio clip range below 1
    clip_eps_high: float  # and above 1 (DAPO's clip-higher when larger)
    loss_agg: str  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    norm_constant: float  # seq_mean_token_sum_norm's C
    policy_loss: str  # ppo | gspo | gspo_token (rlhfkit.rl.POLICY_LOSSES)
    entropy_coef: float  # weight of the entropy bonus (0: none)
    temperature: float  # the rollouts' sampling temperature: logprobs are taken at it
    kl_in_loss: bool  # beta * KL(actor || reference) is part of the actor loss (GRPO)
    kl_estimator: str  # k1 | k2 | k3, for the KL in the loss and the "old" KL of the metrics
    unsup_coef: float  # weight of the PTX (pretraining SFT) loss
    cliprange_value: float  # critic value clip range
    ppo_epochs: int  # passes over each batch
    minibatch_size: int  # samples per mini-batch (one optimiser step each)
    seed: int  # mini-batch shuffling: seed + rank

    @staticmethod
    def from_config(cfg: Any) -> "UpdateSettings":
        """From a :class:`step3_ppo.config.Step3Config`."""
        low, high = cfg.clip_eps
        return UpdateSettings(clip_eps_low=low, clip_eps_high=high, loss_agg=cfg.loss_agg, norm_constant=cfg.loss_norm_constant,
                              policy_loss=cfg.policy_loss, entropy_coef=cfg.entropy_coef, temperature=cfg.temperature,
                              kl_in_loss=cfg.spec.kl_in_loss, kl_estimator=cfg.kl_estimator, unsup_coef=cfg.unsup_coef,
                              cliprange_value=cfg.cliprange_value, ppo_epochs=cfg.ppo_epochs,
                              minibatch_size=cfg.per_device_training_batch_size, seed=cfg.seed)


@dataclass
class Trainables:
    """The trained side of step 3: the actor and critic engines, and the actor's EMA."""

    actor: Any  # DeepSpeed engine (anything with __call__, backward(loss), step(), train())
    critic: Optional[Any] = None  # DeepSpeed engine of the value model, None for critic-free algorithms
    ema: Optional[Any] = None  # rlhfkit.params.ParamEMA of the actor, updated after each mini-batch


@dataclass
class UpdateStats:
    """What one mini-batch update measured (the metric names are :meth:`metrics`' keys)."""

    policy_loss: Optional[float] = None  # policy/loss: the PPO-clip term alone (None: the actor was frozen)
    clip_frac: Optional[float] = None  # policy/clip_frac: fraction of tokens whose ratio was clipped
    approx_kl: Optional[float] = None  # policy/approx_kl: mean (old - new) log-ratio, the drift within the batch
    entropy: Optional[float] = None  # policy/entropy: mean entropy of the actor over the response tokens
    kl_loss: Optional[float] = None  # policy/kl_loss: the KL term before its coefficient (KL in the loss)
    entropy_loss: Optional[float] = None  # policy/entropy_loss: the aggregated entropy the bonus weights (--entropy_coef)
    ptx_loss: Optional[float] = None  # policy/ptx_loss: the PTX SFT loss before its coefficient
    value_loss: Optional[float] = None  # value/loss (with a critic)
    value_clip_frac: Optional[float] = None  # value/clip_frac

    _NAMES = {"policy_loss": "policy/loss", "clip_frac": "policy/clip_frac", "approx_kl": "policy/approx_kl",
              "entropy": "policy/entropy", "kl_loss": "policy/kl_loss", "entropy_loss": "policy/entropy_loss", "ptx_loss": "policy/ptx_loss",
              "value_loss": "value/loss", "value_clip_frac": "value/clip_frac"}

    def metrics(self) -> dict[str, float]:
        return {self._NAMES[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def mean_metrics(stats: Iterable[UpdateStats]) -> dict[str, float]:
    """The mean of each metric over the updates of a step."""
    sums: dict[str, float] = {}
    n = 0
    for s in stats:
        for k, v in s.metrics().items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}


def add_advantages(exp: Experience, spec: AlgoSpec, cfg: Any, kl_coef: float) -> None:
    """Fill ``exp``'s rewards, advantages, returns and KL by the algorithm's estimator (:mod:`rlhfkit.rl`).

    Without old logprobs yet (they come from the update: ``old_logprobs_from_training``) the KL
    estimate is 0 here; then no estimator reads it (the KL is not in the reward), only the metrics."""
    logprobs = exp.ref_logprobs if exp.old_logprobs is None else exp.old_logprobs
    adv = compute_advantages(spec, scores=exp.scores, logprobs=logprobs, ref_logprobs=exp.ref_logprobs, mask=exp.action_mask,
                             values=exp.values, kl_coef=kl_coef, kl_estimator=cfg.kl_estimator,
                             clip_reward_value=cfg.clip_reward_value, gamma=cfg.gamma, lam=cfg.lam,
                             group_size=cfg.n_samples_per_prompt, whiten_advantages=cfg.whiten_advantages,
                             all_reduce_sum=dist.all_reduce_sum, scale_rewards=cfg.scale_rewards)
    exp.rewards, exp.advantages, exp.returns, exp.kl = adv.rewards, adv.advantages, adv.returns, adv.kl


def global_counts(mb: Experience) -> tuple[float, float]:
    """(tokens, sequences) in the loss over all ranks, divided by the world size: the normalisers
    that make the rank-averaged gradient that of the global batch."""
    norm = dist.all_reduce_sum(torch.tensor([mb.loss_mask.sum().item(), float(len(mb))], dtype=torch.float64))
    return max(norm[0].item(), 1.0) / dist.world_size(), norm[1].item() / dist.world_size()


def ppo_update(models: Trainables, mb: Experience, s: UpdateSettings, *, kl_coef: float, group_size: int = 1,
               ptx_batch: Optional[dict] = None, guard: Optional[Callable[[torch.Tensor], bool]] = None,
               train_actor: bool = True) -> UpdateStats:
    """One optimiser step of the actor (and of the critic) on the mini-batch ``mb``.

    ``mb.old_logprobs`` None means this is the batch's only update: its own logprobs, detached, are
    the old ones (ratio exactly 1), written back into ``mb`` with the KL they give. ``group_size`` G
    runs the actor's pass on packed groups. ``ptx_batch``: an SFT batch (input_ids, attention_mask,
    labels) whose loss joins the actor loss. ``guard(loss)`` False skips that step (a non-finite
    loss on some rank); every rank calls it the same number of times. ``train_actor`` False (the
    critic's warm-up, --freezing_actor_steps) updates the critic alone; the actor, still the
    reference, gets no pass: its old logprobs are the reference's."""
    guard = guard or (lambda loss: True)
    n_tok, n_seq = global_counts(mb)
    agg = dict(loss_agg=s.loss_agg, num_tokens=n_tok, num_seqs=n_seq, norm_constant=s.norm_constant)
    stats = actor_update(models, mb, s, kl_coef, group_size, ptx_batch, guard, agg) if train_actor else UpdateStats()
    if not train_actor and mb.old_logprobs is None:
        mb.old_logprobs = mb.ref_logprobs
    if models.critic is not None:
        v = critic_forward(models.critic, mb.sequences, mb.attention_mask, mb.prompt_len)
        vf_loss, vs = clipped_value_loss(v, mb.values, mb.returns, mb.action_mask, s.cliprange_value, **agg)
        if guard(vf_loss):
            models.critic.backward(vf_loss)
            models.critic.step()
        stats.value_loss, stats.value_clip_frac = vf_loss.item(), float(vs["vf_clip_frac"])
    if models.ema is not None and train_actor:
        models.ema.update()
    return stats


def actor_update(models: Trainables, mb: Experience, s: UpdateSettings, kl_coef: float, group_size: int,
                 ptx_batch: Optional[dict], guard: Callable[[torch.Tensor], bool], agg: dict) -> UpdateStats:
    """The actor's half of :func:`ppo_update`: policy loss (+ entropy bonus, KL in the loss, PTX), one step.
    ``agg``: the loss aggregation and its global counts."""
    logp, entropy = actor_forward(models.actor, mb.sequences, mb.attention_mask, mb.prompt_len, s.temperature,
                                  with_entropy=True, group_size=group_size, entropy_grad=s.entropy_coef > 0)
    if mb.old_logprobs is None:
        mb.old_logprobs = logp.detach()
        mb.kl = kl_estimate(mb.old_logprobs, mb.ref_logprobs, s.kl_estimator) * mb.action_mask
    pg_loss, pg = policy_loss(s.policy_loss, logp, mb.old_logprobs, mb.advantages, mb.loss_mask,
                              (s.clip_eps_low, s.clip_eps_high), **agg)
    loss = pg_loss
    stats = UpdateStats(policy_loss=pg_loss.item(), clip_frac=float(pg["clip_frac"]), approx_kl=float(pg["approx_kl"]),
                        entropy=masked_mean(entropy.detach(), mb.action_mask).item())
    if s.entropy_coef > 0:
        entropy_term = aggregate_loss(entropy, mb.loss_mask, **agg)
        loss = loss - s.entropy_coef * entropy_term
        stats.entropy_loss = entropy_term.item()
    if s.kl_in_loss and kl_coef > 0:
        kl_term = kl_loss(logp, mb.ref_logprobs, mb.loss_mask, s.kl_estimator, s.loss_agg, num_tokens=agg["num_tokens"],
                          num_seqs=agg["num_seqs"], norm_constant=s.norm_constant)
        loss = loss + kl_coef * kl_term
        stats.kl_loss = kl_term.item()
    if ptx_batch is not None and is_zero3_partitioned(models.actor):
        ptx_apart(models.actor, loss, ptx_batch, s.unsup_coef, guard, stats)
        return stats
    if ptx_batch is not None:
        loss = loss + s.unsup_coef * ptx_term(models.actor, ptx_batch, stats)
    if guard(loss):
        models.actor.backward(loss)
        models.actor.step()
    return stats


def ptx_term(actor: Any, ptx_batch: dict, stats: UpdateStats) -> torch.Tensor:
    """The PTX (pretraining) SFT loss of ``actor`` on ``ptx_batch``, before its coefficient (logged in ``stats``)."""
    logits = actor(input_ids=ptx_batch["input_ids"], attention_mask=ptx_batch["attention_mask"], use_cache=False).logits
    ptx_loss, _ = sft_loss(logits, ptx_batch["labels"])
    stats.ptx_loss = ptx_loss.item()
    return ptx_loss


def ptx_apart(actor: Any, loss: torch.Tensor, ptx_batch: dict, unsup_coef: float, guard: Callable[[torch.Tensor], bool],
              stats: UpdateStats) -> None:
    """One optimiser step of a ZeRO-3 actor on ``loss + unsup_coef * PTX``, in two backwards: ZeRO-3 reduces a
    parameter's gradient once a backward, so the two forwards cannot share one. The first backward is not an
    accumulation boundary, so the second adds to its gradients and the step sees their sum; the PTX forward runs
    after the first backward (DeepSpeed counts a micro-step at the forward after a backward). One guard covers both
    losses; a skipped step drops the first backward's gradients."""
    actor.set_gradient_accumulation_boundary(False)
    actor.backward(loss)
    ptx = unsup_coef * ptx_term(actor, ptx_batch, stats)
    actor.set_gradient_accumulation_boundary(True)
    if guard(loss.detach() + ptx.detach()):
        actor.backward(ptx)
        actor.step()
    else:
        actor.optimizer.zero_grad()


def train_on(models: Trainables, exp: Experience, s: UpdateSettings, *, kl_coef: float, packed_group_size: int,
             single_update: bool, ptx_iter: Optional[Iterator[dict]] = None,
             guard: Optional[Callable[[torch.Tensor], bool]] = None, train_actor: bool = True) -> dict[str, float]:
    """``ppo_epochs`` passes over ``exp`` in shuffled mini-batches (one update each; the whole batch
    when ``single_update``). Mini-batches run packed where the experience passes did: whole groups,
    not trimmed, so that they keep the batch's layout. ``ptx_iter``: SFT batches, one per update, for
    the PTX loss. ``train_actor`` False: the critic alone is trained (its warm-up). Returns the mean of
    each update metric."""
    models.actor.train()
    if models.critic is not None:
        models.critic.train()
    rng = torch.Generator().manual_seed(s.seed + dist.rank())
    groups = packed_group_size if packs_groups(models.actor, exp.prompt_len, exp.action_mask.shape[1], packed_group_size) else 1
    stats = []
    for _ in range(s.ppo_epochs):
        for mb in [exp] if single_update else exp.minibatches(s.minibatch_size, rng, groups):
            ptx = to_device(next(ptx_iter), models.actor.device) if ptx_iter is not None and train_actor else None
            stats.append(ppo_update(models, mb, s, kl_coef=kl_coef, group_size=groups, ptx_batch=ptx, guard=guard,
                                    train_actor=train_actor))
    return mean_metrics(stats)
