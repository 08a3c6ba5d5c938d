"""Loss aggregation (incl. the 1 rank == 2 ranks contract), PPO actor / critic, KL loss,
pairwise RM loss, SFT, DPO / IPO, KL controllers and EMA."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    clipped_value_loss,
    dpo_loss,
    ema_update_,
    kl_estimate,
    kl_loss,
    pairwise_loss,
    ppo_policy_loss,
    sft_loss,
    simpo_loss,
)

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


# ---------------------------------------------------------------- aggregation
def test_aggregate_loss_by_hand():
    assert aggregate_loss(L, M, "token_mean").item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    assert aggregate_loss(L, M, "seq_mean_token_mean").item() == pytest.approx(((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)
    assert aggregate_loss(L, M, "seq_mean_token_sum").item() == pytest.approx(((1 + 2) + (4 + 5 + 6)) / 2)
    assert aggregate_loss(L, M, "token_mean", num_tokens=10).item() == pytest.approx(18 / 10)
    assert aggregate_loss(L, M, "seq_mean_token_sum", num_seqs=3).item() == pytest.approx(18 / 3)
    with pytest.raises(ValueError):
        aggregate_loss(L, M, "sum")


def _random_batch(seed, A=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 6, 5])  # the two halves hold 3 and 11 tokens
    mask = (torch.arange(A) < lengths[:, None]).float()
    return g, mask


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_one_rank_equals_two_ranks(mode):
    g, mask = _random_batch(0)
    loss_mat = torch.randn(4, 6, generator=g)
    full = aggregate_loss(loss_mat, mask, mode)
    W = 2
    n_tok, n_seq = mask.sum() / W, 4 / W
    halves = [aggregate_loss(loss_mat[i : i + 2], mask[i : i + 2], mode, num_tokens=n_tok, num_seqs=n_seq) for i in (0, 2)]
    assert mask[:2].sum() != mask[2:].sum()
    assert torch.allclose(full, sum(halves) / W)


@pytest.mark.parametrize("mode", MODES)
def test_ppo_policy_loss_one_rank_equals_two_ranks_incl_grads(mode):
    g, mask = _random_batch(1)
    old = torch.randn(4, 6, generator=g) - 2
    adv = torch.randn(4, 6, generator=g)
    logp = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    full, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, mode)
    full.backward()
    grad_full = logp.grad.clone()
    logp.grad = None
    W = 2
    n_tok, n_seq = mask.sum() / W, 4 / W
    halves = [
        ppo_policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], 0.2, 0.28, mode, n_tok, n_seq)[0]
        for i in (0, 2)
    ]
    # DeepSpeed: each rank backprops its own loss, gradients are averaged over ranks
    (sum(halves) / W).backward()
    assert torch.allclose(full, sum(halves) / W)
    assert torch.allclose(grad_full, logp.grad)


# ---------------------------------------------------------------- PPO actor
def test_ppo_policy_loss_by_hand():
    eps_low, eps_high = 0.2, 0.28
    # tokens: ratio in band (A>0), ratio high (A>0 -> clipped), ratio low (A<0 -> clipped),
    # ratio low (A>0 -> not clipped, min picks unclipped), masked
    ratios = [1.1, 1.5, 0.5, 0.5, 3.0]
    adv = torch.tensor([[1.0, 2.0, -1.0, 1.0, 5.0]])
    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([ratios]))
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_policy_loss(logp, old, adv, mask, eps_low, eps_high)
    per_token = [-1.1 * 1.0, -(1 + eps_high) * 2.0, -(1 - eps_low) * -1.0, -0.5 * 1.0]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(2 / 4)
    assert stats["ratio_mean"].item() == pytest.approx((1.1 + 1.5 + 0.5 + 0.5) / 4, rel=1e-5)
    k3 = [r - 1 - math.log(r) for r in ratios[:4]]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-5)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    # advantages given per sequence [B] broadcast over tokens
    l1, _ = ppo_policy_loss(logp, old, torch.tensor([2.0]), mask, 0.2, 0.2)
    l2, _ = ppo_policy_loss(logp, old, torch.full((1, 5), 2.0), mask, 0.2, 0.2)
    assert torch.allclose(l1, l2)


def test_ppo_policy_loss_masked_positions_change_nothing_and_no_overflow():
    torch.manual_seed(2)
    old, adv = torch.randn(3, 5), torch.randn(3, 5)
    logp = old + 0.1 * torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ref_loss, ref_stats = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    logp2, adv2 = logp.clone(), adv.clone()
    logp2[mask == 0] = 1e4  # exp would overflow without the clamp
    adv2[mask == 0] = float("nan")
    loss, stats = ppo_policy_loss(logp2, old, adv2, mask, 0.2, 0.2)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(stats[k], ref_stats[k]) for k in stats)


# ---------------------------------------------------------------- critic
def test_clipped_value_loss_by_hand():
    c = 0.2
    v = torch.tensor([[1.0, 0.5, 2.0, 0.0]])
    v_old = torch.tensor([[0.5, 0.4, 1.0, 0.0]])
    R = torch.tensor([[0.0, 0.45, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_value_loss(v, v_old, R, mask, c)
    t0 = 0.5 * max((1.0 - 0.0) ** 2, (0.7 - 0.0) ** 2)  # unclipped larger
    t1 = 0.5 * max((0.5 - 0.45) ** 2, (0.5 - 0.45) ** 2)  # inside band
    t2 = 0.5 * max((2.0 - 1.0) ** 2, (1.2 - 1.0) ** 2)
    assert loss.item() == pytest.approx((t0 + t1 + t2) / 3)
    # a token where the clipped error is larger: V moved towards R past the band
    loss, stats = clipped_value_loss(torch.tensor([[0.9]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), c)
    assert loss.item() == pytest.approx(0.5 * (0.2 - 1.0) ** 2)
    assert stats["vf_clip_frac"].item() == 1.0
    loss, _ = clipped_value_loss(v, v_old, R, mask, None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.05**2 + 1.0) / 3)


# ---------------------------------------------------------------- KL loss
def test_kl_loss_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    d0, d1 = -1.5 + 1.0, -1.0 + 2.0
    expected = ((math.exp(d0) - d0 - 1) + (math.exp(d1) - d1 - 1)) / 2
    assert kl_loss(lp, ref, mask).item() == pytest.approx(expected)
    assert kl_loss(lp, ref, mask, "k1", "seq_mean_token_sum").item() == pytest.approx((0.5 - 1.0) / 1)
    assert torch.allclose(kl_loss(lp, ref, mask, "k2"), (kl_estimate(lp, ref, "k2") * mask).sum() / 2)


# ---------------------------------------------------------------- reward model
def test_pairwise_loss_by_hand_and_extreme_margins():
    c = torch.tensor([1.0, 0.0, 2.0])
    r = torch.tensor([0.0, 1.0, 2.0])
    loss, acc = pairwise_loss(c, r)
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0)) + math.log(2.0)) / 3
    assert loss.item() == pytest.approx(expected)
    assert acc.item() == pytest.approx(1 / 3)
    loss, acc = pairwise_loss(torch.tensor([1e4, -1e4]), torch.tensor([-1e4, 1e4]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx((0.0 + 2e4) / 2)
    assert acc.item() == 0.5
    x = torch.tensor([1e4, -1e4], requires_grad=True)
    pairwise_loss(x, torch.zeros(2))[0].backward()
    assert torch.isfinite(x.grad).all()
    lb, _ = pairwise_loss(torch.tensor([1e4], dtype=torch.bfloat16), torch.tensor([-1e4], dtype=torch.bfloat16))
    assert lb.dtype == torch.float32 and lb.item() == 0.0


# ---------------------------------------------------------------- SFT
def test_sft_loss_matches_hf_shifted_cross_entropy():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = -100  # prompt tokens
    labels[1, 4] = -100
    loss, n = sft_loss(logits, labels)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert n.item() == (2 + 3)
    assert torch.allclose(loss, ref, atol=1e-6)
    loss_g, _ = sft_loss(logits, labels, num_tokens=10)
    assert torch.allclose(loss_g, ref * 5 / 10, atol=1e-6)
    # by hand on one token: log-softmax of [0, log 3] at label 1 -> -log(3/4)
    lg = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    loss, n = sft_loss(lg, torch.tensor([[-100, 1]]))
    assert n.item() == 1 and loss.item() == pytest.approx(-math.log(3 / 4))
    lb, _ = sft_loss(logits.bfloat16(), labels)
    assert lb.dtype == torch.float32


# ---------------------------------------------------------------- DPO / IPO
def test_dpo_sigmoid_by_hand_with_label_smoothing():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    beta = 0.1
    h = [(-1.0 + 1.5) - (-2.0 + 1.5), (-3.0 + 2.0) - (-1.0 + 2.0)]  # [1.0, -2.0]

    def logsig(x):
        return -math.log1p(math.exp(-x))

    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta)
    assert loss.item() == pytest.approx(sum(-logsig(beta * x) for x in h) / 2)
    assert torch.allclose(cr, beta * (pc - rc)) and torch.allclose(rj, beta * (pr - rr))
    ls = 0.1
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=ls)
    expected = sum(-(1 - ls) * logsig(beta * x) - ls * logsig(-beta * x) for x in h) / 2
    assert loss.item() == pytest.approx(expected)


def test_simpo_by_hand_and_by_autograd():
    # log pi(y_w) = -4 over 2 tokens, log pi(y_l) = -9 over 3; beta 2, gamma 1:
    # r_w = 2 * -2 = -4, r_l = 2 * -3 = -6, loss = -log sigmoid(-4 + 6 - 1) = log(1 + e^-1)
    pc, pr = torch.tensor([-4.0], requires_grad=True), torch.tensor([-9.0], requires_grad=True)
    loss, rw, rl = simpo_loss(pc, pr, torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    assert (rw.item(), rl.item()) == (-4.0, -6.0)
    loss.backward()
    s = 1 / (1 + math.exp(1))  # d/dz of -log sigmoid(z) at z = 1 is -(1 - sigmoid(1)) = -sigmoid(-1)
    assert pc.grad.item() == pytest.approx(-s * 2.0 / 2) and pr.grad.item() == pytest.approx(s * 2.0 / 3)
    # TRL's CPO form: beta * ((pc/|w| - pr/|l|) - gamma / beta)
    trl = -F.logsigmoid(torch.tensor(2.0 * ((-4.0 / 2 - -9.0 / 3) - 1.0 / 2.0)))
    assert loss.item() == pytest.approx(trl.item())
    # a mean over pairs, and an empty side (length 0) counts as length 1
    loss2, _, _ = simpo_loss(torch.tensor([-4.0, -1.0]), torch.tensor([-9.0, 0.0]), torch.tensor([2, 1]),
                             torch.tensor([3, 0]), beta=2.0, gamma=1.0)
    assert loss2.item() == pytest.approx((math.log(1 + math.exp(-1)) - F.logsigmoid(torch.tensor(-2.0 - 0.0 - 1.0)).item()) / 2)


def test_ipo_by_hand():
    pc, pr = torch.tensor([-1.0]), torch.tensor([-2.0])
    rc, rr = torch.tensor([-1.5]), torch.tensor([-1.5])
    beta = 0.5
    h = (-1.0 + 1.5) - (-2.0 + 1.5)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo")
    assert loss.item() == pytest.approx((h - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, beta, loss_type="hinge?")


# ---------------------------------------------------------------- controllers / EMA
def test_adaptive_kl_controller_by_hand_and_state_dict():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=6.6, n_steps=256)  # error 0.1, inside the clip
    v1 = 0.1 * (1 + (6.6 / 6.0 - 1) * 256 / 10000)
    assert ctl.value == pytest.approx(v1)
    ctl.update(current_kl=torch.tensor(60.0), n_steps=256)  # error 9 -> clipped to +0.2
    v2 = v1 * (1 + 0.2 * 256 / 10000)
    assert ctl.value == pytest.approx(v2)
    ctl.update(current_kl=0.0, n_steps=512)  # error -1 -> clipped to -0.2
    v3 = v2 * (1 - 0.2 * 512 / 10000)
    assert ctl.value == pytest.approx(v3)
    other = AdaptiveKLController(1.0, 1.0, 1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict()
    other.update(7.0, 100)
    ctl.update(7.0, 100)
    assert other.value == ctl.value


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_running_moments_by_hand_and_against_all_values():
    from rlhfkit.algos import RunningMoments

    m = RunningMoments(eps=0.0)
    m.update(1.0 + 3.0, 1.0 + 9.0, 2)  # values 1, 3: mean 2, population var 1
    assert (m.count, m.mean, m.var) == (2, 2.0, 1.0)
    m.update(5.0, 25.0, 1)  # values 1, 3, 5: mean 3, var (4 + 0 + 4) / 3
    assert m.mean == pytest.approx(3.0) and m.var == pytest.approx(8 / 3)
    assert m.normalize(torch.tensor([3.0, 5.0])).tolist() == pytest.approx([0.0, 2 / (8 / 3) ** 0.5])
    # many uneven batches: the moments of all the values seen, as one batch would give them
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 1, 17, 2, 9)]
    m = RunningMoments()
    for b in batches:
        m.update(b.sum().item(), b.square().sum().item(), len(b))
    every = torch.cat(batches)
    assert m.mean == pytest.approx(every.mean().item()) and m.var == pytest.approx(every.var(unbiased=False).item())
    other = RunningMoments()
    other.load_state_dict(m.state_dict())
    assert other.state_dict() == m.state_dict()
    m.update(0.0, 0.0, 0)  # an empty batch changes nothing
    assert m.state_dict() == other.state_dict()


def test_ema_update_in_place():
    ema = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    x = [torch.tensor([3.0, 2.0]), torch.tensor([[10.0]])]
    ids = [id(t) for t in ema]
    ema_update_(ema, x, beta=0.9)
    assert [id(t) for t in ema] == ids
    assert torch.allclose(ema[0], torch.tensor([0.9 * 1.0 + 0.1 * 3.0, 0.9 * 2.0 + 0.1 * 2.0]))
    assert torch.allclose(ema[1], torch.tensor([[0.1 * 10.0]]))
    with pytest.raises(ValueError):
        ema_update_(ema, x[:1], 0.9)
