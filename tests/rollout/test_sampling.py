"""The hf backend's sampler (rlhfkit.rollout.sampling): the distribution it draws from; its packed linears."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine
from rlhfkit.models.cpu_bf16 import ENV, fp32_products
from rlhfkit.rollout.packing import fused_linear, pack_dtype, packed_linears
from rlhfkit.rollout.sampling import decode, sample_from_probs, warpers
from testutils import tiny_llama

needs_onednn_bf16 = pytest.mark.skipif(pack_dtype() is not torch.bfloat16,
                                       reason="oneDNN does not run bf16 on this CPU: packed_linears packs fp32 copies")


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


@needs_onednn_bf16
def test_packed_linears_return_f_linear_bits_at_decode_sizes_and_restore_forward():
    """bf16 CPU layers inside packed_linears: inputs of up to ``rows`` rows go through oneDNN's
    packed op and give F.linear's exact bits; larger inputs take the layer's own forward (F.linear,
    or one the layer had of its own); other layers are untouched; every forward is back on exit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576, bias=False)).to(torch.bfloat16)
    fp32 = torch.nn.Linear(8, 8)
    own = lambda x: x  # noqa: E731
    net[1].forward = own
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a)):
        with torch.no_grad(), packed_linears(torch.nn.ModuleList([net, fp32]), rows=4):
            assert "forward" not in fp32.__dict__
            for shape in [(1, 576), (4, 1, 576), (3, 576), (2, 64, 576)]:
                x = torch.randn(*shape, dtype=torch.bfloat16)
                assert torch.equal(net[0](x), torch.nn.functional.linear(x, net[0].weight, net[0].bias)), shape
                y = torch.randn(*shape[:-1], 1536, dtype=torch.bfloat16)
                want = y if shape[0] == 2 else torch.nn.functional.linear(y, net[1].weight)  # 2x64 rows: its own forward
                assert torch.equal(net[1](y), want), shape
    assert len(calls) == 6 and all(s.numel() <= 4 * 1536 for s in calls)  # the 2x64-row inputs took their own forward
    assert net[1].forward is own and "forward" not in net[0].__dict__ and "forward" not in fp32.__dict__


def test_without_bf16_kernels_decode_steps_multiply_packed_fp32_copies(monkeypatch):
    """Where bf16 linears take fp32 products (rlhfkit.models.cpu_bf16), packed_linears packs fp32
    copies of the bf16 weights: decode-size inputs give the fp32 product rounded to bf16 (up to the
    order of oneDNN's sums), prefill-size inputs the layer's own fp32-product forward."""
    monkeypatch.setenv(ENV, "fp32")
    assert pack_dtype() is torch.float32
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 1536).to(torch.bfloat16)
    fp32_products(layer)
    own = layer.forward
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append((a[0].dtype, a[1].dtype)) or real(*a)):
        with torch.no_grad(), packed_linears(layer, rows=4):
            for shape in [(1, 576), (4, 1, 576), (2, 64, 576)]:
                x = torch.randn(*shape, dtype=torch.bfloat16)
                got = layer(x)
                want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-3)
    assert calls == [(torch.float32, torch.float32)] * 2  # the 2x64 rows took the layer's own forward
    assert layer.forward is own


@needs_onednn_bf16
def test_bf16_decode_with_packed_layers_gives_generate_s_greedy_tokens():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.2, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=[999], pad_token_id=0)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with mock.patch.object(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a)):
        got = make_rollout_engine("hf", model).generate(PromptBatch(ids, mask), gen)
    # 11 decode steps x (2 layers x 4 products + lm_head), the prefill's lm_head: the fast decoder computes q, k, v in
    # one product and gate, up in another
    assert len(calls) == 11 * (2 * 4 + 1) + 1
    model.generation_config = type(model.generation_config)()
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[999],
                              pad_token_id=0)[:, 6:]
    assert torch.equal(got.response_ids, want)
    assert not any("forward" in m.__dict__ for m in model.modules())


