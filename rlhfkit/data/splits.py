"""Deterministic phase shares (DeepSpeed-Chat's ``--data_split``) and the train/eval cut.

One dataset feeds the three steps: a permutation of *all* raw row indices, drawn from
``numpy.random.RandomState(seed)``, is cut into three consecutive shares by the ``--data_split``
fractions (``"2,4,4"`` -> 20% / 40% / 40%), as in DeepSpeed-Chat's
``get_raw_dataset_split_index``. Because the permutation depends only on the seed and the number
of rows (not on rank, node, filtering or any cache file), steps 1 and 2 see disjoint rows whatever
each of them skips, and every rank computes the same split.

Rows that share a prompt (AlpacaEval-style preference sets hold several answer pairs per instruction)
stay together: the permutation is over prompt groups, and a share or the eval cut never splits a
group, so no prompt is trained on by one step and held out by another, or trained on and held out by
the same step. When every prompt is distinct the groups are the rows and the split is row for row
DeepSpeed-Chat's.
"""

from __future__ import annotations

import re
from collections import Counter
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


def phase_rows(n_rows: int, fractions: Sequence[float], phase: int, seed: int,
               groups: Sequence[int] | None = None) -> list[int]:
    """Raw row indices (in permuted order) of ``phase``'s share of a source with ``n_rows`` rows.

    ``groups`` gives each row's group (its prompt), numbered 0, 1, ... in order of first appearance;
    None: every row its own group. The groups are permuted and the shares are consecutive slices of
    that permutation, with boundaries round(cumsum * number of groups), the last one all of them: the
    three phases are disjoint, cover every row, and never split a group. The rows of a group follow
    each other in file order.
    """
    n_groups = n_rows if groups is None else (max(groups) + 1 if len(groups) else 0)
    perm = np.random.RandomState(seed % 2**32).permutation(n_groups)
    bounds = [0] + [int(round(c * n_groups)) for c in np.cumsum(fractions)]
    bounds[-1] = n_groups
    chosen = [int(g) for g in perm[bounds[phase - 1]: bounds[phase]]]
    if groups is None:
        return chosen
    members: dict[int, list[int]] = {}
    for row, g in enumerate(groups):
        members.setdefault(g, []).append(row)
    return [row for g in chosen for row in members[g]]


def cut_eval(items: list[T], eval_fraction: float, max_eval: int | None = None,
             groups: Sequence | None = None) -> tuple[list[T], list[T]]:
    """(train, eval): the first round(eval_fraction * n) items (at least one when n >= 2 and
    eval_fraction > 0, at most n - 1, at most ``max_eval``) are eval, the rest train.

    ``items`` are already in permuted order, so the eval rows are a random sample. With ``groups``
    (each item's group, items of a group adjacent) the cut moves back to the start of the group it
    would split, or, when that leaves no eval item, forward to its end (if a train item remains).
    """
    n = len(items)
    k = 0
    if eval_fraction > 0 and n >= 2:
        k = min(n - 1, max(1, int(round(eval_fraction * n))))
    if max_eval is not None:
        k = min(k, max(0, max_eval))
    if groups is not None and 0 < k < n and groups[k] == groups[k - 1]:
        start = k
        while start > 0 and groups[start - 1] == groups[k]:
            start -= 1
        end = k
        while end < n and groups[end] == groups[k - 1]:
            end += 1
        k = start if start > 0 or max_eval is not None else (end if end < n else 0)
    return items[k:], items[:k]


def cap_per_group(items: list[T], groups: Sequence, cap: int, seed: int) -> list[T]:
    """``items`` (in order) with at most ``cap`` of each group kept: a seeded draw within each group
    (a ``numpy.random.RandomState`` stream of ``seed`` apart from the split's, so every rank keeps the same
    rows), not the first in file order, which a file sorted by model or date would bias."""
    draw = np.random.RandomState((seed + 0x9E3779B9) % 2**32).random_sample(len(items))
    taken: Counter = Counter()
    keep = set()
    for i in np.argsort(draw, kind="stable").tolist():
        if taken[groups[i]] < cap:
            taken[groups[i]] += 1
            keep.add(i)
    return [item for i, item in enumerate(items) if i in keep]


def group_ids(keys: Sequence) -> list[int]:
    """Each key's group number, in order of first appearance: ["b", "a", "b"] -> [0, 1, 0]."""
    numbers: dict = {}
    return [numbers.setdefault(k, len(numbers)) for k in keys]
