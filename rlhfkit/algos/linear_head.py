"""A linear Bradley-Terry head fitted exactly on frozen features: the reward model r(x) = w . f(x).

With f_c, f_r the features of a pair's chosen and rejected sequence, the Bradley-Terry likelihood of
the preference is sigmoid(w . (f_c - f_r)), so fitting w is logistic regression without intercept on the
differences d = f_c - f_r, all labelled 1:

    loss(w) = mean_i softplus(-w . d_i) + l2 / 2 * |w|^2

It is convex; L-BFGS solves it to the optimum in float64. ``l2`` is chosen by k-fold cross-validation
on the training pairs alone. Features are standardised first (mean and std over all the sequences'
features), so one grid of ``l2`` fits any model's scale; the weight returned applies to raw features.
"""

from __future__ import annotations

from typing import Sequence

import torch

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


def bt_objective(w: torch.Tensor, diffs: torch.Tensor, l2: float) -> torch.Tensor:
    """mean softplus(-w . d) + l2/2 |w|^2 over the rows of ``diffs`` [N, H]."""
    return torch.nn.functional.softplus(-(diffs @ w)).mean() + 0.5 * l2 * (w @ w)


def fit_bt_weights(diffs: torch.Tensor, l2: float, max_iter: int = 500) -> torch.Tensor:
    """The minimiser w [H] of :func:`bt_objective` (float64, L-BFGS with a strong-Wolfe line search; from 0)."""
    d = diffs.double()
    w = torch.zeros(d.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = bt_objective(w, d, l2)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def fold_ids(n: int, folds: int, seed: int) -> torch.Tensor:
    """A fold number in [0, folds) for each of ``n`` rows, balanced, in a seeded random order."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    ids = torch.empty(n, dtype=torch.long)
    ids[order] = torch.arange(n) % folds
    return ids


def cv_accuracy(diffs: torch.Tensor, l2: float, folds: int, seed: int) -> float:
    """Mean held-out-fold pair accuracy (w . d > 0) of the fit with ``l2``, over ``folds`` folds."""
    fold = fold_ids(diffs.shape[0], folds, seed)
    right = 0
    for k in range(folds):
        w = fit_bt_weights(diffs[fold != k], l2)
        right += int((diffs[fold == k].double() @ w > 0).sum())
    return right / diffs.shape[0]


def fit_linear_bt_head(chosen: torch.Tensor, rejected: torch.Tensor, l2_grid: Sequence[float] = L2_GRID,
                       folds: int = 5, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Fit the head on pairs of features (``chosen``, ``rejected`` [N, H]): standardise, choose ``l2`` from
    ``l2_grid`` by ``folds``-fold cross-validated accuracy (ties: the larger l2), refit on all pairs.
    -> (weight [H] float64 on raw features, {"l2", "cv_accuracy": {l2: acc}, "train_accuracy"})."""
    both = torch.cat([chosen, rejected]).double()
    scale = both.std(dim=0).clamp_min(1e-6)
    diffs = (chosen.double() - rejected.double()) / scale
    scores = {l2: cv_accuracy(diffs, l2, folds, seed) for l2 in l2_grid}
    best = max(l2_grid, key=lambda l2: (scores[l2], l2))
    w = fit_bt_weights(diffs, best)
    train_acc = float((diffs @ w > 0).double().mean())
    return w / scale, {"l2": best, "cv_accuracy": scores, "train_accuracy": train_acc}
