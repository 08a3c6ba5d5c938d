"""Train only the top of a model: the last N transformer blocks, the final norm and the head.

A reward model needs its score head trained from scratch, while much of what it reads (a preference) is
already in the pretrained features. With the lower blocks frozen, nothing below the lowest trained block
needs a backward pass, so a step costs little more than a forward pass: the CPU recipe of the small
pipeline.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.errors import ConfigError


def transformer_blocks(model: Any) -> torch.nn.ModuleList:
    """The model's list of transformer blocks (``model.model.layers`` for Llama-style models): the longest
    ``nn.ModuleList`` in it."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError(f"{type(model).__name__}: no list of transformer blocks found to freeze below")
    return max(lists, key=len)


def train_top_only(model: Any, top_blocks: int, heads: tuple[str, ...] = ("score", "lm_head", "v_head")) -> list[str]:
    """Freeze every parameter of ``model`` except those of its last ``top_blocks`` blocks, of the final norm
    (a norm module after the blocks) and of the heads named ``heads``. -> names of the trainable parameters."""
    blocks = transformer_blocks(model)
    if not 0 <= top_blocks <= len(blocks):
        raise ConfigError(f"--train_top_blocks {top_blocks}: the model has {len(blocks)} transformer blocks")
    model.requires_grad_(False)
    for block in list(blocks)[len(blocks) - top_blocks:]:
        block.requires_grad_(True)
    inside_blocks = {id(m) for m in blocks.modules()}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in heads or (leaf in ("norm", "final_layernorm", "ln_f") and id(module) not in inside_blocks):
            module.requires_grad_(True)
    return [n for n, p in model.named_parameters() if p.requires_grad]
