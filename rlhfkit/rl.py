"""The RL algorithms of step 3: one registry of algorithms, one of advantage estimators.

An algorithm (``--algo``) is an :class:`AlgoSpec`: whether it trains a critic, where the KL to the
reference goes (into the per-token reward, or into the loss), which advantage estimator it uses, and
its own defaults (DAPO's clip-higher range). An advantage estimator is a function registered with
:func:`register_advantage` (verl's ``core_algos`` style): it turns one batch's scores, logprobs and
values into per-token rewards, advantages and returns by composing the pure functions of
:mod:`rlhfkit.algos`. The PPO loop (:mod:`rlhfkit.ppo`) is the same for every algorithm.

Adding an algorithm touches this file only (plus its tests): register its advantage estimator if it
needs a new one, and add its ``AlgoSpec`` to ``ALGOS``. ``--algo`` choices, validation, the report's
grouping and the README table read this registry.

Nothing here touches models or ranks except through the ``all_reduce_sum`` callable passed in (for
statistics over the global batch). Group statistics (GRPO, DAPO, RLOO): the G samples of a prompt
are generated on the same rank and kept contiguous, so group means and stds need no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from rlhfkit.algos import (
    gae_advantages, group_advantages, gspo_policy_loss, kl_estimate, kl_penalized_rewards, masked_moments, masked_sum,
    masked_whiten, mean_var_from_moments, ppo_policy_loss, reinforce_pp_returns,
)

# --policy_loss: ppo (token ratios) or GSPO's sequence ratio (Zheng et al. 2025), whole-sequence or per-token advantages.
POLICY_LOSSES = ("ppo", "gspo", "gspo_token")
GSPO_CLIP_EPS = (3e-4, 4e-4)  # the GSPO paper's clip range of the sequence ratio (low, high)


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class AdvantageInputs:
    """One batch of experience, as an advantage estimator sees it."""

    scores: torch.Tensor  # [B] sequence scores (after truncation / overlong shaping)
    logprobs: torch.Tensor  # [B, A] behaviour (old) logprobs
    ref_logprobs: torch.Tensor  # [B, A] reference logprobs
    mask: torch.Tensor  # [B, A] float, 1 over the response up to and including EOS
    values: Optional[torch.Tensor]  # [B, A] critic values, or None without a critic
    kl: torch.Tensor  # [B, A] per-token KL estimate to the reference (0 on masked-out tokens)
    kl_coef: float  # beta
    kl_estimator: str  # k1 | k2 | k3
    clip_reward_value: Optional[float]  # sequence scores clipped to [-c, c]; None = no clipping
    gamma: float  # discount
    lam: float  # GAE lambda
    group_size: int  # G samples per prompt, contiguous
    whiten_advantages: bool  # whiten over the whole global batch
    scale_rewards: str  # group-relative advantages: divide by the group's std, the global batch's, or nothing
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]  # sum over ranks (identity on one rank)


@dataclass
class Advantages:
    rewards: torch.Tensor  # [B, A] per-token rewards (KL-penalised where the algorithm says so)
    advantages: torch.Tensor  # [B, A]
    returns: torch.Tensor  # [B, A] value targets (= advantages for critic-free algorithms)
    kl: torch.Tensor  # [B, A] per-token KL estimate to the reference (for metrics and rewards)


AdvantageFn = Callable[["AlgoSpec", AdvantageInputs], Advantages]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(spec, inputs) -> Advantages`` as the advantage estimator ``name``."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return register


@dataclass(frozen=True, kw_only=True)
class AlgoSpec:
    """One ``--algo``."""

    name: str
    advantage: str  # key of ADVANTAGE_ESTIMATORS
    needs_critic: bool = False  # a value model is built (from the step-2 model) and trained
    kl_in_reward: bool = False  # -beta * KL_t is added to the per-token reward
    kl_in_loss: bool = False  # beta * KL is added to the policy loss
    needs_groups: bool = False  # n_samples_per_prompt >= 2 required
    clip_eps: Optional[tuple[float, float]] = None  # the algorithm's (low, high) clip range; None: --cliprange both sides
    whiten_advantages: bool = False  # default --whiten_advantages
    kl_estimator: str = "k1"  # default --kl_estimator: k1 in the reward; k3 in the loss (k1's gradient is 0 on-policy)
    scale_rewards: str = "group"  # default --scale_rewards (group-relative advantages)
    loss_agg: str = "token_mean"  # default --loss_agg
    source: str = ""  # the paper

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"algorithm {self.name!r}: no advantage estimator {self.advantage!r} is registered")


KL_PLACEMENTS = ("reward", "loss", "none")


def with_kl_placement(spec: AlgoSpec, placement: Optional[str]) -> AlgoSpec:
    """``spec`` with the KL to the reference in the per-token reward, in the loss or nowhere (``--kl_placement``);
    None keeps the algorithm's own. A moved KL takes that place's default estimator: k1 in a reward, k3 in the loss."""
    if placement is None:
        return spec
    if placement not in KL_PLACEMENTS:
        raise ValueError(f"unknown KL placement {placement!r}; expected one of {KL_PLACEMENTS}")
    in_reward, in_loss = placement == "reward", placement == "loss"
    if (in_reward, in_loss) == (spec.kl_in_reward, spec.kl_in_loss):
        return spec
    return replace(spec, kl_in_reward=in_reward, kl_in_loss=in_loss, kl_estimator="k3" if in_loss else "k1")


def whiten_global(x: torch.Tensor, mask: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                  shift_mean: bool = True) -> torch.Tensor:
    """``masked_whiten`` with the mean/variance of the whole global batch (all ranks)."""
    mean, var = mean_var_from_moments(all_reduce_sum(masked_moments(x, mask)))
    return masked_whiten(x, mask, shift_mean=shift_mean, mean=mean.to(x.dtype), var=var.to(x.dtype))


def _last_token_rewards(seq_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, A]: each sequence's score on its last response token, 0 elsewhere."""
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    return torch.where(last, seq_scores[:, None].expand_as(mask), torch.zeros_like(mask))


