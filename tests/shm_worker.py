"""Run on 2 ranks by tests/test_shm_collectives.py: ZeRO's all-gather and reduce-scatter through shared
memory (rlhfkit.shm_collectives, installed by ``rlhfkit.distributed.init``) against hand-computed values
and against gloo's own functions, then two ZeRO-3 engines trained two steps each, one through shared
memory and one through gloo; writes what the test checks."""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from rlhfkit import distributed
from rlhfkit.engines import batch_plan, build_engine
from rlhfkit.shm_collectives import BUFFER_BYTES, ShmCollectives


def pattern(n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in bf16): rank r's shard of the all-gather."""
    return ((torch.arange(n) % 7) - 3 + 10 * rank).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so -0.0 differs from 0.0, and a NaN equals the same NaN)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def check_collectives(shm: ShmCollectives, rank: int, world: int) -> list[dict]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        big = BUFFER_BYTES // (torch.finfo(dtype).bits // 8) + 7  # several pieces, the last a partial one
        for n in (1, 1000, 1_000_001, big):
            before = dict(shm.calls)
            got, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            shm.all_gather_into_tensor(got, pattern(n, rank, dtype))
            want = torch.cat([pattern(n, r, dtype) for r in range(world)])
            noise = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
            got2 = torch.empty_like(got)
            shm.all_gather_into_tensor(got2, noise)
            shm.fallback_gather(ref, noise)
            # in place, as ZeRO-3 gathers: the shard is a view of its own slot of the output
            got3 = torch.empty_like(got)
            got3[rank * n:(rank + 1) * n] = pattern(n, rank, dtype)
            shm.all_gather_into_tensor(got3, got3[rank * n:(rank + 1) * n])
            # reduce-scatter: rank r sends (i % 5) * (r + 1); the sum is (i % 5) * (1 + ... + world)
            full = (torch.arange(world * n) % 5).to(dtype)
            out = torch.empty(n, dtype=dtype)
            shm.reduce_scatter_tensor(out, full * (rank + 1))
            total = full[rank * n:(rank + 1) * n] * sum(range(1, world + 1))
            rnd = torch.randn(world * n, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
            out2, ref2 = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            shm.reduce_scatter_tensor(out2, rnd)
            shm.fallback_scatter(ref2, rnd)
            cases.append({"dtype": str(dtype), "n": n, "gather_hand": torch.equal(got, want) and torch.equal(got3, want),
                          "gather_gloo": same_bits(got2, ref),
                          "scatter_hand": torch.equal(out, total), "scatter_gloo": same_bits(out2, ref2),
                          "shm_calls": sum(shm.calls[k] - before[k] for k in ("all_gather", "reduce_scatter")),
                          "fallbacks": shm.calls["fallback"] - before["fallback"]})
    return on_every_rank(cases)


def on_every_rank(cases: list[dict]) -> list[dict]:
    """Each rank's cases merged (only rank 0 writes the results): a check holds where it holds on every rank,
    counts are rank 0's."""
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, cases)
    return [{k: all(c[i][k] for c in everyone) if isinstance(v, bool) else v for k, v in case.items()}
            for i, case in enumerate(cases)]


