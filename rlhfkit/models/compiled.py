"""Transformer blocks compiled for training (``--compile_blocks``).

Each block of the model (its class in transformers' ``_no_split_modules``, the unit ZeRO-3 gathers
as one) gets a ``torch.compile``d forward, with dynamic shapes so that rows of any length and batch
size share one compiled graph. The compiled forward runs only where gradients are recorded: training
passes. Evaluation, generation and every other ``no_grad`` / inference-mode pass keep the eager
forward, so their numbers and their start-up time do not change.

Only the block's own ``forward`` is compiled, not ``Module.__call__``: DeepSpeed's ZeRO-3 hooks,
which gather a block's shards before its forward and before its backward, stay outside the graph
and run as they do in eager mode. A compiled block's arithmetic is the eager one's up to rounding
(fused element-wise operations round once instead of at every step).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of ``model``'s transformer blocks: the model's ``_no_split_modules`` (the list sits on
    the transformers model, also under peft and DeepSpeed wrappers). Empty for a model without the list."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return list({type(m) for m in model.modules() if type(m).__name__ in names})


class TrainingCompiled:
    """A block's forward: compiled while autograd records (a training pass), the eager forward otherwise."""

    def __init__(self, eager: Callable):
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if torch.is_grad_enabled() else self.eager)(*args, **kwargs)


def compile_blocks(model: torch.nn.Module) -> int:
    """Give each transformer block of ``model`` a :class:`TrainingCompiled` forward -> how many blocks
    (0 when the model lists no block classes: nothing changes). Idempotent."""
    classes = tuple(block_classes(model))
    if not classes:
        return 0
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    for block in blocks:
        if not isinstance(block.forward, TrainingCompiled):
            block.forward = TrainingCompiled(block.forward)
    return len(blocks)