def reward_kl_coef(spec: AlgoSpec, x: AdvantageInputs) -> float:
    """beta where the KL shapes the reward, else 0 (the KL is in the loss, or nowhere)."""
    return x.kl_coef if spec.kl_in_reward else 0.0


@register_advantage("gae")
def gae(spec: AlgoSpec, x: AdvantageInputs) -> Advantages:
    """PPO: KL-penalised per-token rewards, then GAE over the critic's values (Schulman et al. 2016)."""
    rewards, _ = kl_penalized_rewards(x.logprobs, x.ref_logprobs, x.scores, x.mask, reward_kl_coef(spec, x),
                                      x.clip_reward_value, x.kl_estimator)
    advantages, returns = gae_advantages(rewards, x.values, x.mask, x.gamma, x.lam)
    if x.whiten_advantages:
        advantages = whiten_global(advantages, x.mask, x.all_reduce_sum)
    return Advantages(rewards, advantages, returns, x.kl)


@register_advantage("reinforce_pp")
def reinforce_pp(spec: AlgoSpec, x: AdvantageInputs) -> Advantages:
    """REINFORCE++: KL-penalised rewards, discounted returns, normalised over the global batch."""
    rewards, _ = kl_penalized_rewards(x.logprobs, x.ref_logprobs, x.scores, x.mask, reward_kl_coef(spec, x),
                                      x.clip_reward_value, x.kl_estimator)
    returns = reinforce_pp_returns(rewards, x.mask, x.gamma)
    advantages = whiten_global(returns, x.mask, x.all_reduce_sum)
    return Advantages(rewards, advantages, returns, x.kl)