def check_coalesced(shm: ShmCollectives, rank: int, world: int) -> list[dict]:
    """ZeRO-3's averaged reduce-scatter of several gradients against DeepSpeed's own function (which goes
    through gloo here) on random values, and against the hand-computed mean on small integers."""
    import deepspeed.comm.comm as ds_comm

    cases = []
    big = BUFFER_BYTES // 2 + 3  # several pieces of the shared buffer, a part spanning two of them
    for sizes in ([8], [7], [1, 5, 1000, 3], [big, 13, big // 3]):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(7 + rank)
            grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
            before = dict(shm.calls)
            got = shm.reduce_scatter_coalesced([t.clone() for t in grads])
            calls = {k: shm.calls[k] - before[k] for k in shm.calls}
            # DeepSpeed's own function, its collective through gloo
            mine, ds_comm.cdb.reduce_scatter_function = ds_comm.cdb.reduce_scatter_function, shm.fallback_scatter
            want = shm.fallback_coalesced([t.clone() for t in grads])
            ds_comm.cdb.reduce_scatter_function = mine
            ints = [((torch.arange(n) % 9) * (rank + 1)).to(dtype) for n in sizes]  # mean: (i % 9) * (world + 1) / 2
            means = shm.reduce_scatter_coalesced(ints)
            chunks = [-(-n // world) for n in sizes]
            hand = [((torch.arange(n) % 9).to(torch.float64) * (world + 1) / 2)[rank * c:(rank + 1) * c].to(dtype)
                    for n, c in zip(sizes, chunks)]
            cases.append({"sizes": sizes[:4] if len(sizes) < 4 else "big", "dtype": str(dtype),
                          "ds": len(got) == len(want) and all(same_bits(a, b) for a, b in zip(got, want)),
                          "hand": all(torch.equal(a, b) for a, b in zip(means, hand)),
                          "lengths": [len(a) for a in got] == [len(b) for b in want], "shm_calls": calls["reduce_scatter"],
                          "fallbacks": calls["fallback"]})
    return on_every_rank(cases)


def check_fallbacks(shm: ShmCollectives, rank: int, world: int) -> dict:
    """Async handles, and the calls that must go to gloo: a strided input, an integer dtype."""
    before = shm.calls["fallback"]
    out = torch.empty(world * 4)
    handle = shm.all_gather_into_tensor(out, pattern(4, rank, torch.float32), async_op=True)
    waited = handle.wait()
    strided = pattern(8, rank, torch.float32)[::2]
    out2 = torch.empty(world * 4)
    shm.all_gather_into_tensor(out2, strided)
    ints = torch.empty(world * 4, dtype=torch.int64)
    shm.all_gather_into_tensor(ints, pattern(4, rank, torch.int64))
    return {"async_ok": bool(waited) and torch.equal(out, torch.cat([pattern(4, r, torch.float32) for r in range(world)])),
            "strided_ok": torch.equal(out2, torch.cat([pattern(8, r, torch.float32)[::2] for r in range(world)])),
            "ints_ok": torch.equal(ints, torch.cat([pattern(4, r, torch.int64) for r in range(world)])),
            "fallbacks": shm.calls["fallback"] - before}


def train(base, rank: int) -> tuple[list[float], list[torch.Tensor]]:
    """A bf16 ZeRO-3 engine trained two steps on this rank's batches -> (losses, full fp32 weights after)."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine = build_engine(copy.deepcopy(base), plan=batch_plan(2, 1), zero_stage=3, dtype="bf16", offload=False,
                          learning_rate=1e-2, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                          lr_scheduler_type="constant", num_warmup_steps=0, total_steps=2)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for width in (10, 14):
        ids = torch.randint(0, base.config.vocab_size, (2, width), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(distributed.all_reduce_mean(loss.detach().float())))
    return losses, [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--peer_dies", action="store_true", help="rank 1 exits before a collective rank 0 enters")
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher's
    args = ap.parse_args()
    import deepspeed.comm.comm as ds_comm
    from transformers import AutoModelForCausalLM

    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    backend = ds_comm.cdb
    shm = getattr(backend.all_gather_function, "owner", None)
    # whether DeepSpeed built its shared-memory all-reduce here (a JIT-compiled op), seen apart from install()
    available = backend.shm_comm_op is not None and hasattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_")
    out: dict = {"installed": shm is not None, "available": available}
    if args.peer_dies:
        if rank == 1:
            os._exit(0)
        shm.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))  # never returns: the watchdog ends it
    if shm is not None:
        out.update(cases=check_collectives(shm, rank, world), coalesced=check_coalesced(shm, rank, world),
                   fallback=check_fallbacks(shm, rank, world))
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        before = dict(shm.calls)
        shm_losses, shm_weights = train(base, rank)
        out["engine_shm_calls"] = {k: shm.calls[k] - before[k] for k in shm.calls}
        backend.all_gather_function, backend.reduce_scatter_function = shm.fallback_gather, shm.fallback_scatter
        gloo_losses, gloo_weights = train(base, rank)
        out["losses"] = {"shm": shm_losses, "gloo": gloo_losses}
        out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(shm_weights, gloo_weights))
        out["weights_moved"] = not all(torch.equal(a, p.float()) for a, p in zip(shm_weights, base.parameters()))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
