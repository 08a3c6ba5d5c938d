"""Run on 2 ranks by tests/test_zero3_grad_buffer.py: two bf16 ZeRO-3 engines of different sizes (an actor
and a critic, as step 3 has) take turns for three steps each, once with ZeRO-3's fp32 gradients in the
kept buffer (rlhfkit.zero3_grad_buffer) and once with DeepSpeed's own method; writes what the test checks."""

from __future__ import annotations

import argparse
import copy
import json

import torch

from rlhfkit import distributed, zero3_grad_buffer
from rlhfkit.engines import batch_plan, build_engine


def engine_for(model):
    return build_engine(copy.deepcopy(model), plan=batch_plan(2, 1), zero_stage=3, dtype="bf16", offload=False,
                        learning_rate=1e-2, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                        lr_scheduler_type="constant", num_warmup_steps=0, total_steps=3)


def step(engine, loss: torch.Tensor) -> float:
    """One optimizer step of ``engine`` on ``loss`` -> the loss averaged over the ranks."""
    engine.backward(loss)
    engine.step()
    return float(distributed.all_reduce_mean(loss.detach().float()))


def train(actor_base, critic_base, rank: int) -> tuple[list[float], list[torch.Tensor], list[list[int]]]:
    """Both engines, their steps alternating -> (losses, every full fp32 weight after, the sizes of each
    engine's fp32 sub-group partitions)."""
    from deepspeed.utils import safe_get_full_fp32_param

    actor, critic = engine_for(actor_base), engine_for(critic_base)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for width in (10, 14, 12):
        ids = torch.randint(0, actor_base.config.vocab_size, (2, width), generator=gen)
        losses.append(step(actor, actor(input_ids=ids, labels=ids).loss))
        losses.append(step(critic, critic(input_ids=ids).logits.float().pow(2).mean()))
    weights = [safe_get_full_fp32_param(p).clone() for e in (actor, critic) for p in e.module.parameters()]
    sizes = [[t.numel() for t in e.optimizer.fp32_partitioned_groups_flat] for e in (actor, critic)]
    return losses, weights, sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher's
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    distributed.init()
    rank = distributed.rank()
    actor_base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    critic_base = AutoModelForSequenceClassification.from_pretrained(args.model, dtype=torch.float32, num_labels=1)
    out: dict = {"installed": zero3_grad_buffer.install()}
    kept_losses, kept_weights, out["partition_numel"] = train(actor_base, critic_base, rank)
    out["kept_numel"] = {str(k): v.numel() for k, v in zero3_grad_buffer._KEPT.items()}
    zero3_grad_buffer.uninstall()
    ds_losses, ds_weights, _ = train(actor_base, critic_base, rank)
    n_actor = sum(1 for _ in actor_base.parameters())
    out["losses"] = {"kept": kept_losses, "deepspeed": ds_losses}
    out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(kept_weights, ds_weights))
    start = [p.float() for m in (actor_base, critic_base) for p in m.parameters()]
    out["both_moved"] = [not all(torch.equal(a, b) for a, b in zip(kept_weights[s], start[s]))
                         for s in (slice(0, n_actor), slice(n_actor, None))]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
