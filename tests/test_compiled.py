"""``--compile_blocks``: each transformer block's training forward compiled (rlhfkit.models.compiled)."""

from __future__ import annotations

import copy
import json

import torch
from rlhfkit.models.compiled import TrainingCompiled, compile_blocks
from testutils import run_program, tiny_llama


def _tiny_llama(dtype=torch.float32):
    return tiny_llama(dtype, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}  # AttributeError: a weight got no gradient


def test_compiled_blocks_train_like_the_eager_ones():
    """fp32: the compiled training pass gives the eager loss and every gradient up to rounding, at two
    sequence lengths (one graph with dynamic shapes); each block keeps its own weights."""
    eager = _tiny_llama()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 3
    assert all(isinstance(layer.forward, TrainingCompiled) for layer in compiled.model.layers)
    for width in (7, 12):
        ids = torch.randint(1, 100, (2, width), generator=torch.Generator().manual_seed(width))
        (l0, g0), (l1, g1) = _loss_and_grads(eager, ids), _loss_and_grads(compiled, ids)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        assert g1.keys() == g0.keys()
        for name in g0:
            assert g0[name].abs().max() > 0, name  # every block gets a gradient of its own
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_keep_the_fp32_products_of_cpus_without_bf16_kernels(monkeypatch):
    """Where oneDNN has no bf16 kernels, bf16 linears take fp32 products (a custom autograd Function,
    rlhfkit.models.cpu_bf16); compiled, every weight still gets its gradient, as eager's up to bf16 rounding."""
    from rlhfkit.models.cpu_bf16 import fp32_products

    monkeypatch.setenv("RLHFKIT_CPU_BF16_MATMUL", "fp32")
    eager, compiled = _tiny_llama(torch.bfloat16), _tiny_llama(torch.bfloat16)
    assert fp32_products(eager) == fp32_products(compiled) > 0  # each model its own (the forwards hold their layer)
    compile_blocks(compiled)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    (l0, g0), (l1, g1) = _loss_and_grads(eager, ids), _loss_and_grads(compiled, ids)
    torch.testing.assert_close(l1, l0, rtol=1e-3, atol=1e-3)
    for name in g0:
        scale = g0[name].float().abs().max()
        assert scale > 0, name
        assert (g1[name].float() - g0[name].float()).abs().max() <= 0.05 * scale, name


def test_passes_without_gradients_run_the_eager_forward_bit_for_bit():
    """bf16: evaluation and generation (no_grad, inference mode) keep the eager forward's exact bits,
    while a training pass runs the compiled graph (whose fused element-wise operations round otherwise)."""
    eager = _tiny_llama(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)
    with torch.inference_mode():
        assert torch.equal(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)
    trained = compiled(input_ids=ids).logits
    assert trained.requires_grad
    assert not torch.equal(trained.detach(), eager(input_ids=ids).logits.detach()), \
        "the training pass gave the eager bits: it did not run the compiled graph"


def test_compile_blocks_is_idempotent_and_leaves_models_without_block_classes_alone():
    model = _tiny_llama()
    compile_blocks(model)
    first = [layer.forward for layer in model.model.layers]
    assert compile_blocks(model) == 3
    assert [layer.forward for layer in model.model.layers] == first
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # no _no_split_modules
    assert compile_blocks(plain) == 0
    assert not any("forward" in m.__dict__ for m in plain.modules())


def test_compiled_blocks_under_zero3_on_two_ranks_give_the_eager_gradients(tiny_dir, tmp_path):
    """2 ranks, ZeRO-3 (fp32, each block gathered as one unit): DeepSpeed's hooks gather a block's
    shards around the compiled forward and again for its backward; the full gradients and the losses
    of two steps equal an eager engine's up to rounding."""
    out = tmp_path / "compiled.json"
    run_program("tests/compile_worker.py", ["--model", str(tiny_dir), "--out", str(out)], nprocs=2, timeout=900)
    got = json.loads(out.read_text())
    assert got["compiled_blocks"] == 2
    assert got["grads_checked"] == got["params"] > 0
    assert got["min_grad_norm"] > 0
    assert got["max_grad_diff"] <= 1e-4 * got["max_grad_abs"], got
    assert max(abs(a - b) for a, b in zip(got["losses"]["eager"], got["losses"]["compiled"])) < 1e-4, got
