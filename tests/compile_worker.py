"""Run under the deepspeed launcher by tests/test_compiled.py: two ZeRO-3 engines built from the same
model, one eager and one with ``compile_blocks``, each trained two steps on the same per-rank batches;
writes their full gradients' largest difference and their losses."""

from __future__ import annotations

import argparse
import copy
import json

import torch

from rlhfkit.engines import batch_plan, build_engine
from rlhfkit.models.compiled import TrainingCompiled


def train(engine, batches) -> tuple[list[float], list[torch.Tensor]]:
    """Two steps -> (losses averaged over ranks, the first step's full gradients)."""
    from deepspeed.utils import safe_get_full_grad

    losses, grads = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if not grads:
            grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    return losses, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = ap.parse_args()
    import deepspeed
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, base.config.vocab_size, (2, width), generator=gen) for width in (10, 14)]
    out: dict = {"losses": {}}
    grads = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        engine = build_engine(copy.deepcopy(base), plan=batch_plan(2, 1), zero_stage=3, dtype="fp32", offload=False,
                              learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                              lr_scheduler_type="constant", num_warmup_steps=0, total_steps=2, compile_blocks=compiled)
        if compiled:
            out["compiled_blocks"] = sum(isinstance(m.__dict__.get("forward"), TrainingCompiled) for m in engine.module.modules())
        out["losses"][name], grads[name] = train(engine, batches)
    pairs = list(zip(grads["eager"], grads["compiled"]))
    out["params"] = len(pairs)
    out["grads_checked"] = sum(a.shape == b.shape for a, b in pairs)
    out["min_grad_norm"] = min(a.norm().item() for a, _ in pairs)
    out["max_grad_abs"] = max(a.abs().max().item() for a, _ in pairs)
    out["max_grad_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
