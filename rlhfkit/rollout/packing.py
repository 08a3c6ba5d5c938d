"""Decode-step linear layers on the CPU from weights packed once into oneDNN's blocked layout.

``F.linear`` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout at every call: at
a decode step's few rows that is much of the cost (bench/sampling.py). Packing each weight once per
generation call (as torch.compile's CPU backend does for frozen weights) gives the same bits without
the reorder. :func:`packed_linears` does it for every ``nn.Linear`` of a model, lazily; the fast
decoder (:mod:`rlhfkit.rollout.fast_decode`) packs a layer's query, key and value projections as one
matrix, and its gate and up projections as another (:func:`fused_linear`): a decode step then streams
each layer's weights in four products instead of seven. A fused product returns the bits of the
separate ones (tested: the columns of a product do not depend on the other columns).

On a CPU without bf16 kernels the copies are fp32 (twice the memory) and the products fp32, as
everywhere there (:mod:`rlhfkit.models.cpu_bf16`): converting each weight at every token would take
longer than the products.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from rlhfkit.models import cpu_bf16


def pack_dtype() -> torch.dtype | None:
    """The dtype decode-step weights are packed in: bf16 where oneDNN multiplies bf16; fp32 where bf16
    linears take their products in fp32 (:mod:`rlhfkit.models.cpu_bf16`); None without the ops."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and all(hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))):
        return None
    if cpu_bf16.wanted():
        return torch.float32
    return torch.bfloat16 if cpu_bf16.native_bf16_matmul() else None


def packable(layer: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` holding a whole bf16 weight on the CPU (not a LoRA layer, not a ZeRO-3 shard)."""
    return (type(layer) is torch.nn.Linear and layer.weight.dtype == torch.bfloat16 and layer.weight.device.type == "cpu"
            and layer.weight.dim() == 2 and layer.weight.numel() > 0)


def _product(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T + bias through oneDNN's packed op, for inputs of a decode step's rows."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype), weight, bias, "none", [], "").to(x.dtype)
    return forward


def fused_linear(layers: Sequence[torch.nn.Module], rows: int) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """One packed product computing the outputs of ``layers`` side by side (their concatenation on the
    last dimension), for inputs of at most ``rows`` rows; None unless every layer is :func:`packable`
    with the same input size and either all or none have a bias, and this CPU packs."""
    dtype = pack_dtype()
    if (dtype is None or not all(map(packable, layers)) or len({m.in_features for m in layers}) != 1
            or len({m.bias is None for m in layers}) != 1):
        return None
    with torch.no_grad():
        bias = None if layers[0].bias is None else torch.cat([m.bias.to(dtype) for m in layers])
        return packed_product(torch.cat([m.weight for m in layers]), rows, dtype, bias)


def packed_product(weight: torch.Tensor, rows: int, dtype: torch.dtype,
                   bias: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T (+ bias) for inputs of at most ``rows`` rows, from a copy of ``weight`` in ``dtype``
    (:func:`pack_dtype`) packed once into oneDNN's layout."""
    return _product(torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), rows), bias, dtype)


@contextlib.contextmanager
def packed_linears(module: torch.nn.Module, rows: int):
    """Within the block (inference only), every :func:`packable` ``nn.Linear`` of ``module`` computes
    inputs of at most ``rows`` rows (a decode step) from a copy of its weight reordered for oneDNN, made
    at its first such call; larger inputs (a prefill) keep the layer's own forward.

    At decode sizes the packed op returns ``F.linear``'s bits (tested; at hundreds of rows it can round
    differently, hence the prefill's plain path). The copies cost at most one model's weights in memory
    while the block runs (a layer whose decode-size products the caller computes another way, such as
    :func:`fused_linear`, is never copied); the layers' own ``forward`` is restored on exit.
    """
    dtype = pack_dtype()
    layers = [m for m in module.modules() if packable(m)]
    if not layers or dtype is None:
        yield
        return
    own = {m: m.__dict__["forward"] for m in layers if "forward" in m.__dict__}

    def packed(layer: torch.nn.Linear):
        fallback = own.get(layer) or (lambda x: torch.nn.functional.linear(x, layer.weight, layer.bias))
        product = []  # packed at the first decode-size call

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.numel() > rows * x.shape[-1]:  # a prefill: there oneDNN may block the sums differently
                return fallback(x)
            if not product:
                product.append(fused_linear([layer], rows))
            return product[0](x)
        return forward

    try:
        for m in layers:
            m.forward = packed(m)
        yield
    finally:
        for m in layers:
            if m in own:
                m.forward = own[m]
            else:
                m.__dict__.pop("forward", None)
