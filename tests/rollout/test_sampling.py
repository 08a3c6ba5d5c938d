"""The hf backend's sampler (rlhfkit.rollout.sampling): the distribution it draws from."""

from __future__ import annotations

from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine
from rlhfkit.rollout.sampling import sample_from_probs, warpers


def test_sample_from_probs_draws_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0]) * 3  # rows need not sum to 1
    draws = sample_from_probs(probs.expand(200_000, 5).contiguous())
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, probs / 3, atol=4e-3, rtol=0)
    assert freq[4] == 0 and draws.dtype == torch.long and draws.shape == (200_000,)


def test_sample_from_probs_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for u in (0.0, 1.0 - 2 ** -24, 1.0):  # 1.0: beyond rand's range, as rounding of u * total could land
        with mock.patch("torch.rand_like", lambda t: torch.full_like(t, u)):
            got = sample_from_probs(probs).tolist()
        assert got == ([0, 2, 3] if u == 0.0 else [1, 2, 3]), (u, got)


def test_warpers_are_transformers_own_in_generate_order():
    assert warpers(1.0, 0, 1.0) == []
    assert [type(w).__name__ for w in warpers(0.7, 5, 0.9)] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                                 "TopPLogitsWarper"]


def test_first_token_follows_the_warped_policy():
    """4000 samples of one prompt's first token (one prefill) against softmax(top_k(logits / T))."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, initializer_range=0.5, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    prompt = torch.tensor([[5, 9, 13]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    want = torch.zeros(50)
    top = (logits / 0.7).topk(4)
    want[top.indices] = torch.softmax(top.values, dim=-1)
    n = 4000
    gen = GenerationConfig(max_new_tokens=1, temperature=0.7, top_k=4, eos_token_id=[49], pad_token_id=0)
    out = make_rollout_engine("hf", model).generate(PromptBatch(prompt.expand(n, 3), torch.ones(n, 3, dtype=torch.long)), gen)
    freq = torch.bincount(out.response_ids[:, 0], minlength=50).float() / n
    assert set(out.response_ids[:, 0].tolist()) <= set(top.indices.tolist())
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)
