"""How a model attends: position ids, which attention kernel it runs, 4D masks, its attention span.

A forward pass over left-padded or packed rows needs positions and masks of its own: the
positions ``generate`` uses (:func:`position_ids`), and for packed rows an arbitrary mask as the
additive 4D mask transformers takes (:func:`additive_mask`), which only some kernels accept
(:func:`takes_4d_mask`). :func:`attention_span` says when attention, not the weights, dominates a
token's cost, which decides whether packing rows pays.
"""

from __future__ import annotations

from typing import Any

import torch


def unwrap_model(model: Any) -> Any:
    """The transformers model inside ``model``: a DeepSpeed engine's module, a peft model's base model."""
    model = getattr(model, "module", model)  # DeepSpeed engine
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding ([B, T]): the same positions ``generate`` uses, so a forward
    pass over a left-padded prompt + response sees what the sampler saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def attention_kernel_of(model: Any) -> str | None:
    """The attention kernel ``model`` (possibly in a DeepSpeed engine or peft wrapper) runs: eager, sdpa, ..."""
    return getattr(unwrap_model(model).config, "_attn_implementation", None)


def takes_4d_mask(model: Any) -> bool:
    """Whether ``model``'s attention kernel takes an arbitrary 4D mask (eager and SDPA do; the flash
    kernels take only padding)."""
    return attention_kernel_of(model) in ("eager", "sdpa")


def attention_span(model: Any) -> float | None:
    """The number of attended keys at which a query's attention costs as much as its token's pass
    through the weights: ``n_params / (2 * hidden * layers)`` (per layer, QK^T and AV take 4 * hidden
    FLOPs per key; the weights 2 FLOPs per parameter). None when the config does not say."""
    base = unwrap_model(model)
    hidden, layers = getattr(base.config, "hidden_size", None), getattr(base.config, "num_hidden_layers", None)
    if not hidden or not layers:
        return None
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters())
    return n_params / (2 * hidden * layers)


def additive_mask(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """A bool [B, T, T] mask (query row may attend to key column) as the [B, 1, T, T] additive mask
    transformers takes, in ``model``'s dtype."""
    dtype = unwrap_model(model).get_input_embeddings().weight.dtype
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    blocked.masked_fill_(~allowed, torch.finfo(dtype).min)
    return blocked.unsqueeze(1)
