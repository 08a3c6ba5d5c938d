"""KL estimators, KL-penalised rewards, GAE, group advantages, REINFORCE++ returns, overlong shaping."""

import math

import pytest
import torch

from rlhfkit.algos import (
    floor_empty_scores,
    gae_advantages,
    group_advantages,
    kl_estimate,
    kl_penalized_rewards,
    lowest_real_score,
    masked_whiten,
    overlong_penalty,
    reinforce_pp_returns,
)


# ---------------------------------------------------------------- KL estimators
def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - lp  # [-0.5, 1.0]
    assert torch.allclose(kl_estimate(lp, ref, "k1"), torch.tensor([[-1.0 + 1.5, -2.0 + 1.0]]))
    assert torch.allclose(kl_estimate(lp, ref, "k2"), torch.tensor([[0.5 * 0.5**2, 0.5 * 1.0**2]]))
    expected_k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    assert torch.allclose(kl_estimate(lp, ref, "k3"), expected_k3)
    assert torch.allclose(kl_estimate(lp, ref, "k3"), d.exp() - d - 1)
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_k3_nonnegative_and_finite():
    torch.manual_seed(0)
    lp = torch.randn(64, 32) * torch.logspace(-8, 3, 32)
    ref = torch.randn(64, 32) * torch.logspace(-8, 3, 32)
    k3 = kl_estimate(lp, ref, "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    assert (kl_estimate(lp, lp, "k3") == 0).all()
    extreme = kl_estimate(torch.tensor([0.0, -1e4]), torch.tensor([-1e4, 0.0]), "k3")
    assert torch.isfinite(extreme).all() and (extreme >= 0).all()


# ---------------------------------------------------------------- PPO rewards
def expected_loss_gradient(logits, ref_logits, estimator):
    """The exact on-policy expectation over y ~ pi of grad_logits kl_estimate(log pi(y), log pi_ref(y)),
    the gradient a KL term in the loss follows: sum_y pi(y) * grad k(y), with pi(y) as a constant weight."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    per_token = kl_estimate(logp[None], torch.log_softmax(ref_logits, -1)[None], estimator)[0]
    (logp.exp().detach() * per_token).sum().backward()
    return logits.grad


def test_on_policy_k1_loss_gradient_is_zero_and_k3_pulls_toward_the_reference():
    """Why the KL in GRPO's loss defaults to k3: over the policy's own samples the gradient of k1 = log pi - log
    pi_ref averages to 0 (E_pi[grad log pi] = 0), so as a loss term it regularises nothing; k3's gradient,
    (1 - pi_ref/pi) grad log pi, averages to -sum_y pi_ref(y) grad log pi(y) = grad KL(pi_ref || pi)."""
    logits, ref_logits = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.5, 0.0])
    assert torch.allclose(expected_loss_gradient(logits, ref_logits, "k1"), torch.zeros(3), atol=1e-7)
    # by hand: grad_logits log pi(y) = onehot(y) - pi, so -sum_y pi_ref(y) (onehot(y) - pi) = pi - pi_ref
    pi, pi_ref = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
    k3 = expected_loss_gradient(logits, ref_logits, "k3")
    assert torch.allclose(k3, pi - pi_ref, atol=1e-6)
    x = logits.clone().requires_grad_(True)  # the same by autograd: grad of KL(pi_ref || pi)
    (pi_ref * (pi_ref.log() - torch.log_softmax(x, -1))).sum().backward()
    assert torch.allclose(k3, x.grad, atol=1e-6)
    x = logits.clone().requires_grad_(True)  # k2 = (log pi - log pi_ref)^2 / 2: the gradient of KL(pi || pi_ref)
    (torch.softmax(x, -1) * (torch.log_softmax(x, -1) - pi_ref.log())).sum().backward()
    assert torch.allclose(expected_loss_gradient(logits, ref_logits, "k2"), x.grad, atol=1e-6)
    assert not torch.allclose(x.grad, k3, atol=1e-3)  # the two KLs' gradients differ
    step = logits - 1.0 * k3  # a gradient step on the k3 term moves pi toward pi_ref
    assert (torch.softmax(step, -1) - pi_ref).abs().sum() < (pi - pi_ref).abs().sum()


def test_each_algorithm_has_its_own_kl_estimator_and_whitening_defaults():
    from step3_ppo.config import Step3Config

    def estimator(*flags, whiten=False):
        cfg = Step3Config(actor_model_name_or_path="a", data_path="d", output_dir="o", reward_fn="gsm8k",
                          critic_model_name_or_path="c", n_samples_per_prompt=2)
        for name, value in flags:
            setattr(cfg, name, value)
        cfg.validate()
        return cfg.kl_estimator if not whiten else cfg.whiten_advantages

    assert estimator(("algo", "grpo")) == "k3"
    assert [estimator(("algo", a)) for a in ("ppo", "rloo", "reinforce_pp", "dapo")] == ["k1"] * 4
    with pytest.warns(UserWarning, match="k1 in the loss"):
        assert estimator(("algo", "grpo"), ("kl_estimator", "k1")) == "k1"  # an explicit choice stands, with a warning
    # PPO whitens its GAE advantages by default (TRL, OpenRLHF); the group algorithms normalise per group
    assert [estimator(("algo", a), whiten=True) for a in ("ppo", "grpo", "dapo", "rloo", "reinforce_pp")] == [
        True, False, False, False, False]
    assert estimator(("algo", "ppo"), ("whiten_advantages", False), whiten=True) is False


def test_kl_penalized_rewards_score_on_last_real_token():
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5, -1.5, -1.5], [-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor(
        [
            [1, 1, 0, 0],  # EOS at index 1
            [1, 1, 1, 1],  # truncated: mask runs to the end
            [0, 0, 0, 0],  # empty response: no score
        ]
    )
    scores = torch.tensor([0.7, 9.0, 3.0])
    beta, c = 0.1, 5.0
    rewards, kl = kl_penalized_rewards(lp, ref, scores, mask, kl_coef=beta, clip_reward_value=c)
    k0, k1 = -1.0 + 1.5, -2.0 + 1.0
    expected_kl = torch.tensor([[k0, k0, 0, 0], [k1, k1, k1, k1], [0, 0, 0, 0]])
    expected_r = torch.tensor(
        [
            [-beta * k0, -beta * k0 + 0.7, 0, 0],
            [-beta * k1, -beta * k1, -beta * k1, -beta * k1 + 5.0],  # score 9 clipped to 5
            [0, 0, 0, 0],
        ]
    )
    assert torch.allclose(kl, expected_kl)
    assert torch.allclose(rewards, expected_r)
    # no clip when clip_reward_value is None; k3 estimator passes through
    rewards, _ = kl_penalized_rewards(lp, ref, scores, mask, beta, None)
    assert rewards[1, 3].item() == pytest.approx(-beta * k1 + 9.0)
    _, kl3 = kl_penalized_rewards(lp, ref, scores, mask, beta, c, estimator="k3")
    assert torch.allclose(kl3, kl_estimate(lp, ref, "k3") * mask)


def test_kl_penalized_rewards_masked_positions_change_nothing():
    torch.manual_seed(1)
    lp, ref = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]).float()
    scores = torch.randn(3)
    r1, k1 = kl_penalized_rewards(lp, ref, scores, mask, 0.05, 10.0)
    lp2, ref2 = lp.clone(), ref.clone()
    lp2[mask == 0] = 1e6
    ref2[mask == 0] = float("nan")
    r2, k2 = kl_penalized_rewards(lp2, ref2, scores, mask, 0.05, 10.0)
    assert torch.equal(r1, r2) and torch.equal(k1, k2)


# ---------------------------------------------------------------- GAE
def naive_gae(rewards, values, mask, gamma, lam):
    B, A = rewards.shape
    adv = torch.zeros(B, A)
    for b in range(B):
        L = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(L)):
            next_v = values[b, t + 1].item() if t + 1 < L else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[0.1, -0.2, 1.0, 99.0]])
    v = torch.tensor([[0.5, 0.4, 0.3, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    r0, r1, r2 = 0.1, -0.2, 1.0
    v0, v1, v2 = 0.5, 0.4, 0.3
    a2 = r2 + gamma * 0.0 - v2  # V past the end = 0
    a1 = r1 + gamma * v2 - v1 + gamma * lam * a2
    a0 = r0 + gamma * v1 - v0 + gamma * lam * a1
    adv, ret = gae_advantages(r, v, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[a0 + v0, a1 + v1, a2 + v2, 0.0]]))


def test_gae_matches_naive_loop_random_lengths():
    torch.manual_seed(0)
    B, A = 6, 9
    r, v = torch.randn(B, A), torch.randn(B, A)
    lengths = torch.tensor([1, 3, 9, 5, 0, 8])
    mask = (torch.arange(A) < lengths[:, None]).float()
    adv, ret = gae_advantages(r, v, mask, 0.99, 0.95)
    exp_adv, exp_ret = naive_gae(r, v, mask, 0.99, 0.95)
    assert torch.allclose(adv, exp_adv, atol=1e-5)
    assert torch.allclose(ret, exp_ret, atol=1e-5)
    # masked positions change nothing
    r2, v2 = r.clone(), v.clone()
    r2[mask == 0] = 1e9
    v2[mask == 0] = float("inf")
    adv2, ret2 = gae_advantages(r2, v2, mask, 0.99, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    r = torch.tensor([[1.0, 2.0, 3.0]])
    v = torch.tensor([[0.5, 0.25, 0.125]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), 1.0, 1.0)
    assert torch.allclose(ret, torch.tensor([[1.0 + 2.0 + 3.0, 2.0 + 3.0, 3.0]]))
    assert torch.allclose(adv, ret - v)


# ---------------------------------------------------------------- group advantages
def test_grpo_by_hand_with_zero_std_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    adv = group_advantages(scores, 4, "grpo", eps=1e-6)
    mean = 0.5
    std = math.sqrt(4 * 0.25 / (4 - 1))  # unbiased
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    assert torch.allclose(adv[:4], expected)
    assert torch.allclose(adv[:4], (scores[:4] - mean) / (scores[:4].std() + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))  # zero-std group: exactly 0, no nan
    # Dr. GRPO: no std normalisation
    assert torch.allclose(group_advantages(scores, 4, "grpo", scale="none")[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0, 5.0])
    adv = group_advantages(scores, 3, "rloo")
    expected = torch.tensor(
        [1.0 - (2.0 + 6.0) / 2, 2.0 - (1.0 + 6.0) / 2, 6.0 - (1.0 + 2.0) / 2, 0.0, 0.0, 0.0]
    )
    assert torch.allclose(adv, expected)
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0]), 1, "rloo")
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0]), 1, "grpo")  # one sample: no baseline
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2, "rloo")  # not whole groups
    with pytest.raises(ValueError):
        group_advantages(scores, 3, "ppo")


# ---------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_returns_by_hand():
    gamma = 0.5
    r = torch.tensor([[0.0, 0.0, 1.0, 7.0], [2.0, -1.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = reinforce_pp_returns(r, mask, gamma)
    expected = torch.tensor(
        [
            [0.0 + gamma * (0.0 + gamma * 1.0), 0.0 + gamma * 1.0, 1.0, 0.0],
            [2.0 + gamma * (-1.0 + gamma * (3.0 + gamma * 4.0)), -1.0 + gamma * (3.0 + gamma * 4.0), 3.0 + gamma * 4.0, 4.0],
        ]
    )
    assert torch.allclose(out, expected)
    adv = masked_whiten(out, mask)
    assert adv[0, 3].item() == 0.0
    assert abs(adv[mask.bool()].mean().item()) < 1e-6


# ---------------------------------------------------------------- DAPO overlong
def test_overlong_penalty_edges():
    max_len, buf, f = 20, 4, 1.0  # expected length 16
    lengths = torch.tensor([0, 15, 16, 17, 18, 20, 21, 100])
    expected = torch.tensor([0.0, 0.0, 0.0, -f * 1 / buf, -f * 2 / buf, -f, -f, -f])
    assert torch.allclose(overlong_penalty(lengths, max_len, buf, f), expected)
    assert torch.allclose(overlong_penalty(lengths, max_len, 0, 0.5), torch.tensor([0, 0, 0, 0, 0, 0, -0.5, -0.5]))
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 10, 11, 1.0)


# ---------------------------------------------------------------- empty responses
def test_empty_responses_are_capped_at_the_lowest_real_score_by_hand():
    scores = torch.tensor([0.5, 2.0, -1.0, 3.0, -4.0])
    empty = torch.tensor([False, True, False, True, True])
    lowest = lowest_real_score(scores, empty)
    assert lowest.tolist() == [-1.0]  # of the real answers 0.5 and -1.0
    # 2.0 and 3.0 (empty) drop to -1.0; -4.0 (empty) is already lower and stays; real answers are untouched
    assert floor_empty_scores(scores, empty, lowest).tolist() == [0.5, -1.0, -1.0, -1.0, -4.0]


def test_empty_floor_is_the_minimum_over_ranks():
    rank0 = (torch.tensor([1.0, 5.0]), torch.tensor([False, True]))
    rank1 = (torch.tensor([0.25, 9.0]), torch.tensor([False, True]))
    lowest = torch.minimum(lowest_real_score(*rank0), lowest_real_score(*rank1))  # what all_reduce_min gives each rank
    assert floor_empty_scores(*rank0, lowest).tolist() == [1.0, 0.25]
    assert floor_empty_scores(*rank1, lowest).tolist() == [0.25, 0.25]


def test_empty_floor_with_no_real_answer_anywhere_changes_nothing():
    scores, empty = torch.tensor([2.0, 3.0]), torch.tensor([True, True])
    lowest = lowest_real_score(scores, empty)
    assert lowest.tolist() == [math.inf]
    assert floor_empty_scores(scores, empty, lowest).tolist() == [2.0, 3.0]
    assert lowest_real_score(torch.zeros(0), torch.zeros(0, dtype=torch.bool)).tolist() == [math.inf]  # no rows on this rank
