"""The linear Bradley-Terry head fitted on frozen features (step 2 --fit_head_only), and the held-out pair
statistics (Wilson interval, longer-answer baseline, chosen-shorter accuracy)."""

import math

import pytest
import torch

from rlhfkit.algos.linear_head import bt_objective, fit_bt_weights, fit_linear_bt_head, fold_ids
from rlhfkit.eval_stats import wilson_interval
from rlhfkit.rewards import pair_metrics


def test_bt_fit_by_hand():
    # two pairs say +1, one says -1: sigmoid(w) = 2/3 at the optimum, w = ln 2
    w = fit_bt_weights(torch.tensor([[1.0], [1.0], [-1.0]]), l2=0.0)
    assert w.item() == pytest.approx(math.log(2), abs=1e-6)
    # one pair, L2: -sigmoid(-w) + l2 w = 0; at w = ln 2, sigmoid(-w) = 1/3, so l2 = 1 / (3 ln 2)
    w = fit_bt_weights(torch.tensor([[1.0]]), l2=1 / (3 * math.log(2)))
    assert w.item() == pytest.approx(math.log(2), abs=1e-6)


def test_bt_fit_is_the_optimum_by_autograd():
    g = torch.Generator().manual_seed(0)
    diffs = torch.randn(200, 5, generator=g, dtype=torch.float64) + torch.tensor([0.5, 0, 0, -0.3, 0], dtype=torch.float64)
    w = fit_bt_weights(diffs, l2=0.1).requires_grad_(True)
    (grad,) = torch.autograd.grad(bt_objective(w, diffs, 0.1), w)
    assert grad.abs().max() < 1e-7
    # and it is lower than a nudge in every direction
    best = bt_objective(w.detach(), diffs, 0.1)
    for k in range(5):
        step = torch.zeros(5, dtype=torch.float64)
        step[k] = 1e-3
        assert bt_objective(w.detach() + step, diffs, 0.1) > best and bt_objective(w.detach() - step, diffs, 0.1) > best


def test_folds_are_balanced_and_seeded():
    ids = fold_ids(23, 5, seed=3)
    assert sorted(torch.bincount(ids).tolist()) == [4, 4, 5, 5, 5]
    assert torch.equal(ids, fold_ids(23, 5, seed=3)) and not torch.equal(ids, fold_ids(23, 5, seed=4))


def test_head_finds_the_preference_direction_at_any_feature_scale():
    g = torch.Generator().manual_seed(1)
    n, h = 300, 8
    rejected = torch.randn(n, h, generator=g)
    chosen = torch.randn(n, h, generator=g)
    chosen[:, 2] += 1.0  # the preferred side is higher along feature 2, nothing else differs
    w, report = fit_linear_bt_head(chosen, rejected)
    assert w.abs().argmax().item() == 2 and w[2] > 0
    assert report["l2"] in report["cv_accuracy"] and report["cv_accuracy"][report["l2"]] == max(report["cv_accuracy"].values())
    # features scaled by 10 (or shifted): the same standardised fit, so the raw weight is 10x smaller
    w10, _ = fit_linear_bt_head(10 * chosen + 3, 10 * rejected + 3)
    torch.testing.assert_close(w10 * 10, w, rtol=1e-5, atol=1e-7)
    # fresh pairs from the same law: well above chance
    fresh_r, fresh_c = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    fresh_c[:, 2] += 1.0
    assert ((fresh_c.double() - fresh_r.double()) @ w > 0).double().mean() > 0.7


def test_wilson_interval_by_hand():
    # p = 0.8, n = 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416, half 1.96 sqrt(0.016 + 0.009604) / 1.38416
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_pair_metrics_baselines_by_hand():
    chosen = torch.tensor([1.0, 0.0, 2.0, 0.5])
    rejected = torch.tensor([0.0, 1.0, 1.0, 0.5])   # right, wrong, right, tie (counts wrong)
    c_len = torch.tensor([10, 5, 7, 3])
    r_len = torch.tensor([4, 9, 7, 8])               # chosen longer, shorter, equal, shorter
    m = pair_metrics(chosen, rejected, c_len, r_len)
    assert m["accuracy"] == 0.5 and m["pairs"] == 4
    assert m["longer_baseline"] == (1 + 0 + 0.5 + 0) / 4
    assert m["chosen_shorter_pairs"] == 2 and m["chosen_shorter_accuracy"] == 0.0  # pairs 2 and 4: wrong, tie
    assert (m["accuracy_ci_low"], m["accuracy_ci_high"]) == wilson_interval(2, 4)
    assert m["margin"] == pytest.approx((1 - 1 + 1 + 0) / 4)
