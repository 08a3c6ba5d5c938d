"""Statistics of ``rlhfkit eval``, as pure functions of plain numbers: Student's t distribution and
confidence intervals, wins / ties / losses, KL summaries. No torch, numpy or scipy, so each result
can be checked by hand.
"""

from __future__ import annotations

import math
from typing import Sequence

CI_LEVEL = 0.95
CI_METHOD = "Student t (n - 1 degrees of freedom), 95%, two-sided: mean +- t * s / sqrt(n), s the sample std"
TIE_TOL = 1e-6  # rewards closer than this (or identical responses) are a tie


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`); e.g. t_quantile(0.975, 9) = 2.2622."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile wants 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float], level: float = CI_LEVEL) -> dict:
    """Mean, sample std (n - 1) and the t confidence interval of ``values``; the interval is None when n < 2."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci_half_width": None, "ci_low": None, "ci_high": None}
    mean = math.fsum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "std": None, "ci_half_width": None, "ci_low": None, "ci_high": None}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_half_width": half, "ci_low": mean - half, "ci_high": mean + half}


def outcome(actor_reward: float, baseline_reward: float, same_response: bool) -> str:
    """``win`` / ``tie`` / ``loss`` of the actor on one prompt."""
    if same_response or abs(actor_reward - baseline_reward) <= TIE_TOL:
        return "tie"
    return "win" if actor_reward > baseline_reward else "loss"


def win_stats(outcomes: Sequence[str]) -> dict:
    """Counts of ``win`` / ``tie`` / ``loss`` and their rates over all prompts (None when there are
    none); ``win_rate_ties_half`` counts a tie as half a win, ``win_rate_decided`` leaves ties out."""
    n = len(outcomes)
    wins, ties, losses = (sum(o == k for o in outcomes) for k in ("win", "tie", "loss"))
    return {"wins": wins, "ties": ties, "losses": losses, "win_rate": _rate(wins, n), "tie_rate": _rate(ties, n),
            "loss_rate": _rate(losses, n), "win_rate_ties_half": _rate(wins + 0.5 * ties, n),
            "win_rate_decided": _rate(wins, wins + losses)}


def _rate(k: float, n: int) -> float | None:
    return k / n if n else None


def kl_stats(seq_kl: Sequence[float], tokens: Sequence[int]) -> dict:
    """KL per sequence (mean of the per-prompt sums) and per token (total / total response tokens)."""
    total_tokens = int(sum(tokens))
    return {"per_sequence": math.fsum(seq_kl) / len(seq_kl) if seq_kl else None,
            "per_token": math.fsum(seq_kl) / total_tokens if total_tokens else None,
            "tokens": total_tokens}
