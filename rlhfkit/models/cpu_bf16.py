"""bf16 linear layers and attention on CPUs without bf16 matmul kernels: the products taken in fp32.

oneDNN multiplies bf16 matrices only on CPUs with AVX-512 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``).
Elsewhere (an AVX2-only CPU) torch falls back to a reference bf16 GEMM that is several times slower
than its fp32 GEMM on the same CPU, and slower still in the backward pass.

:func:`fp32_products` makes every bf16 ``nn.Linear`` of a model on such a CPU compute its
forward and backward products in fp32 from the bf16 values and round the result to bf16. The
weights, activations and gradients stay bf16; only the kernel changes. Converting bf16 to fp32 is
exact and the reference bf16 GEMM accumulates in fp32 too, so the results agree with the bf16
kernel up to the order of the sums (tested). Nothing saved for the backward pass is fp32: the
function keeps the bf16 input and weight and converts again there. On CPUs with bf16 kernels, on
GPUs and for other dtypes, nothing is changed.

Attention too: transformers' SDPA attention on bf16 CPU tensors runs torch's flash-attention kernel,
whose backward pass is made of bf16 GEMMs there, a large share of a forward + backward.
:func:`fp32_products` registers an SDPA attention that
takes such inputs in fp32 and rounds the output to bf16 once; elsewhere it is transformers' own.

``RLHFKIT_CPU_BF16_MATMUL=native`` turns it off (to compare: bench/grpo.py under each value);
``=fp32`` turns it on even where oneDNN has bf16 kernels.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

ENV = "RLHFKIT_CPU_BF16_MATMUL"


_NATIVE_BF16: list[bool] = []  # the answer, once asked (a plain list, not functools.cache: torch.compile
# traces into a compiled block's attention call, --compile_blocks, and warns at a cache wrapper)


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices with oneDNN's kernels (a fact of the machine: asked once;
    :func:`wanted` runs at every attention call)."""
    if not _NATIVE_BF16:
        ops = torch.ops.mkldnn
        _NATIVE_BF16.append(bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_is_mkldnn_bf16_supported")
                                 and ops._is_mkldnn_bf16_supported()))
    return _NATIVE_BF16[0]


def wanted() -> bool:
    """Whether bf16 CPU linears should take their products in fp32 here (``RLHFKIT_CPU_BF16_MATMUL``
    auto|fp32|native; auto: where oneDNN has no bf16 kernels)."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice not in ("auto", "fp32", "native"):
        raise ValueError(f"{ENV}={choice!r}: use auto, fp32 or native")
    return choice == "fp32" or (choice == "auto" and not native_bf16_matmul())


class Fp32MatmulLinear(torch.autograd.Function):
    """``F.linear`` for bf16 tensors with the three products (output, input grad, weight grad) in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


def _forward(layer: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or layer.weight.dtype != torch.bfloat16 or x.device.type != "cpu":
            return F.linear(x, layer.weight, layer.bias)
        return Fp32MatmulLinear.apply(x, layer.weight, layer.bias)
    forward.fp32_matmul = True
    return forward


def fp32_sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention; bf16 CPU inputs (where :func:`wanted`) computed in fp32 (a float
    mask and position bias with them), the output rounded to bf16. Autograd carries the casts, so the
    backward pass runs fp32 too and hands bf16 gradients back."""
    if query.dtype != torch.bfloat16 or query.device.type != "cpu" or not wanted():
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    up = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    out, weights = sdpa_attention_forward(module, up(query), up(key), up(value), up(attention_mask), *args,
                                          **{k: up(v) for k, v in kwargs.items()})
    return out.to(query.dtype), weights


def fp32_products(model: torch.nn.Module) -> int:
    """Where :func:`wanted`: every bf16 CPU ``nn.Linear`` of ``model`` gets fp32 products, and
    transformers' "sdpa" attention becomes :func:`fp32_sdpa_attention` (for the process: it checks
    :func:`wanted` at each call). -> how many linear layers have fp32 products (layers done before
    count again, so calling twice is harmless; a layer with a forward of someone else's is left alone)."""
    if not wanted():
        return 0
    AttentionInterface.register("sdpa", fp32_sdpa_attention)
    count = 0
    for m in model.modules():
        if type(m) is not torch.nn.Linear or m.weight.dtype != torch.bfloat16 or m.weight.device.type != "cpu":
            continue
        current = m.__dict__.get("forward")
        if current is None:
            m.forward = _forward(m)
        elif not getattr(current, "fp32_matmul", False):
            continue
        count += 1
    return count
