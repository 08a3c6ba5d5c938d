"""Statistics of ``rlhfkit eval``, as pure functions of plain numbers: Student's t distribution and
confidence intervals, wins / ties / losses, KL summaries, and win rates with a bootstrap interval over
prompts, plain and length-controlled. No torch; numpy only for the bootstrap (its resamples run as one
array), so each result can be checked by hand.

Samples: with N samples per prompt, item k of a list is sample k % N of prompt k // N, and actor sample
j of a prompt is paired with baseline sample j (a *pair*). ``groups`` names each item's prompt.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

CI_LEVEL = 0.95
CI_METHOD = ("Student t (n - 1 degrees of freedom), 95%, two-sided: mean +- t * s / sqrt(n), s the sample std; "
             "n = prompts, each prompt's value the mean over its samples")
TIE_TOL = 1e-6  # rewards closer than this (or identical responses) are a tie
WIN_VALUE = {"win": 1.0, "tie": 0.5, "loss": 0.0}  # a tie counts as half a win
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_METHOD = ("percentile bootstrap over prompts (a prompt is resampled with all its samples), "
                    f"{BOOTSTRAP_RESAMPLES} resamples, 95%, numpy default_rng(seed)")
LC_METHOD = ("length-controlled win rate: logistic regression of the pair's win (1, a tie 0.5, 0) on the response-length "
             "difference (actor - baseline tokens), P(win) = sigmoid(a + b * diff), reported at diff = 0: sigmoid(a)")
LC_RIDGE = 1e-6  # L2 penalty on the slope (length difference scaled to RMS 1): keeps it finite when wins separate by length
LC_MAX_ITER = 100


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


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion k/n ((0, 1) when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


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


def group_means(values: Sequence[float], groups: Sequence) -> list[float]:
    """The mean of ``values`` within each group, groups in order of first appearance (a prompt's mean over its samples)."""
    sums: dict = {}
    for v, g in zip(values, groups):
        sums.setdefault(g, []).append(v)
    return [math.fsum(vs) / len(vs) for vs in sums.values()]


def resample_indices(n_groups: int, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0):
    """[n_resamples, n_groups] group indices drawn with replacement (numpy ``default_rng(seed)``): one bootstrap
    resample of the prompts per row."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, n_groups, size=(n_resamples, n_groups))


def resample_weights(indices, item_group: Sequence[int]):
    """[R, M]: how often each of the M items is drawn in each resample, i.e. how often its group is."""
    import numpy as np

    counts = np.zeros((indices.shape[0], int(np.max(item_group)) + 1 if len(item_group) else 0))
    np.add.at(counts, (np.arange(indices.shape[0])[:, None], indices), 1.0)
    return counts[:, np.asarray(item_group, dtype=int)]


def percentile_interval(stats, level: float = CI_LEVEL) -> list[float]:
    """[low, high]: the (1 - level) / 2 and (1 + level) / 2 quantiles of the bootstrap statistics (numpy's
    default linear interpolation: position h = (R - 1) q between the sorted values)."""
    import numpy as np

    lo, hi = np.quantile(np.asarray(stats, dtype=float), [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return [float(lo), float(hi)]


def lc_win_rate(wins: Sequence[float], len_diff: Sequence[float], weights=None, scale: Optional[float] = None):
    """Length-controlled win rate (the AlpacaEval-LC idea, simplified): fit P(win) = sigmoid(a + b * x) by
    weighted maximum likelihood (Newton's method; a win is 1, a tie 0.5, a loss 0), x = ``len_diff`` /
    ``scale`` (default: its root mean square), and return sigmoid(a), the win rate predicted where both
    responses have the same length. ``weights`` [R, M] fits R weighted copies at once (the bootstrap) and
    returns R rates; without it, one float. A tiny ridge on b (:data:`LC_RIDGE`) keeps b finite when the
    wins separate by length; with every difference 0, b stays 0 and the result is the plain win rate."""
    import numpy as np

    y, x = np.asarray(wins, dtype=float), np.asarray(len_diff, dtype=float)
    if scale is None:
        scale = float(np.sqrt(np.mean(x * x))) if len(x) else 0.0
    x = x / (scale or 1.0)
    w = np.ones((1, len(y))) if weights is None else np.atleast_2d(np.asarray(weights, dtype=float))
    a, b = np.zeros(w.shape[0]), np.zeros(w.shape[0])
    for _ in range(LC_MAX_ITER):
        p = 1.0 / (1.0 + np.exp(-np.clip(a[:, None] + b[:, None] * x, -35.0, 35.0)))
        r, h = w * (y - p), w * p * (1.0 - p)
        ga, gb = r.sum(1), (r * x).sum(1) - LC_RIDGE * b
        haa, hab, hbb = h.sum(1), (h * x).sum(1), (h * x * x).sum(1) + LC_RIDGE
        det = haa * hbb - hab * hab
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        a, b = a + da, b + db
        if max(np.max(np.abs(da)), np.max(np.abs(db))) < 1e-12:
            break
    rate = 1.0 / (1.0 + np.exp(-np.clip(a, -35.0, 35.0)))
    return float(rate[0]) if weights is None else rate


def win_rate_intervals(outcomes: Sequence[str], groups: Sequence, len_diff: Sequence[float], *,
                       n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, level: float = CI_LEVEL) -> dict:
    """The win rate (ties as half) and the length-controlled win rate (:func:`lc_win_rate`) of the pairs,
    each with its percentile bootstrap interval over prompts (:data:`BOOTSTRAP_METHOD`); None when there
    are no pairs."""
    import numpy as np

    if not outcomes:
        return {"win_rate_ties_half_ci": None, "lc_win_rate": None, "lc_win_rate_ci": None}
    y = np.array([WIN_VALUE[o] for o in outcomes])
    order = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    item_group = [order[g] for g in groups]
    w = resample_weights(resample_indices(len(order), n_resamples, seed), item_group)
    x = np.asarray(len_diff, dtype=float)
    scale = float(np.sqrt(np.mean(x * x)))
    return {"win_rate_ties_half_ci": percentile_interval((w @ y) / w.sum(1), level),
            "lc_win_rate": lc_win_rate(y, x, scale=scale),
            "lc_win_rate_ci": percentile_interval(lc_win_rate(y, x, w, scale=scale), level)}


def compare(actor: Sequence[float], baseline: Sequence[float], same: Sequence[bool], groups: Sequence,
            len_diff: Sequence[float], *, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[list[str], dict]:
    """Actor against baseline by one scorer, pair by pair -> (each pair's outcome, the statistics): wins /
    ties / losses and their rates (:func:`win_stats`), the win rate's and the length-controlled win rate's
    bootstrap intervals (:func:`win_rate_intervals`), and the paired reward difference's t interval over
    prompts (each prompt's mean difference over its pairs)."""
    outcomes = [outcome(a, b, s) for a, b, s in zip(actor, baseline, same)]
    diffs = group_means([a - b for a, b in zip(actor, baseline)], groups)
    return outcomes, {**win_stats(outcomes), **win_rate_intervals(outcomes, groups, len_diff, n_resamples=n_resamples, seed=seed),
                      "reward_difference": mean_ci(diffs)}
