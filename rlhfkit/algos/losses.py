"""Losses: one aggregation function, PPO-clip actor, clipped critic, KL-to-reference, pairwise
reward model, SFT and DPO / IPO.

Shapes: B batch, T full sequence, A response (action) tokens, V vocabulary.
``mask`` [B, A] is 1 over the response up to and including EOS, 0 after.

Data-parallel contract: DeepSpeed averages gradients over the W ranks. Pass
``num_tokens = global_tokens / W`` (and ``num_seqs = global_seqs / W``) to every loss here and the
averaged result equals the loss of the whole global batch computed on one rank (verl
``agg_loss`` with ``global_batch_info``, Dr. GRPO's constant normaliser).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kl import _LOG_RATIO_CLAMP, kl_estimate
from .stats import _keep, logprobs_from_logits, masked_mean, masked_sum

__all__ = [
    "IGNORE_INDEX",
    "aggregate_loss",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "clipped_value_loss",
    "kl_loss",
    "pairwise_loss",
    "sft_loss",
    "dpo_loss",
    "simpo_loss",
]

IGNORE_INDEX = -100  # label of a token that carries no loss (prompt, padding): torch's cross-entropy default

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, A] to a scalar. THE one aggregation function (verl ``agg_loss``).

      token_mean              = sum_{i,t} l_it m_it / num_tokens              (DAPO token-level)
      seq_mean_token_mean     = sum_i (sum_t l_it m_it / len_i) / num_seqs    (original GRPO)
      seq_mean_token_sum      = sum_i sum_t l_it m_it / num_seqs
      seq_mean_token_sum_norm = sum_i sum_t l_it m_it / (num_seqs * C)        (Dr. GRPO, TRL ``dr_grpo``)
    len_i = sum_t m_it (a row with len_i = 0 contributes 0). Defaults: num_tokens = sum(m) of this
    batch (at least 1), num_seqs = B. Across W data-parallel ranks pass global count / W (see the
    module docstring); then mean over ranks == the global-batch loss.

    ``norm_constant`` C (required by seq_mean_token_sum_norm): a constant, the same at every step, usually
    the maximum response length (Liu et al. 2025, "Understanding R1-Zero-Like Training"). Then no sample's
    weight depends on its own length or on the batch's (GRPO's 1/len_i favours long wrong answers). It is
    seq_mean_token_sum scaled by 1/C, which keeps the loss on a per-token scale. verl's
    ``seq-mean-token-sum-norm`` divides by C alone, without the number of sequences, so its loss grows with
    the batch; TRL's divides by both, as here.
    """
    keep = _keep(mask)
    if loss_agg == "token_mean":
        if num_tokens is None:
            num_tokens = keep.sum().clamp_min(1)
        return masked_sum(loss_mat, keep) / num_tokens
    if num_seqs is None:
        num_seqs = loss_mat.shape[0]
    if loss_agg == "seq_mean_token_mean":
        per_seq = masked_sum(loss_mat, keep, dim=-1) / keep.sum(dim=-1).clamp_min(1)
        return per_seq.sum() / num_seqs
    if loss_agg == "seq_mean_token_sum":
        return masked_sum(loss_mat, keep) / num_seqs
    if loss_agg == "seq_mean_token_sum_norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a positive norm_constant, got {norm_constant!r}")
        return masked_sum(loss_mat, keep) / (num_seqs * norm_constant)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGG_MODES}")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    loss_agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
):
    """PPO-clip actor loss -> (loss, stats).

    logprobs (with grad), old_logprobs, mask: [B, A]; advantages [B, A] (or [B], broadcast over A).
      ratio_t = exp(logp_t - logp_old_t)         (log-ratio clamped to [-20, 20])
      l_t     = -min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t)
              = max(-ratio_t A_t, -clip(ratio_t, ...) A_t)
    aggregated by :func:`aggregate_loss` (Schulman et al. 2017; eps_low != eps_high is DAPO's
    clip-higher, Yu et al. 2025; verl ``compute_policy_loss``).
    stats (detached scalars, masked means over this batch):
      clip_frac  fraction of tokens where the clipped branch is the larger (= chosen) loss, i.e.
                 the ratio left the band in the direction that clips (verl ``pg_clipfrac``)
      approx_kl  k3 estimate of KL(pi_old || pi): mean of (ratio - 1) - log ratio (CleanRL)
      ratio_mean mean ratio
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    keep = _keep(mask)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss = aggregate_loss(loss_mat, keep, loss_agg, num_tokens, num_seqs, norm_constant)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), keep),
            "approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs, "k3"), keep),
            "ratio_mean": masked_mean(ratio, keep),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


GSPO_VARIANTS = ("seq", "token")


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    variant: str = "seq",
    num_seqs=None,
):
    """GSPO actor loss (Zheng et al. 2025, "Group Sequence Policy Optimization") -> (loss, stats).

    logprobs (with grad), old_logprobs, mask: [B, A]; advantages [B] or [B, A]. Per sequence i, over its
    masked-in tokens (len_i of them):
      s_i = exp(mean_t (logp_it - logp_old_it))              the length-normalised sequence ratio
      seq:   l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  A_i the sequence's advantage
             (with [B, A] advantages: their mean over the sequence's tokens)
      token: s_it = sg[s_i] * pi_t / sg[pi_t]  (= s_i in value; its gradient is s_i * grad logp_it)
             l_i = mean_t -min(s_it A_it, clip(s_it, ...) A_it)
      loss = sum_i l_i / num_seqs                              (the paper's 1/G sum over i)
    The clip ranges are a sequence ratio's: small (the paper: 3e-4 / 4e-4). With one update per rollout
    s_i = 1 and the gradient is GRPO's with seq_mean_token_mean. With equal advantages over a sequence's
    tokens the token variant equals seq in value and gradient. ``num_seqs`` defaults to B; across ranks pass
    the global count / W (module docstring). A sequence without masked-in tokens contributes 0.
    stats: clip_frac (the fraction of sequences, seq, or of tokens, token, whose clipped branch is chosen),
    approx_kl (k3 of the old policy to the new, per token), ratio_mean (mean s_i).
    """
    if variant not in GSPO_VARIANTS:
        raise ValueError(f"unknown GSPO variant {variant!r}; expected one of {GSPO_VARIANTS}")
    keep = _keep(mask)
    lengths = keep.sum(dim=-1)
    has_tokens = lengths > 0
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    seq_log_ratio = masked_sum(log_ratio, keep, dim=-1) / lengths.clamp_min(1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))  # s_i [B]
    adv = advantages.detach().float()
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    if variant == "seq":
        seq_adv = adv if adv.dim() == 1 else masked_sum(adv, keep, dim=-1) / lengths.clamp_min(1)
        unclipped, clipped = -seq_adv * seq_ratio, -seq_adv * seq_ratio.clamp(low, high)
        per_seq = torch.where(has_tokens, torch.maximum(unclipped, clipped), torch.zeros_like(seq_ratio))
        clip_frac = ((clipped > unclipped) & has_tokens).float().sum() / has_tokens.float().sum().clamp_min(1)
    else:
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(logprobs)
        token_ratio = seq_ratio.detach()[:, None] * torch.exp(logprobs - logprobs.detach())  # s_it
        unclipped, clipped = -adv * token_ratio, -adv * token_ratio.clamp(low, high)
        per_seq = masked_sum(torch.maximum(unclipped, clipped), keep, dim=-1) / lengths.clamp_min(1)
        clip_frac = masked_mean((clipped > unclipped).float(), keep)
    if num_seqs is None:
        num_seqs = logprobs.shape[0]
    loss = per_seq.sum() / num_seqs
    with torch.no_grad():
        n = has_tokens.float().sum().clamp_min(1)
        stats = {"clip_frac": clip_frac,
                 "approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs, "k3"), keep),
                 "ratio_mean": (seq_ratio * has_tokens).sum() / n}
    return loss, {k: v.detach() for k, v in stats.items()}


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None,
    loss_agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
):
    """Clipped critic loss -> (loss, stats).

    values (with grad), old_values, returns, mask: [B, A].
      V_clip = clip(V, V_old - c, V_old + c)
      l_t    = 0.5 max((V - R)^2, (V_clip - R)^2)
    aggregated by :func:`aggregate_loss` (PPO2 baselines / DeepSpeed-Chat ``critic_loss_fn`` /
    verl ``compute_value_loss``). ``clip_range`` None: plain 0.5 (V - R)^2.
    stats: ``vf_clip_frac`` = fraction of masked tokens where the clipped error is the larger.
    """
    keep = _keep(mask)
    returns = returns.detach()
    err = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * err
        clip_frac = torch.zeros((), device=values.device)
    else:
        old = old_values.detach()
        v_clip = torch.maximum(torch.minimum(values, old + clip_range), old - clip_range)
        err_clip = (v_clip - returns).square()
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        with torch.no_grad():
            clip_frac = masked_mean((err_clip > err).float(), keep)
    loss = aggregate_loss(loss_mat, keep, loss_agg, num_tokens, num_seqs, norm_constant)
    return loss, {"vf_clip_frac": clip_frac.detach()}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
) -> torch.Tensor:
    """KL-to-reference term of the GRPO loss: logprobs (with grad), ref_logprobs, mask [B, A] -> scalar.

    aggregate_loss(kl_estimate(logp, logp_ref, estimator)) — k3 by default (Shao et al. 2024,
    DeepSeekMath Eq. 4; verl ``kl_penalty(..., "low_var_kl")``). The caller multiplies by beta.
    """
    kl = kl_estimate(logprobs, ref_logprobs.detach(), estimator)
    return aggregate_loss(kl, mask, loss_agg, num_tokens, num_seqs, norm_constant)


def pairwise_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor):
    """Bradley-Terry reward-model loss: chosen, rejected [P] -> (loss, accuracy), scalars.

      loss     = mean_p softplus(r_rejected - r_chosen) = mean_p -log sigmoid(r_chosen - r_rejected)
      accuracy = mean_p [r_chosen > r_rejected]          (detached)
    (Ouyang et al. 2022, InstructGPT; TRL ``RewardTrainer``). softplus is stable: finite for
    any finite margin (e.g. +-1e4). Computed in fp32.
    """
    c = chosen_scores.float()
    r = rejected_scores.float()
    loss = F.softplus(r - c).mean()
    accuracy = (c > r).float().mean().detach()
    return loss, accuracy


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, num_tokens=None):
    """Causal-LM cross entropy: logits [B, T, V], labels [B, T] (IGNORE_INDEX: ignored) -> (loss, n_tokens).

    Shifted as in Hugging Face: logits[:, :-1] predict labels[:, 1:].
      loss = sum_{shifted labels != IGNORE_INDEX} -log p(label) / num_tokens
    num_tokens defaults to n_tokens, this batch's count of non-ignored shifted labels (at least 1);
    across ranks pass global_tokens / W. Computed in fp32, chunked (see
    :func:`~rlhfkit.algos.stats.logprobs_from_logits`). n_tokens is a long scalar tensor.
    """
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    keep = shift_labels != IGNORE_INDEX
    n_tokens = keep.sum()
    nll = -logprobs_from_logits(shift_logits, shift_labels)
    total = masked_sum(nll, keep)
    if num_tokens is None:
        num_tokens = n_tokens.clamp_min(1)
    return total / num_tokens, n_tokens


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
):
    """DPO / IPO loss over P pairs of sequence log-probs [P] -> (loss, chosen_rewards, rejected_rewards).

      h = (pc - rc) - (pr - rr)       p = policy, r = reference, c = chosen, r = rejected
      sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)
               (Rafailov et al. 2023; ls > 0 is conservative DPO, Mitchell 2023; TRL)
      ipo:     (h - 1 / (2 beta))^2     (Azar et al. 2023, as TRL; TRL feeds IPO per-token-mean
               log-probs, pass those if you want its exact behaviour)
    loss = mean over pairs; chosen_rewards = beta (pc - rc), rejected_rewards = beta (pr - rr),
    detached [P]. Computed in fp32.
    """
    pc, pr = policy_chosen_logps.float(), policy_rejected_logps.float()
    rc, rr = ref_chosen_logps.float().detach(), ref_rejected_logps.float().detach()
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected 'sigmoid' or 'ipo'")
    chosen_rewards = (beta * (pc - rc)).detach()
    rejected_rewards = (beta * (pr - rr)).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    gamma: float,
):
    """SimPO (Meng et al. 2024), reference-free, over P pairs [P] -> (loss, chosen_rewards, rejected_rewards).

      r_w = beta / |y_w| * log pi(y_w|x),   r_l = beta / |y_l| * log pi(y_l|x)   (length-normalised rewards)
      loss = mean_p -log sigmoid(r_w - r_l - gamma)
    |y| the response's token count (at least 1). gamma is the target reward margin; TRL's CPO trainer takes
    it as ``simpo_gamma`` / beta ("gamma_beta_ratio"). Rewards detached; fp32.
    """
    chosen = beta * policy_chosen_logps.float() / chosen_lengths.float().clamp_min(1)
    rejected = beta * policy_rejected_logps.float() / rejected_lengths.float().clamp_min(1)
    losses = -F.logsigmoid(chosen - rejected - gamma)
    return losses.mean(), chosen.detach(), rejected.detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
):
    """KTO (Ethayarajh et al. 2024) over N unpaired completions [N] -> (loss, rewards).

      r_i = log pi(y_i|x_i) - log pi_ref(y_i|x_i)            (summed over the completion's tokens)
      z0  = max(0, kl), detached: kl is the mean of r over mismatched pairs (x_i, y_j), j != i
      desirable:    lambda_D (1 - sigmoid(beta (r_i - z0)))
      undesirable:  lambda_U (1 - sigmoid(beta (z0 - r_i)))
      loss = mean over the N completions (TRL's KTOTrainer); rewards = beta r_i, detached.
    ``desirable`` is a bool [N]. Computed in fp32.
    """
    r = policy_logps.float() - ref_logps.float().detach()
    z0 = torch.as_tensor(kl, dtype=torch.float32, device=r.device).detach().clamp_min(0.0)
    losses = torch.where(desirable.bool(), lambda_d * (1.0 - torch.sigmoid(beta * (r - z0))),
                         lambda_u * (1.0 - torch.sigmoid(beta * (z0 - r))))
    return losses.mean(), (beta * r).detach()
