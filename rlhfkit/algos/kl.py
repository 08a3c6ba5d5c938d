"""Per-token KL estimators and KL-penalised PPO rewards.

Shapes: B batch, A response (action) tokens. ``mask`` [B, A] is 1 over the response up to and
including EOS, 0 after.

Sources: J. Schulman, "Approximating KL Divergence" (2020) for k1/k2/k3; Ziegler et al. 2019
("Fine-Tuning Language Models from Human Preferences") and DeepSpeed-Chat / verl
``apply_kl_penalty`` for the reward shaping.
"""

from __future__ import annotations

import torch

from .stats import _keep, last_real_token_index

__all__ = ["kl_estimate", "kl_penalized_rewards"]

KL_ESTIMATORS = ("k1", "k2", "k3")

# Bound on the log-ratio inside exp(), so k3 can never overflow to inf.
_LOG_RATIO_CLAMP = 20.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: [B, A], [B, A] -> [B, A].

    With d = logp_ref - logp (Schulman 2020):
      k1 = logp - logp_ref = -d                       (unbiased, can be negative)
      k2 = 0.5 (logp - logp_ref)^2                    (biased, low variance, >= 0)
      k3 = exp(d) - d - 1                             (unbiased, low variance, >= 0; verl "low_var_kl")
    For k3, d is clamped to [-20, 20] and exp(d) - 1 is computed as expm1(d) so the result is
    finite and never negative.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        d = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.expm1(d) - d).clamp_min(0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_penalized_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_coef,
    clip_reward_value: float | None,
    estimator: str = "k1",
):
    """Per-token PPO rewards with a KL penalty: -> (rewards [B, A], kl [B, A]).

    logprobs, ref_logprobs, mask: [B, A]; scores: [B] (reward-model / rule score per sequence).
      kl_t = kl_estimate(logp_t, logp_ref_t)          on masked-in tokens, 0 elsewhere
      r_t  = -kl_coef * kl_t                           on masked-in tokens, 0 elsewhere
      r_L += clip(score, -c, c)                        L = last masked-in token of the row
    (Ziegler et al. 2019; DeepSpeed-Chat ``compute_rewards``; c = ``clip_reward_value``, None = no
    clip). L is :func:`last_real_token_index` of ``mask``: the EOS when the response has one, the
    last generated token of a truncated response. A row whose mask is all zero gets no score (all
    its rewards are 0). Not differentiated: inputs are detached.
    """
    keep = _keep(mask)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    kl = torch.where(keep, kl_estimate(logprobs.detach().float(), ref_logprobs.detach().float(), estimator), zero)
    rewards = -kl_coef * kl
    score = scores.detach().to(rewards.dtype).reshape(-1)
    if clip_reward_value is not None:
        score = score.clamp(-clip_reward_value, clip_reward_value)
    score = torch.where(keep.any(dim=-1), score, zero)  # empty rows: no score
    last = last_real_token_index(mask)
    rewards = rewards.scatter_add(-1, last.unsqueeze(-1), score.unsqueeze(-1))
    return rewards, kl
