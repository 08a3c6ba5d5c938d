"""The policy-loss variants of issue 23: GSPO (sequence and token), Dr. GRPO's constant-normalised
aggregation, and GRPO's reward scaling (group / batch / none). Hand-computed values, a naive loop with
autograd, and the identities the papers state."""

import math

import pytest
import torch

from rlhfkit.algos import aggregate_loss, group_advantages, gspo_policy_loss, ppo_policy_loss

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- Dr. GRPO aggregation
def test_seq_mean_token_sum_norm_by_hand():
    # (1 + 2 + 4) summed over every masked-in token, / (2 sequences x C = 4)
    assert aggregate_loss(L, M, "seq_mean_token_sum_norm", norm_constant=4).item() == pytest.approx(7 / 8)
    assert aggregate_loss(L, M, "seq_mean_token_sum_norm", num_seqs=4, norm_constant=4).item() == pytest.approx(7 / 16)
    # = seq_mean_token_sum / C: no sample's weight depends on its own length
    assert aggregate_loss(L, M, "seq_mean_token_sum_norm", norm_constant=3).item() == pytest.approx(
        aggregate_loss(L, M, "seq_mean_token_sum").item() / 3)
    with pytest.raises(ValueError, match="positive norm_constant"):
        aggregate_loss(L, M, "seq_mean_token_sum_norm")


def test_seq_mean_token_sum_norm_one_rank_equals_two_ranks_incl_grads():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(6) < torch.tensor([1, 2, 6, 5])[:, None]).float()
    old = torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    logp = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    full, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, "seq_mean_token_sum_norm", norm_constant=6)
    full.backward()
    grad_full, logp.grad = logp.grad.clone(), None
    halves = [ppo_policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, 0.2, "seq_mean_token_sum_norm",
                              num_seqs=4 / 2, norm_constant=6)[0] for i in (0, 2)]
    (sum(halves) / 2).backward()
    assert torch.allclose(full, sum(halves) / 2) and torch.allclose(grad_full, logp.grad)


# ---------------------------------------------------------------- reward scaling
def test_group_advantages_scale_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    group_std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)  # unbiased, the same in both groups
    batch_std = math.sqrt(8 * 0.25 / 7)  # unbiased std of all 8 rewards (mean 0.5)
    assert torch.allclose(group_advantages(scores, 4, scale="group", eps=0.0), centred / group_std)
    assert torch.allclose(group_advantages(scores, 4, scale="batch", batch_std=batch_std, eps=0.0), centred / batch_std)
    assert torch.allclose(group_advantages(scores, 4, scale="none"), centred)
    with pytest.raises(ValueError, match="needs batch_std"):
        group_advantages(scores, 4, scale="batch")
    with pytest.raises(ValueError, match="unknown scale"):
        group_advantages(scores, 4, scale="global")


# ---------------------------------------------------------------- GSPO
def test_gspo_seq_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.1, 0.3], [0.2, 0.0, 9.0]], requires_grad=True)  # 9.0 is masked out
    adv = torch.tensor([1.0, -2.0])
    loss, stats = gspo_policy_loss(logp, old, adv, mask, 0.05, 0.05)
    s = math.exp(0.1)  # both sequences: mean log-ratio (0.1 - 0.1 + 0.3) / 3 = (0.2 + 0.0) / 2 = 0.1
    # seq 0, A = 1: -min(s, 1.05) = -1.05 (clipped, no gradient); seq 1, A = -2: -min(-2s, -2.1) = 2s
    assert loss.item() == pytest.approx((-1.05 + 2 * s) / 2)
    assert stats["clip_frac"].item() == pytest.approx(0.5) and stats["ratio_mean"].item() == pytest.approx(s)
    loss.backward()
    # d/dlogp_1t of 2 s / 2 = s * (1 / len_1) for t < 2
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [s / 2, s / 2, 0.0]]))


def naive_gspo(logp, old, adv, mask, low, high):
    """The paper's objective, one sequence at a time, [B, A] advantages constant per sequence."""
    total = 0.0
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in idx) / len(idx))
        a = adv[i, idx[0]]
        total = total - torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a)
    return total / logp.shape[0]


@pytest.mark.parametrize("variant", ["seq", "token"])
def test_gspo_against_a_naive_loop_incl_grads_and_the_token_variant_equals_seq(variant):
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]).float()
    old = torch.randn(6, 5, generator=g)
    logp = (old + 0.05 * torch.randn(6, 5, generator=g)).requires_grad_(True)  # some sequences clip at 0.02
    adv = torch.randn(6, generator=g)[:, None].expand(6, 5)  # equal over each sequence's tokens
    ours, stats = gspo_policy_loss(logp, old, adv, mask, 0.02, 0.03, variant=variant)
    ours.backward()
    grad, logp.grad = logp.grad.clone(), None
    naive_gspo(logp, old, adv, mask, 0.02, 0.03).backward()
    assert 0 < stats["clip_frac"].item() < 1
    assert torch.allclose(ours, naive_gspo(logp, old, adv, mask, 0.02, 0.03).detach(), atol=1e-6)
    assert torch.allclose(grad, logp.grad, atol=1e-6)


def test_gspo_with_ratio_one_is_grpo_and_token_variant_takes_token_advantages():
    g = torch.Generator().manual_seed(4)
    mask = (torch.arange(4) < torch.tensor([4, 2, 3])[:, None]).float()
    old = torch.randn(3, 4, generator=g)
    adv = torch.randn(3, 4, generator=g)  # per-token advantages
    grads = []
    for fn in (lambda lp: gspo_policy_loss(lp, old, adv, mask, 3e-4, 4e-4, variant="token")[0],
               lambda lp: ppo_policy_loss(lp, old, adv, mask, 0.2, 0.2, "seq_mean_token_mean")[0]):
        logp = old.clone().requires_grad_(True)  # on-policy: every ratio is exactly 1
        fn(logp).backward()
        grads.append(logp.grad)
    assert torch.allclose(grads[0], grads[1])  # GSPO-token at ratio 1 = GRPO with per-sequence token means
    seq_adv = (adv * mask).sum(-1) / mask.sum(-1)
    logp = old.clone().requires_grad_(True)
    gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)[0].backward()  # seq: the sequence's mean advantage
    assert torch.allclose(logp.grad, -seq_adv[:, None] * mask / mask.sum(-1, keepdim=True) / 3)


def test_gspo_num_seqs_splits_over_ranks_and_empty_rows_are_zero():
    g = torch.Generator().manual_seed(5)
    mask = (torch.arange(4) < torch.tensor([4, 0, 3, 2])[:, None]).float()  # row 1 has no response tokens
    old = torch.randn(4, 4, generator=g)
    logp = old + 0.01 * torch.randn(4, 4, generator=g)
    adv = torch.randn(4, generator=g)
    full, _ = gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)
    halves = [gspo_policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 3e-4, 4e-4, num_seqs=2)[0]
              for i in (0, 2)]
    assert torch.allclose(full, sum(halves) / 2)
    only_empty, stats = gspo_policy_loss(logp[1:2], old[1:2], adv[1:2], mask[1:2], 3e-4, 4e-4)
    assert only_empty.item() == 0.0 and stats["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="unknown GSPO variant"):
        gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4, variant="group")
