"""The RL algorithms of step 3 as compositions of the pure functions in :mod:`rlhfkit.algos`.

One registry entry per ``--algo``: whether a critic exists, where the KL to the reference goes (into
the per-token reward, or into the loss), which advantage estimator, which clip range. The PPO loop
in ``step3_ppo/main.py`` is the same for all of them; nothing here touches models or ranks except
through the ``all_reduce_sum`` callable passed in (for statistics over the global batch).

Group statistics (GRPO, DAPO, RLOO): the G samples of a prompt are generated on the same rank and
kept contiguous, so group means/stds are computed locally with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlhfkit.algos import (
    gae_advantages, group_advantages, kl_estimate, kl_penalized_rewards, masked_moments, masked_sum, masked_whiten,
    mean_var_from_moments, reinforce_pp_returns,
)


@dataclass(frozen=True)
class AlgoSpec:
    name: str
    needs_critic: bool  # a value model is built and trained
    kl_in_reward: bool  # -beta * KL_t is added to the per-token reward
    kl_in_loss: bool  # beta * KL (k3 by default) is added to the policy loss
    advantage: str  # gae | grpo | rloo | reinforce_pp
    needs_groups: bool  # n_samples_per_prompt >= 2 required
    clip_eps: tuple[float, float] = (0.2, 0.2)  # default (low, high) when the flags are unset
    source: str = ""


ALGOS: dict[str, AlgoSpec] = {
    "ppo": AlgoSpec("ppo", True, True, False, "gae", False, source="Ouyang et al. 2022; Ziegler et al. 2019"),
    "grpo": AlgoSpec("grpo", False, False, True, "grpo", True, source="Shao et al. 2024 (DeepSeekMath)"),
    "dapo": AlgoSpec("dapo", False, False, False, "grpo", True, (0.2, 0.28), source="Yu et al. 2025 (DAPO)"),
    "rloo": AlgoSpec("rloo", False, True, False, "rloo", True, source="Ahmadian et al. 2024"),
    "reinforce_pp": AlgoSpec("reinforce_pp", False, True, False, "reinforce_pp", False, source="Hu 2025 (REINFORCE++)"),
}


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def whiten_global(x: torch.Tensor, mask: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                  shift_mean: bool = True) -> torch.Tensor:
    """``masked_whiten`` with the mean/variance of the whole global batch (all ranks)."""
    mean, var = mean_var_from_moments(all_reduce_sum(masked_moments(x, mask)))
    return masked_whiten(x, mask, shift_mean=shift_mean, mean=mean.to(x.dtype), var=var.to(x.dtype))


@dataclass
class Advantages:
    rewards: torch.Tensor  # [B, A] per-token rewards (KL-penalised where the algorithm says so)
    advantages: torch.Tensor  # [B, A]
    returns: torch.Tensor  # [B, A] value targets (= advantages for critic-free algorithms)
    kl: torch.Tensor  # [B, A] per-token KL estimate to the reference (for metrics and rewards)


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
) -> Advantages:
    mask = mask.float()
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask
    if spec.advantage == "gae":
        rewards, _ = kl_penalized_rewards(logprobs, ref_logprobs, scores, mask, kl_coef, clip_reward_value, kl_estimator)
        advantages, returns = gae_advantages(rewards, values, mask, gamma, lam)
        if whiten_advantages:
            advantages = whiten_global(advantages, mask, all_reduce_sum)
        return Advantages(rewards, advantages, returns, kl)
    if spec.advantage == "reinforce_pp":
        rewards, _ = kl_penalized_rewards(logprobs, ref_logprobs, scores, mask, kl_coef, clip_reward_value, kl_estimator)
        returns = reinforce_pp_returns(rewards, mask, gamma)
        advantages = whiten_global(returns, mask, all_reduce_sum)  # REINFORCE++: normalised over the global batch
        return Advantages(rewards, advantages, returns, kl)
    # group-relative, sequence-level: one advantage per sample, on every token of it
    seq_scores = scores.float()
    if spec.kl_in_reward:  # RLOO: the sequence reward carries the KL penalty
        seq_scores = seq_scores - kl_coef * masked_sum(kl, mask, dim=-1)
    if clip_reward_value is not None:
        seq_scores = seq_scores.clamp(-clip_reward_value, clip_reward_value)
    adv_seq = group_advantages(seq_scores, group_size, method=spec.advantage)
    advantages = adv_seq[:, None] * mask
    if whiten_advantages:
        advantages = whiten_global(advantages, mask, all_reduce_sum)
    rewards = torch.zeros_like(mask)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    rewards = torch.where(last, seq_scores[:, None].expand_as(mask), rewards)
    return Advantages(rewards, advantages, advantages.clone(), kl)
