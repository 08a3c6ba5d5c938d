"""Deterministic phase shares (DeepSpeed-Chat's ``--data_split``) and the train/eval cut.

One dataset feeds the three steps: a permutation of *all* raw row indices, drawn from
``numpy.random.RandomState(seed)``, is cut into three consecutive shares by the ``--data_split``
fractions (``"2,4,4"`` -> 20% / 40% / 40%), as in DeepSpeed-Chat's
``get_raw_dataset_split_index``. Because the permutation depends only on the seed and the number
of rows (not on rank, node, filtering or any cache file), steps 1 and 2 see disjoint rows whatever
each of them skips, and every rank computes the same split.
"""

from __future__ import annotations

import re
from typing import Sequence, TypeVar

import numpy as np

from rlhfkit.errors import DataError

T = TypeVar("T")

STEP_NAMES = {1: "step 1 (SFT)", 2: "step 2 (reward model)", 3: "step 3 (RL)"}


def parse_data_split(data_split: str | Sequence[float]) -> list[float]:
    """``"2,4,4"`` (or ``[2, 4, 4]``) -> ``[0.2, 0.4, 0.4]``; DataError if malformed."""
    if isinstance(data_split, str):
        parts = [p for p in re.split(r"[,\s]+", data_split.strip()) if p]
    else:
        parts = list(data_split)
    try:
        shares = [float(p) for p in parts]
    except (TypeError, ValueError):
        shares = []
    if len(shares) != 3 or any(not np.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
        raise DataError(
            f"--data_split {data_split!r} is malformed: expected three non-negative numbers separated "
            "by commas, the shares of steps 1, 2 and 3 of each dataset, e.g. --data_split 2,4,4 "
            "(one dataset split across the three steps) or --data_split 10,0,0 (all of it for step 1)."
        )
    total = sum(shares)
    return [s / total for s in shares]


def phase_rows(n_rows: int, fractions: Sequence[float], phase: int, seed: int) -> list[int]:
    """Raw row indices (in permuted order) of ``phase``'s share of a source with ``n_rows`` rows.

    Shares are consecutive slices of one permutation, with boundaries round(cumsum * n), the last
    one n: the three phases are disjoint and together cover every row.
    """
    perm = np.random.RandomState(seed % 2**32).permutation(n_rows)
    bounds = [0] + [int(round(c * n_rows)) for c in np.cumsum(fractions)]
    bounds[-1] = n_rows
    return [int(i) for i in perm[bounds[phase - 1]: bounds[phase]]]


def cut_eval(items: list[T], eval_fraction: float, max_eval: int | None = None) -> tuple[list[T], list[T]]:
    """(train, eval): the first round(eval_fraction * n) items (at least one when n >= 2 and
    eval_fraction > 0, at most n - 1, at most ``max_eval``) are eval, the rest train.

    ``items`` are already in permuted order, so the eval rows are a random sample.
    """
    n = len(items)
    k = 0
    if eval_fraction > 0 and n >= 2:
        k = min(n - 1, max(1, int(round(eval_fraction * n))))
    if max_eval is not None:
        k = min(k, max(0, max_eval))
    return items[k:], items[:k]
