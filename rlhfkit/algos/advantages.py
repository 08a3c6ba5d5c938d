"""Advantage estimators: GAE (PPO), GRPO / RLOO group baselines, REINFORCE++ returns, DAPO
overlong shaping.

Shapes: B batch, A response (action) tokens, N = number of samples (= groups * G).
``mask`` [B, A] is 1 over the response up to and including EOS, 0 after. All functions here
run without autograd (advantages are constants for the losses).
"""

from __future__ import annotations

import torch

from .stats import _keep

__all__ = ["gae_advantages", "group_advantages", "reinforce_pp_returns", "overlong_penalty", "REWARD_SCALES"]

REWARD_SCALES = ("group", "batch", "none")  # what divides GRPO's group-centred rewards


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
):
    """Generalised advantage estimation -> (advantages [B, A], returns [B, A]), fp32.

    rewards, values, mask: [B, A]. Backwards over the masked-in response (Schulman et al. 2016;
    verl ``compute_gae_advantage_return``):
      delta_t = r_t + gamma V_{t+1} - V_t
      A_t     = delta_t + gamma lam A_{t+1}
      R_t     = A_t + V_t
    with V and A past the end of the response = 0. Masked positions are skipped (the recursion
    carries V_{t+1} and A_{t+1} over them, as verl does), so rewards / values there influence
    nothing, and advantages / returns are 0 there. Vectorised over B, a loop over A.
    """
    keep = _keep(mask)
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(keep, rewards.float(), zero)
    v = torch.where(keep, values.float(), zero)
    B, A = r.shape
    next_value = torch.zeros(B, dtype=torch.float32, device=r.device)
    next_adv = torch.zeros_like(next_value)
    advs = [None] * A
    for t in range(A - 1, -1, -1):
        m = keep[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(m, adv, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
        advs[t] = torch.where(m, adv, zero)
    advantages = torch.stack(advs, dim=1) if A else r.clone()
    returns = torch.where(keep, advantages + v, zero)
    return advantages, returns


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor,
    group_size: int,
    method: str = "grpo",
    eps: float = 1e-6,
    scale: str = "group",
    batch_std=None,
) -> torch.Tensor:
    """Outcome advantages from a group baseline: scores [N] -> [N] fp32, N = n_groups * G.

    Each group's G samples are contiguous in ``scores``.
      grpo: A_i = (r_i - mean_g) / (std + eps), where ``scale`` says which std (TRL ``scale_rewards``):
            group: std_g, the UNBIASED std of the group (torch.std), as verl
                   ``compute_grpo_outcome_advantage`` and TRL ``GRPOTrainer`` (Shao et al. 2024, DeepSeekMath);
            batch: ``batch_std``, the caller's unbiased std of the rewards of the whole global batch
                   (TRL ``scale_rewards="batch"``; Hu et al. 2025 argue it is more robust than the group's);
            none:  no division, A_i = r_i - mean_g (Dr. GRPO, Liu et al. 2025: dividing by the group's std
                   weights nearly-solved and nearly-failed prompts up).
      rloo: A_i = r_i - (sum_g - r_i) / (G - 1), the leave-one-out baseline (Ahmadian et al.
            2024; Kool et al. 2019).
    A group whose scores are all equal gets exactly 0 (not nan, not rounding noise).
    G must be >= 2 for both methods (raises ValueError; a one-sample group has no baseline).
    Broadcast to tokens with ``adv[:, None] * mask``.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for {method!r} advantages, got {group_size}")
    if scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores are not a whole number of groups of {group_size}")
    s = scores.float().reshape(-1, group_size)
    flat_group = (s.amax(dim=1, keepdim=True) == s.amin(dim=1, keepdim=True))
    if method == "grpo":
        adv = s - s.mean(dim=1, keepdim=True)
        if scale == "group":
            adv = adv / (s.std(dim=1, keepdim=True) + eps)
        elif scale == "batch":
            if batch_std is None:
                raise ValueError("scale='batch' needs batch_std, the std of the global batch's rewards")
            adv = adv / (torch.as_tensor(batch_std, dtype=adv.dtype, device=adv.device) + eps)
        elif scale != "none":
            raise ValueError(f"unknown scale {scale!r}; expected one of {REWARD_SCALES}")
    elif method == "rloo":
        baseline = (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
        adv = s - baseline
    else:
        raise ValueError(f"unknown group advantage method {method!r}; expected 'grpo' or 'rloo'")
    adv = torch.where(flat_group, torch.zeros((), dtype=adv.dtype, device=adv.device), adv)
    return adv.reshape(-1)


@torch.no_grad()
def reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted token returns for REINFORCE++ (Hu 2025): rewards, mask [B, A] -> [B, A] fp32.

      G_t = r_t + gamma G_{t+1}, backwards over the masked-in response, G past the end = 0.
    Masked positions are skipped and are 0 in the output. The REINFORCE++ advantages are these
    returns whitened over the global batch: ``masked_whiten(G, mask, mean=..., var=...)`` with the
    all-reduced mean / var (OpenRLHF ``get_cumulative_returns`` + global normalisation).
    """
    keep = _keep(mask)
    zero = torch.zeros((), dtype=torch.float32, device=rewards.device)
    r = torch.where(keep, rewards.float(), zero)
    B, A = r.shape
    running = torch.zeros(B, dtype=torch.float32, device=r.device)
    out = [None] * A
    for t in range(A - 1, -1, -1):
        m = keep[:, t]
        g = r[:, t] + gamma * running
        running = torch.where(m, g, running)
        out[t] = torch.where(m, g, zero)
    return torch.stack(out, dim=1) if A else r.clone()


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13): lengths [N] -> [N] fp32, <= 0.

    With L_exp = max_len - buffer_len:
      0                                              if |y| <= L_exp
      -penalty_factor * (|y| - L_exp) / buffer_len   if L_exp < |y| <= max_len
      -penalty_factor                                if |y| > max_len
    (verl DAPO reward manager). ``buffer_len`` = 0 gives a hard -penalty_factor above max_len.
    Add it to the sequence score before computing advantages.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"need 0 <= buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths).float()
    if buffer_len == 0:
        frac = (lengths > max_len).float()
    else:
        frac = ((lengths - (max_len - buffer_len)) / buffer_len).clamp(0.0, 1.0)
    return -penalty_factor * frac


