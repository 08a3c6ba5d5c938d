"""Masked statistics and token-level helpers (log-probs, entropy, last real token).

Shapes: B batch, T full sequence, A response (action) tokens, V vocabulary.
``mask`` is a 0/1 float or bool tensor; only its non-zero positions are read, so values at
masked positions (even nan/inf) never reach an output.

Sources: verl ``utils/torch_functional.py`` (masked_mean / masked_var / masked_whiten,
logprobs_from_logits, entropy_from_logits); TRL ``trainer/utils.py`` (selective_log_softmax);
Hugging Face ``LlamaForSequenceClassification`` pooling (last non-pad token).
"""

from __future__ import annotations

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "masked_moments",
    "mean_var_from_moments",
    "logprobs_from_logits",
    "entropy_from_logits",
    "last_real_token_index",
    "gather_last_real",
]

# Rows of the flattened [B*T, V] logits processed at once in fp32 (bounds the fp32 copy).
_CHUNK_ROWS = 1024


def _keep(mask: torch.Tensor) -> torch.Tensor:
    """0/1 (float or bool) mask -> bool mask."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is 1.

    x, mask: same shape (e.g. [B, A]). dim: None (all elements -> scalar) or a dim / tuple of dims.
    sum_i x_i * m_i, computed with ``where`` so masked-out nan/inf do not propagate.
    """
    masked = torch.where(_keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (verl ``masked_mean``).

    x, mask: same shape. sum(x * m) / sum(m) along ``dim`` (all elements if None).
    An empty mask (sum(m) == 0) gives 0, not nan.
    """
    count = _keep(mask).sum() if dim is None else _keep(mask).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked-in positions -> scalar (verl ``masked_var``).

    var = mean_m((x - mean_m(x))^2), times n / (n - 1) (Bessel) when ``unbiased``, n = sum(m).
    With n <= 1 the Bessel factor is taken as 1 (so one element gives 0; no error, no nan and no
    host sync).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = _keep(mask).sum().to(x.dtype)
        var = var * n / (n - 1).clamp_min(1)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    mean: torch.Tensor | float | None = None,
    var: torch.Tensor | float | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with masked statistics (verl / TRL ``masked_whiten``).

    x, mask: [B, A] -> [B, A].
    out = (x - mean) / sqrt(var + eps); if not ``shift_mean`` the mean is added back
    (out = (x - mean) / sqrt(var + eps) + mean). Masked positions are 0 in the output.
    ``mean`` / ``var`` default to this tensor's masked mean and unbiased variance; pass them in
    (e.g. from :func:`mean_var_from_moments` after an all-reduce of :func:`masked_moments`) to
    whiten over the global batch.
    """
    if mean is None:
        mean = masked_mean(x, mask)
    if var is None:
        var = masked_var(x, mask, unbiased=True)
    mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device)
    var = torch.as_tensor(var, dtype=x.dtype, device=x.device)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_keep(mask), out, torch.zeros((), dtype=out.dtype, device=out.device))


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[3] float64 tensor (sum x, sum x^2, count) over the masked-in positions.

    Sum it over ranks (one ``all_reduce(SUM)``), then :func:`mean_var_from_moments` gives the
    global-batch mean and variance for :func:`masked_whiten`. float64 so that
    E[x^2] - E[x]^2 does not cancel catastrophically.
    """
    xd = x.detach().to(torch.float64)
    return torch.stack(
        [masked_sum(xd, mask), masked_sum(xd * xd, mask), _keep(mask).sum().to(torch.float64)]
    )


def mean_var_from_moments(moments: torch.Tensor, unbiased: bool = True):
    """(mean, var) as float32 scalars from (sum x, sum x^2, n) (see :func:`masked_moments`).

    mean = S1 / n; var = (S2 / n - mean^2), times n / (n - 1) when ``unbiased`` (factor 1 if n <= 1).
    """
    s1, s2, n = moments.to(torch.float64).unbind(0)
    n_safe = n.clamp_min(1)
    mean = s1 / n_safe
    var = (s2 / n_safe - mean * mean).clamp_min(0)
    if unbiased:
        var = var * n / (n - 1).clamp_min(1)
    return mean.float(), var.float()


def explained_variance(moments_returns: torch.Tensor, moments_residual: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] from the two :func:`masked_moments` (of the returns and of
    ``returns - values``, each summed over ranks): 1 when the critic's values predict the returns exactly,
    0 when they do no better than the returns' mean, negative when worse. nan when the returns do not vary."""
    _, var_r = mean_var_from_moments(moments_returns, unbiased=False)
    _, var_e = mean_var_from_moments(moments_residual, unbiased=False)
    return float("nan") if var_r.item() <= 0 else 1.0 - var_e.item() / var_r.item()


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) per position: logits [..., V] (e.g. [B, T, V]), labels [...] long -> [...] fp32.

    log p(y) = z[y] - logsumexp(z) with z = logits / ``temperature``, computed in fp32 over chunks of
    rows, so a bf16 [B, T, V] tensor is never copied to fp32 (or log-softmaxed) in full (as TRL's
    ``selective_log_softmax`` and verl's ``logprobs_from_logits``); each chunk is divided by the
    temperature after its cast, so the result is that of ``logits.float() / temperature``. Differentiable.
    The caller aligns labels to logits (for a causal LM: logits[:, :-1] with input_ids[:, 1:]).
    Negative labels (e.g. -100) give 0.
    """
    V = logits.shape[-1]
    flat_logits = logits.reshape(-1, V)
    flat_labels = labels.reshape(-1)
    safe = flat_labels.clamp_min(0).unsqueeze(-1)
    out = []
    for start in range(0, flat_logits.shape[0], _CHUNK_ROWS):
        chunk = _fp32(flat_logits[start : start + _CHUNK_ROWS], temperature)
        picked = chunk.gather(-1, safe[start : start + _CHUNK_ROWS]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if out:
        lp = torch.cat(out)
    else:
        lp = flat_logits.new_zeros(0, dtype=torch.float32)
    lp = torch.where(flat_labels >= 0, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return lp.reshape(labels.shape)


def _fp32(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    chunk = chunk.float()
    return chunk if temperature == 1.0 else chunk / temperature


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [..., V] (e.g. [B, T, V]) -> [...] fp32.

    H = logsumexp(z) - sum_v softmax(z)_v z_v (verl ``entropy_from_logits``), in fp32 per chunk.
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    out = []
    for start in range(0, flat.shape[0], _CHUNK_ROWS):
        chunk = _fp32(flat[start : start + _CHUNK_ROWS], temperature)
        p = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(-1))
    ent = torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)
    return ent.reshape(logits.shape[:-1])


def last_real_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the rightmost position whose mask is 1: [B, T] -> [B] long.

    THE rule for where a sequence score is read (reward model in step 2 and step 3, critic):
    with left padding, right padding or both, it is the EOS when the response has one, else the
    last token before padding. Same formula as Hugging Face's ``*ForSequenceClassification``
    pooling: argmax(arange(T) * non_pad) — so it agrees with HF when pad tokens are exactly the
    mask-0 positions. A row with no 1 at all gives 0 (as in HF).
    """
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device)
    return (positions * _keep(attention_mask)).argmax(dim=-1)


def gather_last_real(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values[b, last_real_token_index(attention_mask)[b]]: values [B, T] -> [B]."""
    idx = last_real_token_index(attention_mask)
    return values.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
