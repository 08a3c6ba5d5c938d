"""DeepSpeed engines of the training programs: a trained model (AdamW, warm-up schedule), a frozen one
(reference, reward), and how many optimiser steps a run takes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.ds_config import BatchPlan, train_config
from rlhfkit.errors import ConfigError
from rlhfkit.models.cpu_bf16 import fp32_products


def batch_plan(micro_batch: int, grad_accum: int) -> BatchPlan:
    return BatchPlan(micro_batch=micro_batch, grad_accum=grad_accum, world_size=dist.world_size())


def count_steps(n_batches_per_epoch: int, grad_accum: int, epochs: int, max_steps: Optional[int]) -> int:
    """Optimiser steps of a run: ceil(batches / grad_accum) per epoch, capped by ``max_steps``."""
    per_epoch = max(1, n_batches_per_epoch // grad_accum)
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps else total


def zero3_block_leaves(model: torch.nn.Module) -> list[type]:
    """Make ZeRO-3 gather, release and reduce each transformer block as one unit (DeepSpeed "leaf
    modules"; the granularity at which FSDP wraps a model), not each linear layer inside it.

    The blocks are the model's ``_no_split_modules`` (transformers' own list, which its FSDP
    integration also wraps). Same parameters and gradients, far fewer hooks and collectives per step.
    Returns the classes made leaves (none for a model without the list)."""
    from deepspeed.utils import set_z3_leaf_modules

    from rlhfkit.models.compiled import block_classes

    classes = block_classes(model)
    if classes:
        set_z3_leaf_modules(model, classes)
    return classes


def build_engine(model: torch.nn.Module, *, plan: BatchPlan, zero_stage: int, dtype: str, offload: bool,
                 learning_rate: float, weight_decay: float, betas: tuple[float, float], gradient_clipping: float,
                 lr_scheduler_type: str, num_warmup_steps: int, total_steps: int,
                 lora_learning_rate: Optional[float] = None, hybrid_engine: Optional[dict] = None, block_leaves: bool = True,
                 compile_blocks: bool = False):
    """Wrap a model in a DeepSpeed training engine with AdamW and a warm-up schedule (under ZeRO-3 with
    ``block_leaves``, each transformer block gathered as one unit: :func:`zero3_block_leaves`; with
    ``compile_blocks``, each block's training forward compiled: :mod:`rlhfkit.models.compiled`)."""
    import deepspeed
    from transformers import get_scheduler

    from rlhfkit.models import param_groups

    on_cuda = dist.on_cuda()
    cfg = train_config(plan=plan, zero_stage=zero_stage, dtype=dtype, offload=offload, gradient_clipping=gradient_clipping,
                       on_cuda=on_cuda, hybrid_engine=hybrid_engine)
    groups = param_groups(model, weight_decay, learning_rate, lora_learning_rate)
    if not groups:
        raise ConfigError("no trainable parameters (check --only_optimize_lora / --lora_dim)")
    # torch's fused AdamW (one kernel over all tensors, not a loop over them) on CUDA and CPU alike
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8, fused=True)

    def scheduler(opt):
        return get_scheduler(lr_scheduler_type, optimizer=opt, num_warmup_steps=num_warmup_steps,
                             num_training_steps=max(total_steps, 1))

    if zero_stage == 3 and hybrid_engine is None and block_leaves:
        leaves = zero3_block_leaves(model)
        dist.print_rank0(f"ZeRO-3 gathers each {', '.join(c.__name__ for c in leaves)} as one unit" if leaves else
                         "ZeRO-3 gathers parameters module by module (the model lists no transformer block classes)")
    fp32_products(model)  # heads and LoRA layers added after loading too
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    if zero_stage == 0 and engine.dp_world_size == 1:
        # One data-parallel rank: nothing to average, yet DeepSpeed would flatten, "all-reduce" and copy
        # back every gradient after each backward. Same bits without.
        engine.enable_backward_allreduce = False
    if compile_blocks:
        from rlhfkit.models import compiled

        n = compiled.compile_blocks(engine.module)
        dist.print_rank0(f"--compile_blocks: {n} transformer blocks run a compiled forward when training" if n else
                         "--compile_blocks: the model lists no transformer block classes; nothing compiled")
    return engine


def build_frozen_engine(model: torch.nn.Module, *, zero_stage: int, dtype: str, offload: bool, micro_batch: int,
                        block_leaves: bool = True):
    """A frozen model (reference, reward) as a DeepSpeed inference engine: ZeRO-3 shards it."""
    import deepspeed

    from rlhfkit.ds_config import eval_config

    model.requires_grad_(False)
    model.eval()
    cfg = eval_config(micro_batch=micro_batch, world_size=dist.world_size(), zero_stage=zero_stage, dtype=dtype, offload=offload)
    if zero_stage == 3 and block_leaves:
        zero3_block_leaves(model)
    fp32_products(model)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.eval()
    return engine


def trainable_engine(cfg: Any, kind: str, *, plan: BatchPlan, total_steps: int, pad_token_id: int,
                     row_len: Optional[int] = None):
    """``cfg.model_name_or_path`` loaded as ``kind`` (partitioned while loading under ZeRO-3), with
    gradient checkpointing and LoRA as configured, wrapped in a DeepSpeed training engine.
    ``row_len``: the longest training row (default ``cfg.max_seq_len``), for the attention choice."""
    from rlhfkit.ds_config import init_config
    from rlhfkit.models import apply_lora, enable_gradient_checkpointing, load_model, train_attention

    model = load_model(cfg.model_name_or_path, kind, dtype=cfg.dtype, dropout=cfg.dropout,
                       attn_implementation=train_attention(cfg.attn_implementation, row_len or cfg.max_seq_len, dist.on_cuda(), cfg.dtype),
                       zero3_ds_config=init_config(zero_stage=cfg.zero_stage, dtype=cfg.dtype, offload=cfg.offload),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights, pad_token_id=pad_token_id)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    top_only = getattr(cfg, "train_top_blocks", None) is not None
    if top_only:
        from rlhfkit.models.freeze import train_top_only

        trained = train_top_only(model, cfg.train_top_blocks)
        dist.print_rank0(f"training the top {cfg.train_top_blocks} blocks, the final norm and the head: "
                         f"{len(trained)} parameter tensors; the rest is frozen")
    model = apply_lora(model, cfg.lora_dim, cfg.lora_alpha, cfg.lora_module_name, cfg.only_optimize_lora,
                       task_type="SEQ_CLS" if kind == "reward" else "CAUSAL_LM")
    return build_engine(model, plan=plan, zero_stage=cfg.zero_stage, dtype=cfg.dtype, offload=cfg.offload,
                        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        gradient_clipping=cfg.gradient_clipping, lr_scheduler_type=cfg.lr_scheduler_type,
                        num_warmup_steps=cfg.num_warmup_steps, total_steps=total_steps, lora_learning_rate=cfg.lora_learning_rate,
                        # DeepSpeed's leaf path does not gather a block for its backward pass when the block's input
                        # needs no gradient, as the lowest trained block's does above frozen ones
                        block_leaves=cfg.zero3_block_leaves and not top_only, compile_blocks=cfg.compile_blocks)
