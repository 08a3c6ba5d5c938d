"""KTO (Ethayarajh et al. 2024): the loss by hand, its gradient by hand, a naive loop, the clamp and
detach of the reference point z0."""

import math

import pytest
import torch

from rlhfkit.algos import kto_loss


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_kto_by_hand_and_its_gradient():
    # log-ratios r = (-2 - -3, -5 - -4) = (1, -1); z0 = 0.5; beta 1; lambda_D 1, lambda_U 2
    #   desirable:   1 (1 - sigmoid(1 - 0.5))    = 1 - sigmoid(0.5)
    #   undesirable: 2 (1 - sigmoid(0.5 - -1))   = 2 (1 - sigmoid(1.5))
    policy = torch.tensor([-2.0, -5.0], requires_grad=True)
    loss, rewards = kto_loss(policy, torch.tensor([-3.0, -4.0]), torch.tensor([True, False]), 0.5, beta=1.0, lambda_d=1.0,
                             lambda_u=2.0)
    assert loss.item() == pytest.approx(((1 - sig(0.5)) + 2 * (1 - sig(1.5))) / 2)
    assert rewards.tolist() == [1.0, -1.0] and not rewards.requires_grad
    loss.backward()
    # d/dr (1 - sigmoid(r - z)) = -s(1 - s) at s = sigmoid(0.5); d/dr 2 (1 - sigmoid(z - r)) = 2 s(1 - s) at s = sigmoid(1.5)
    assert policy.grad[0].item() == pytest.approx(-sig(0.5) * (1 - sig(0.5)) / 2)
    assert policy.grad[1].item() == pytest.approx(2 * sig(1.5) * (1 - sig(1.5)) / 2)


def test_kto_reference_point_is_clamped_at_zero_and_detached():
    policy, ref, desirable = torch.tensor([0.2, -0.3]), torch.tensor([0.0, 0.0]), torch.tensor([True, False])
    kl = torch.tensor(-0.7, requires_grad=True)  # a negative estimate: z0 = max(0, kl) = 0
    loss, _ = kto_loss(policy, ref, desirable, kl, beta=2.0)
    assert loss.item() == pytest.approx(((1 - sig(2 * 0.2)) + (1 - sig(2 * 0.3))) / 2)
    assert not loss.requires_grad  # nothing flows into kl (and the reference is detached)
    assert kto_loss(policy, ref, desirable, 0.0, beta=2.0)[0].item() == pytest.approx(loss.item())


def test_kto_against_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    policy, ref = torch.randn(9, generator=g) * 3, torch.randn(9, generator=g) * 3
    desirable = torch.rand(9, generator=g) > 0.5
    beta, z, ld, lu = 0.3, 0.4, 1.5, 0.7
    loss, rewards = kto_loss(policy, ref, desirable, z, beta=beta, lambda_d=ld, lambda_u=lu)
    total = 0.0
    for p, r, d in zip(policy.tolist(), ref.tolist(), desirable.tolist()):
        total += ld * (1 - sig(beta * (p - r - z))) if d else lu * (1 - sig(beta * (z - (p - r))))
    assert loss.item() == pytest.approx(total / 9, rel=1e-6)
    torch.testing.assert_close(rewards, beta * (policy - ref))