def batch_reward_std(seq_scores: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The unbiased std of the sequence rewards of the whole global batch (all ranks)."""
    _, var = mean_var_from_moments(all_reduce_sum(masked_moments(seq_scores, torch.ones_like(seq_scores))))
    return var.sqrt()


def _group_relative(method: str, spec: AlgoSpec, x: AdvantageInputs) -> Advantages:
    """One advantage per sample from its group's baseline, on every token of it."""
    seq_scores = x.scores.float()
    if spec.kl_in_reward:  # RLOO: the sequence reward carries the KL penalty
        seq_scores = seq_scores - x.kl_coef * masked_sum(x.kl, x.mask, dim=-1)
    if x.clip_reward_value is not None:
        seq_scores = seq_scores.clamp(-x.clip_reward_value, x.clip_reward_value)
    batch_std = batch_reward_std(seq_scores, x.all_reduce_sum) if x.scale_rewards == "batch" else None
    advantages = group_advantages(seq_scores, x.group_size, method=method, scale=x.scale_rewards,
                                  batch_std=batch_std)[:, None] * x.mask
    if x.whiten_advantages:
        advantages = whiten_global(advantages, x.mask, x.all_reduce_sum)
    return Advantages(_last_token_rewards(seq_scores, x.mask), advantages, advantages.clone(), x.kl)


@register_advantage("grpo")
def grpo(spec: AlgoSpec, x: AdvantageInputs) -> Advantages:
    """GRPO: (r_i - mean_group) / (std_group + eps) (Shao et al. 2024)."""
    return _group_relative("grpo", spec, x)


@register_advantage("rloo")
def rloo(spec: AlgoSpec, x: AdvantageInputs) -> Advantages:
    """RLOO: r_i minus the mean of the other G - 1 samples of its group (Ahmadian et al. 2024)."""
    return _group_relative("rloo", spec, x)


ALGOS: dict[str, AlgoSpec] = {spec.name: spec for spec in (
    AlgoSpec(name="ppo", advantage="gae", needs_critic=True, kl_in_reward=True, whiten_advantages=True,
             source="Ouyang et al. 2022; Ziegler et al. 2019"),
    AlgoSpec(name="grpo", advantage="grpo", kl_in_loss=True, needs_groups=True, kl_estimator="k3",
             source="Shao et al. 2024 (DeepSeekMath)"),
    AlgoSpec(name="dr_grpo", advantage="grpo", kl_in_loss=True, needs_groups=True, kl_estimator="k3", scale_rewards="none",
             loss_agg="seq_mean_token_sum_norm", source="Liu et al. 2025 (Dr. GRPO, Understanding R1-Zero-Like Training)"),
    AlgoSpec(name="dapo", advantage="grpo", needs_groups=True, clip_eps=(0.2, 0.28), source="Yu et al. 2025 (DAPO)"),
    AlgoSpec(name="rloo", advantage="rloo", kl_in_reward=True, needs_groups=True, source="Ahmadian et al. 2024"),
    AlgoSpec(name="reinforce_pp", advantage="reinforce_pp", kl_in_reward=True, source="Hu 2025 (REINFORCE++)"),
)}


def compute_advantages(
    spec: AlgoSpec,
    *,
    scores: torch.Tensor,  # [B] sequence scores (after truncation / overlong shaping)
    logprobs: torch.Tensor,  # [B, A] behaviour (old) logprobs
    ref_logprobs: torch.Tensor,  # [B, A]
    mask: torch.Tensor,  # [B, A] 1 over the response up to and including EOS
    values: Optional[torch.Tensor],  # [B, A] or None
    kl_coef: float,
    kl_estimator: str,
    clip_reward_value: Optional[float],
    gamma: float,
    lam: float,
    group_size: int,
    whiten_advantages: bool,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = identity,
    scale_rewards: str = "group",
) -> Advantages:
    """Rewards, advantages, returns and the per-token KL of one batch, by ``spec``'s estimator."""
    mask = mask.float()
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask
    inputs = AdvantageInputs(scores=scores, logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask, values=values, kl=kl,
                             kl_coef=kl_coef, kl_estimator=kl_estimator, clip_reward_value=clip_reward_value, gamma=gamma,
                             lam=lam, group_size=group_size, whiten_advantages=whiten_advantages,
                             scale_rewards=scale_rewards, all_reduce_sum=all_reduce_sum)
    return ADVANTAGE_ESTIMATORS[spec.advantage](spec, inputs)


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: tuple[float, float], loss_agg: str, num_tokens: float, num_seqs: float, norm_constant: float):
    """The actor's clipped surrogate by ``--policy_loss`` -> (loss, stats). GSPO averages over sequences by its
    definition, whatever ``loss_agg`` says."""
    if name == "ppo":
        return ppo_policy_loss(logprobs, old_logprobs, advantages, mask, *clip_eps, loss_agg, num_tokens=num_tokens,
                               num_seqs=num_seqs, norm_constant=norm_constant)
    if name in ("gspo", "gspo_token"):
        return gspo_policy_loss(logprobs, old_logprobs, advantages, mask, *clip_eps,
                                variant="seq" if name == "gspo" else "token", num_seqs=num_seqs)
    raise ValueError(f"unknown policy loss {name!r}; expected one of {POLICY_LOSSES}")