def lowest_real_score(scores: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """[1]: the lowest score of a non-empty response in ``scores`` [N] (``empty`` [N] bool: EOS came
    first), +inf when there is none. Its min over ranks is :func:`floor_empty_scores`' ``lowest``."""
    real = torch.where(empty, torch.full_like(scores, float("inf")), scores)
    return real.min().reshape(1) if len(real) else scores.new_full((1,), float("inf"))


def floor_empty_scores(scores: torch.Tensor, empty: torch.Tensor, lowest: torch.Tensor) -> torch.Tensor:
    """Scores [N] with each empty response's (EOS first) capped at ``lowest``, the lowest score of a
    non-empty response in the global batch (:func:`lowest_real_score`, min over ranks).

    A reward model is fitted on real answers and never sees an empty one; its score there is an
    extrapolation, and can be its highest (measured on hh-rlhf reward models: an empty answer scored
    above the step-1 model's answers, and a long PPO run learnt to answer nothing). Capped, an empty
    answer is never better than the worst real one, and keeps its score when that is lower.
    DeepSpeed-Chat drops answers of <= 1 token from the batch instead. With no non-empty response
    anywhere (``lowest`` +inf) the scores are returned unchanged.
    """
    if not bool(torch.isfinite(lowest).all()):
        return scores
    return torch.where(empty, torch.minimum(scores, lowest.to(scores.dtype)), scores)