def _linears(*shapes, bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return [torch.nn.Linear(i, o, bias=bias).to(dtype) for i, o in shapes]


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_returns_the_bits_of_the_separate_products(bias):
    """q, k, v (SmolLM2's shapes) in one packed product: its columns are each layer's F.linear, bit for bit."""
    layers = _linears((576, 576), (576, 192), (576, 192), bias=bias)
    with torch.no_grad():
        fused = fused_linear(layers, rows=4)
        for shape in [(1, 576), (4, 1, 576), (3, 576)]:
            x = torch.randn(*shape, dtype=torch.bfloat16)
            want = torch.cat([torch.nn.functional.linear(x, m.weight, m.bias) for m in layers], dim=-1)
            assert torch.equal(fused(x), want), shape


def test_fused_linear_with_fp32_products_equals_the_separate_packed_products(monkeypatch):
    monkeypatch.setenv(ENV, "fp32")
    layers = _linears((576, 1536), (576, 1536))
    x = torch.randn(4, 1, 576, dtype=torch.bfloat16)
    with torch.no_grad():
        got = fused_linear(layers, rows=4)(x)
        want = torch.cat([fused_linear([m], rows=4)(x) for m in layers], dim=-1)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_fused_linear_refuses_layers_it_cannot_pack_as_one():
    class Adapter(torch.nn.Linear):  # a LoRA layer is not a plain Linear: its forward adds the adapter
        pass

    shard = _linears((8, 8))[0]
    shard.weight.data = torch.empty(0, dtype=torch.bfloat16)  # a ZeRO-3 partitioned weight
    cases = {"mixed bias": _linears((8, 8)) + _linears((8, 4), bias=False), "fp32": _linears((8, 8), dtype=torch.float32),
             "adapter": [Adapter(8, 8).to(torch.bfloat16)], "different inputs": _linears((8, 8), (4, 8)), "shard": [shard]}
    for name, layers in cases.items():
        assert fused_linear(layers, rows=4) is None, name


@needs_onednn_bf16
def test_packed_linears_packs_a_layer_only_at_its_first_decode_size_call():
    """A layer whose decode-size products the fast decoder takes from a fused copy is never copied again."""
    layers = torch.nn.ModuleList(_linears((64, 64), (64, 64)))
    reorders = []
    real = torch.ops.mkldnn._reorder_linear_weight
    with mock.patch.object(torch.ops.mkldnn, "_reorder_linear_weight", lambda *a: reorders.append(a[0].shape) or real(*a)):
        with torch.no_grad(), packed_linears(layers, rows=2):
            assert reorders == []
            layers[0](torch.randn(5, 64, dtype=torch.bfloat16))  # a prefill: the layer's own forward
            for _ in range(3):
                layers[0](torch.randn(2, 64, dtype=torch.bfloat16))
    assert reorders == [torch.Size([64, 64])]


def _tiny_llama() -> LlamaForCausalLM:
    return tiny_llama(eos_token_id=None)


def test_generated_tokens_are_ordinary_tensors_a_training_step_can_use():
    """The loop runs in inference mode; its tokens must not be inference tensors, or the training
    forward that embeds them fails ("Inference tensors cannot be saved for backward")."""
    model = _tiny_llama()
    ids = torch.randint(3, 100, (2, 5))
    gen = GenerationConfig(max_new_tokens=4, do_sample=True, eos_token_id=[99], pad_token_id=0)
    new = decode(model, model, ids, torch.ones_like(ids), gen)
    out = make_rollout_engine("hf", model).generate(PromptBatch(ids, torch.ones_like(ids)), gen)
    assert not any(t.is_inference() for t in (new, out.response_ids, out.sequences))
    model.train()
    model(input_ids=new, labels=new).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_a_zero3_partitioned_model_decodes_outside_inference_mode():
    """ZeRO-3's hooks gather parameters inside the forward: there the loop keeps no_grad, so that no
    gathered parameter becomes an inference tensor the training step then updates."""
    model = _tiny_llama().eval()
    seen = []
    model.lm_head.register_forward_hook(lambda *_: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())))
    ids = torch.randint(3, 100, (2, 5))
    gen = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=[99], pad_token_id=0)
    decode(model, model, ids, torch.ones_like(ids), gen)
    assert seen and set(seen) == {(True, False)}
    for p in model.parameters():
        p.ds_id = 0  # what is_zero3_partitioned looks for
    seen.clear()
    decode(model, model, ids, torch.ones_like(ids), gen)
    assert seen and set(seen) == {(False, False)}
