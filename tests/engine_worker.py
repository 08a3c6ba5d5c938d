"""Run under the deepspeed launcher by tests/test_engine.py: builds two engines the same way from
the same model and trains each two steps on the same batch, one with DeepSpeed's gradient all-reduce
after backward (forced on) and one as ``build_engine`` leaves it; writes what the test checks."""

from __future__ import annotations

import argparse
import copy
import json

import torch

from rlhfkit.engines import batch_plan, build_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = ap.parse_args()
    import deepspeed
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out: dict = {}
    params = {}
    for name, force in (("forced", True), ("built", False)):
        engine = build_engine(copy.deepcopy(base), plan=batch_plan(2, 1), zero_stage=0, dtype=args.dtype, offload=False,
                              learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                              lr_scheduler_type="constant", num_warmup_steps=0, total_steps=2)
        out[f"{name}_allreduce"] = engine.enable_backward_allreduce
        if force:
            engine.enable_backward_allreduce = True
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        params[name] = [p.detach().clone() for p in engine.module.parameters()]
    out["same_bits"] = all(torch.equal(a, b) for a, b in zip(params["forced"], params["built"]))
    out["changed"] = not all(torch.equal(a, b) for a, b in zip(params["built"], base.parameters()))
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
