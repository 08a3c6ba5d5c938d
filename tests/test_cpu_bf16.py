"""bf16 linear layers with fp32 products on CPUs without bf16 kernels (rlhfkit.models.cpu_bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.models import load_model
from rlhfkit.models.cpu_bf16 import ENV, Fp32MatmulLinear, fp32_products, fp32_sdpa_attention, native_bf16_matmul, wanted
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
def test_products_are_fp32_sums_of_the_bf16_values_rounded_once(bias):
    """Forward, input gradient, weight gradient and bias gradient: each the fp32 product of the exact
    bf16 values, rounded to bf16 once, as a bf16 GEMM with fp32 accumulation gives; inputs of any rank."""
    x, w, g = bf16(2, 5, 48, seed=1), bf16(24, 48, seed=2), bf16(2, 5, 24, seed=3)
    b = bf16(24, seed=4) if bias else None
    x.requires_grad_(), w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    out = Fp32MatmulLinear.apply(x, w, b)
    out.backward(g)
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    x32, w32, g32 = x.detach().double(), w.detach().double(), g.double()
    want = x32 @ w32.t() + (b.detach().double() if bias else 0)
    # fp32 sums of 48 products of bf16 values (16 significant bits each) differ from exact sums by far
    # less than a bf16 ulp, so rounding both to bf16 agrees except at rare ties of rounding
    torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)
    torch.testing.assert_close(x.grad.double(), (g32 @ w32).to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)
    torch.testing.assert_close(w.grad.double(), (g32.reshape(-1, 24).t() @ x32.reshape(-1, 48)).to(torch.bfloat16).double(),
                               rtol=2 ** -8, atol=0)
    if bias:
        torch.testing.assert_close(b.grad.double(), g32.sum((0, 1)).to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)
    # and bit for bit what F.linear gives on fp32 copies, rounded to bf16
    assert torch.equal(out, F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16))


def test_agrees_with_the_native_bf16_kernel():
    x, w = bf16(7, 64, seed=5).requires_grad_(), bf16(32, 64, seed=6).requires_grad_()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ours, native = Fp32MatmulLinear.apply(x, w, None), F.linear(x2, w2)
    ours.sum().backward()
    native.sum().backward()
    for a, b in [(ours, native), (x.grad, x2.grad), (w.grad, w2.grad)]:
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-2)


def test_installs_on_bf16_cpu_linears_only_and_twice_is_harmless(monkeypatch):
    monkeypatch.setenv(ENV, "fp32")
    net = torch.nn.Sequential(torch.nn.Linear(8, 8).bfloat16(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    own = lambda x: x  # noqa: E731
    net[2].forward = own
    assert fp32_products(net) == 1
    assert fp32_products(net) == 1
    assert getattr(net[0].forward, "fp32_matmul", False)
    assert "forward" not in net[1].__dict__ and net[2].forward is own
    x = bf16(3, 8)
    assert torch.equal(net[0](x), F.linear(x.float(), net[0].weight.float(), net[0].bias.float()).bfloat16())
    monkeypatch.setenv(ENV, "native")
    assert fp32_products(torch.nn.Linear(8, 8).bfloat16()) == 0


def test_auto_follows_onednn_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    assert wanted() is (not native_bf16_matmul())
    monkeypatch.delenv(ENV)
    assert wanted() is (not native_bf16_matmul())
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=r"RLHFKIT_CPU_BF16_MATMUL='fast': use auto, fp32 or native"):
        wanted()


def test_a_llama_trains_the_same_with_fp32_products(monkeypatch):
    """A bf16 Llama (GQA, tied embeddings): logits, loss and every gradient close to the native kernel's."""
    monkeypatch.setenv(ENV, "fp32")
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    native = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ours = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ours.load_state_dict(native.state_dict())
    assert fp32_products(ours) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model, mode in ((native, "native"), (ours, "fp32")):
        monkeypatch.setenv(ENV, mode)  # the native model's attention native too
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach().float())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=0)
    for (name, p), q in zip(native.named_parameters(), ours.parameters()):
        cos = F.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), dim=0)
        assert cos > 0.999, name


def test_load_model_gives_it_where_wanted(base_dir, monkeypatch):
    monkeypatch.setenv(ENV, "fp32")
    model = load_model(str(base_dir), dtype="bf16")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 30 * 7 + 1 and all(getattr(m.forward, "fp32_matmul", False) for m in linears)
    monkeypatch.setenv(ENV, "native")
    model = load_model(str(base_dir), dtype="bf16")
    assert not any("forward" in m.__dict__ for m in model.modules())
    monkeypatch.setenv(ENV, "fp32")
    model = load_model(str(base_dir), dtype="fp32")
    assert not any("forward" in m.__dict__ for m in model.modules())


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 2, True


def _attention_inputs():
    """bf16 q [2, 4, 6, 8], k and v [2, 2, 6, 8] (GQA), and a packed-groups style additive mask in bf16."""
    q, k, v = bf16(2, 4, 6, 8, seed=7), bf16(2, 2, 6, 8, seed=8), bf16(2, 2, 6, 8, seed=9)
    allowed = torch.ones(6, 6).tril().bool().expand(2, 1, 6, 6).clone()
    allowed[1, :, 3:, :3] = False  # row 1: two segments of 3, as pack_groups gives
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
    return q, k, v, allowed, mask


def test_sdpa_attention_is_fp32_on_bf16_cpu_inputs(monkeypatch):
    """Registered for "sdpa" by fp32_products; forward = transformers' SDPA on fp32 copies rounded once;
    output and gradients bf16 and close to float64 attention; plain transformers SDPA under native."""
    monkeypatch.setenv(ENV, "fp32")
    fp32_products(torch.nn.Linear(2, 2).bfloat16())
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is fp32_sdpa_attention
    q, k, v, allowed, mask = _attention_inputs()
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, _ = fp32_sdpa_attention(_Attention(), q, k, v, mask, scaling=8 ** -0.5)
    want, _ = sdpa_attention_forward(_Attention(), q.float(), k.float(), v.float(), mask.float(), scaling=8 ** -0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    g = bf16(*out.shape, seed=10)
    out.backward(g)
    # float64 attention by hand: key/value head j serves query heads 2j, 2j+1
    q64, k64, v64 = q.detach().double(), k.detach().double().repeat_interleave(2, 1), v.detach().double().repeat_interleave(2, 1)
    q64.requires_grad_(), k64.requires_grad_(), v64.requires_grad_()
    scores = (q64 @ k64.transpose(-1, -2)) * 8 ** -0.5
    ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v64).transpose(1, 2)  # [B, T, H, D] like transformers
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=2 ** -7, atol=1e-3)
    for got, exact in ((q.grad, q64.grad), (k.grad, k64.grad.unflatten(1, (2, 2)).sum(2)), (v.grad, v64.grad.unflatten(1, (2, 2)).sum(2))):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -6, atol=2e-3)
    monkeypatch.setenv(ENV, "native")
    with torch.no_grad():
        plain, _ = sdpa_attention_forward(_Attention(), q, k, v, mask, scaling=8 ** -0.5)
        assert torch.equal(fp32_sdpa_attention(_Attention(), q, k, v, mask, scaling=8 ** -0.5)[0], plain)
    x32 = q.detach().float()
    assert torch.equal(fp32_sdpa_attention(_Attention(), x32, k.float(), v.float(), None)[0],
                       sdpa_attention_forward(_Attention(), x32, k.float(), v.float(), None)[0])
