"""Masked statistics, log-probs / entropy, and the last-real-token rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.algos import (
    entropy_from_logits,
    gather_last_real,
    last_real_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    mean_var_from_moments,
)
from rlhfkit.algos import stats as stats_module

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(X, M).item() == 1.0 + 2.0 + 4.0
    assert torch.equal(masked_sum(X, M, dim=-1), torch.tensor([1.0 + 2.0, 4.0]))
    assert masked_mean(X, M).item() == pytest.approx((1.0 + 2.0 + 4.0) / 3)
    assert torch.allclose(masked_mean(X, M, dim=-1), torch.tensor([(1.0 + 2.0) / 2, 4.0 / 1]))
    # bool mask gives the same; empty mask gives 0, not nan
    assert masked_mean(X, M.bool()).item() == pytest.approx(7.0 / 3)
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_stats_ignore_nan_at_masked_positions():
    x = X.clone()
    x[M == 0] = float("nan")
    assert masked_sum(x, M).item() == 7.0
    assert masked_var(x, M).isfinite()
    assert torch.isfinite(masked_whiten(x, M)).all()


def test_masked_var_by_hand():
    mean = (1.0 + 2.0 + 4.0) / 3
    ss = (1.0 - mean) ** 2 + (2.0 - mean) ** 2 + (4.0 - mean) ** 2
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(ss / 3)
    assert masked_var(X, M, unbiased=True).item() == pytest.approx(ss / 2)
    # one element: Bessel factor taken as 1 -> 0, not nan / error
    assert masked_var(X, torch.tensor([[1.0, 0, 0], [0, 0, 0]])).item() == 0.0


def test_masked_whiten_by_hand():
    mean = 7.0 / 3
    var = ((1.0 - mean) ** 2 + (2.0 - mean) ** 2 + (4.0 - mean) ** 2) / 2
    out = masked_whiten(X, M, eps=0.0)
    expected = torch.tensor([[(1.0 - mean), (2.0 - mean), 0.0], [(4.0 - mean), 0.0, 0.0]]) / math.sqrt(var)
    assert torch.allclose(out, expected, atol=1e-6)
    out = masked_whiten(X, M, shift_mean=False, eps=0.0)
    assert torch.allclose(out, (expected + mean) * M, atol=1e-6)
    # precomputed (global) stats are used as given
    out = masked_whiten(X, M, mean=1.0, var=4.0, eps=0.0)
    assert torch.allclose(out, torch.tensor([[0.0, 0.5, 0.0], [1.5, 0.0, 0.0]]))


def test_moments_allreduce_equals_global_whiten():
    torch.manual_seed(0)
    x = torch.randn(4, 5) * 3 + 1
    m = (torch.rand(4, 5) > 0.3).float()
    m[:, 0] = 1
    moments = masked_moments(x[:2], m[:2]) + masked_moments(x[2:], m[2:])  # "all_reduce(SUM)"
    mean, var = mean_var_from_moments(moments)
    assert mean.item() == pytest.approx(masked_mean(x, m).item(), abs=1e-5)
    assert var.item() == pytest.approx(masked_var(x, m).item(), rel=1e-5)
    halves = torch.cat([masked_whiten(x[:2], m[:2], mean=mean, var=var), masked_whiten(x[2:], m[2:], mean=mean, var=var)])
    assert torch.allclose(halves, masked_whiten(x, m), atol=1e-5)


def test_logprobs_and_entropy_match_log_softmax(monkeypatch):
    monkeypatch.setattr(stats_module, "_CHUNK_ROWS", 3)  # several chunks, ragged last one
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.randint(0, 7, (2, 4))
    logp_all = F.log_softmax(logits, dim=-1)
    expected = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels), expected, atol=1e-6)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), ent, atol=1e-5)
    # bf16 logits -> fp32 result close to the fp32 computation on the same (rounded) logits
    lb = logits.bfloat16()
    out = logprobs_from_logits(lb, labels)
    assert out.dtype == torch.float32
    assert torch.allclose(out, F.log_softmax(lb.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    # gradient flows
    lg = logits.clone().requires_grad_(True)
    logprobs_from_logits(lg, labels).sum().backward()
    assert torch.allclose(lg.grad, (F.one_hot(labels, 7) - logp_all.exp()), atol=1e-5)


def test_temperature_is_applied_per_chunk_exactly_as_to_fp32_logits(monkeypatch):
    """bf16 logits with a temperature: the same bits, values and the logprobs' gradients, as dividing a full fp32
    copy first (what step 3 did before it kept the [B, A, V] logits in the model's dtype; with an entropy term in
    the loss it still makes the copy, so that the two gradients are summed in fp32)."""
    monkeypatch.setattr(stats_module, "_CHUNK_ROWS", 3)
    torch.manual_seed(0)
    labels = torch.randint(0, 50, (2, 5))
    base = (3 * torch.randn(2, 5, 50)).bfloat16()
    grads, outs = [], []
    for chunked in (True, False):
        lg = base.clone().requires_grad_(True)
        if chunked:
            lp, ent = logprobs_from_logits(lg, labels, 0.7), entropy_from_logits(lg, 0.7)
        else:
            full = lg.float() / 0.7
            lp, ent = logprobs_from_logits(full, labels), entropy_from_logits(full)
        lp.sum().backward()
        outs.append((lp, ent))
        grads.append(lg.grad)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(grads[0], grads[1]) and grads[0].dtype == torch.bfloat16
    # and the temperature is there: at 0.7 the distribution is sharper than at 1
    assert not torch.equal(logprobs_from_logits(base, labels), outs[0][0])


def test_logprobs_ignore_index_gives_zero():
    logits = torch.randn(1, 3, 5)
    labels = torch.tensor([[1, -100, 2]])
    out = logprobs_from_logits(logits, labels)
    assert out[0, 1].item() == 0.0 and out[0, 0].item() < 0


def test_entropy_uniform_is_log_v():
    assert torch.allclose(entropy_from_logits(torch.zeros(2, 3, 8)), torch.full((2, 3), math.log(8.0)))


def test_last_real_token_index_padding_sides():
    am = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left-padded
            [1, 1, 1, 0, 0],  # right-padded
            [0, 1, 1, 0, 0],  # both
            [1, 1, 1, 1, 1],  # unpadded
            [1, 0, 0, 0, 0],  # single token
        ]
    )
    assert last_real_token_index(am).tolist() == [4, 2, 2, 4, 0]
    assert last_real_token_index(am.bool()).tolist() == [4, 2, 2, 4, 0]
    assert last_real_token_index(am.float()).tolist() == [4, 2, 2, 4, 0]
    values = torch.arange(25.0).reshape(5, 5)
    assert gather_last_real(values, am).tolist() == [0 * 5 + 4.0, 1 * 5 + 2.0, 2 * 5 + 2.0, 3 * 5 + 4.0, 4 * 5 + 0.0]


def test_last_real_token_index_matches_hf_pooling():
    # transformers' *ForSequenceClassification: non_pad = input_ids != pad_id;
    # last = (arange(T) * non_pad).argmax(-1). Pad tokens exactly at the mask-0 positions.
    pad, eos = 0, 9
    input_ids = torch.tensor([[0, 0, 5, 6, eos], [5, 6, eos, 0, 0], [5, 6, 7, 8, 3], [0, 5, 6, 7, 0]])
    attention_mask = (input_ids != pad).long()
    non_pad = (input_ids != pad).int()
    hf_last = (torch.arange(input_ids.shape[-1]) * non_pad).argmax(-1)
    assert torch.equal(last_real_token_index(attention_mask), hf_last)


def test_explained_variance_by_hand():
    from rlhfkit.algos import explained_variance, masked_moments

    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)

    def ev(values, m=mask, r=returns):
        return explained_variance(masked_moments(r, m), masked_moments(r - values, m))

    assert ev(returns) == pytest.approx(1.0)                                  # exact values
    assert ev(torch.full((1, 4), 2.5)) == pytest.approx(0.0)                  # the returns' mean: explains nothing
    assert ev(torch.tensor([[2.0, 1.0, 4.0, 3.0]])) == pytest.approx(1 - 1.0 / 1.25)  # residual var 1, returns var 1.25
    # masked-out tokens count nothing; moments summed over "ranks" give the global figure
    assert ev(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
              torch.tensor([[1.0, 2.0, 3.0, 99.0]])) == pytest.approx(1.0)
    a, b = returns[:, :2], returns[:, 2:]
    va, vb = torch.tensor([[2.0, 1.0]]), torch.tensor([[4.0, 3.0]])
    ones = torch.ones(1, 2)
    total_r = masked_moments(a, ones) + masked_moments(b, ones)
    total_e = masked_moments(a - va, ones) + masked_moments(b - vb, ones)
    assert explained_variance(total_r, total_e) == pytest.approx(0.2)
    assert math.isnan(explained_variance(masked_moments(torch.ones(1, 3), torch.ones(1, 3)),
                                         masked_moments(torch.zeros(1, 3), torch.ones(1, 3))))
