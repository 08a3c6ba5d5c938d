"""Rollout backends side by side: tokens/s of `hf` (gather once), `hf-synced` (generate on the ZeRO-3
module) and plain unsharded `generate`, in one run. Prints figures; asserts nothing.

    deepspeed --num_gpus 2 bench/rollout.py --model DIR [--batch_sizes 1,2,4] [--new_tokens 64] [--out f.json]

Every rank holds a ZeRO-3 (bf16 by default) engine of the model and, for the plain baseline, a full
plain copy built without DeepSpeed. Each method generates exactly ``--new_tokens`` tokens per
prompt (``min_new_tokens`` = ``max_new_tokens``: EOS cannot end a response early), greedy, on every
rank's own prompts; a figure is all ranks' tokens over the slowest rank's wall time, between
barriers. `hf` includes its weight gather and copy build (reported separately as "gather s").
`hf-synced` is slow (every layer is all-gathered for every token), so it may run fewer tokens
(``--synced_new_tokens``) and sizes (``--synced_batch_sizes``); its tokens/s stay comparable.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from rlhfkit import distributed  # noqa: E402
from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet in two sentences.",
    "How do I reverse a list in Python?",
    "What should I pack for a weekend hike?",
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def parse_sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def rank_prompts(tok, rank: int, batch: int, device) -> PromptBatch:
    """``batch`` chat prompts for this rank (other ranks get other questions), left-padded."""
    rows = []
    for i in range(batch):
        q = QUESTIONS[(rank * 3 + i) % len(QUESTIONS)]
        enc = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5 returns a BatchEncoding
        rows.append(list(ids[0] if ids and isinstance(ids[0], list) else ids))
    P = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=device)
    return PromptBatch(input_ids, mask)


def timed(fn, repeats: int = 1):
    """(output, wall seconds, cpu seconds) of the fastest of ``repeats`` runs; the slowest rank sets
    each run's time. The minimum is the robust figure on a machine shared with other work."""
    best = None
    for _ in range(repeats):
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        cpu = torch.tensor([time.process_time() - c0])
        torch.distributed.barrier()
        wall = time.perf_counter() - t0
        torch.distributed.all_reduce(cpu, op=torch.distributed.ReduceOp.MAX)
        if best is None or wall < best[1]:
            best = (out, wall, float(cpu))
    return best


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face causal LM directory")
    ap.add_argument("--batch_sizes", default="1,2,4", help="prompts per rank, comma-separated")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--synced_batch_sizes", default=None, help="sizes for hf-synced (default: --batch_sizes)")
    ap.add_argument("--synced_new_tokens", type=int, default=16,
                    help="tokens for hf-synced (it is slow; its tokens/s barely depend on this)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of plain and hf per size; the fastest counts (2+ on a busy machine)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--zero_stage", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def greedy_config(n: int, eos: int) -> GenerationConfig:
    """Exactly ``n`` greedy tokens (EOS cannot end a response early)."""
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)


@torch.no_grad()
def plain_generate(plain, prompts: PromptBatch, gen: GenerationConfig) -> torch.Tensor:
    out = plain.generate(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                         generation_config=gen.to_hf(), synced_gpus=False)
    return out[:, prompts.input_ids.shape[1]:]


def hf_rollout(backend, prompts: PromptBatch, gen: GenerationConfig, gathers: list[float]):
    """The `hf` backend's rollout; its gather time is appended to ``gathers``."""
    out = backend.generate(prompts, gen)
    gathers.append(backend.last_timings["gather"])
    return out


def build_models(args, dtype, device):
    """(plain, backends): the plain unsharded model and the ZeRO engine's `hf` and `hf-synced` backends."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # the plain baseline: a full model on each rank, built before any DeepSpeed config exists
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "steps_per_print": 10**9,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - from_pretrained partitions while it lives
    actor = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    engine, *_ = deepspeed.initialize(model=actor, config=ds_config)
    return plain, {"hf": make_rollout_engine("hf", engine), "hf-synced": make_rollout_engine("hf-synced", engine)}


def measure(args, prompts: PromptBatch, plain, backends: dict, eos: int, synced_tokens: int | None) -> dict:
    """One size: plain `generate`, `hf` and (when ``synced_tokens``) `hf-synced`, timed on every rank."""
    world, bsz = torch.distributed.get_world_size(), prompts.input_ids.shape[0]
    row = {"batch_per_rank": bsz, "ranks": world, "new_tokens": args.new_tokens, "prompt_len": prompts.input_ids.shape[1]}
    gen, gathers = greedy_config(args.new_tokens, eos), []
    plain_out, t, cpu = timed(functools.partial(plain_generate, plain, prompts, gen), args.repeats)
    row["plain_s"], row["plain_cpu_s"], row["plain_tok_s"] = t, cpu, world * bsz * args.new_tokens / t
    hf_out, t, cpu = timed(functools.partial(hf_rollout, backends["hf"], prompts, gen, gathers), args.repeats)
    gather = torch.tensor([min(gathers)])
    torch.distributed.all_reduce(gather, op=torch.distributed.ReduceOp.MAX)
    row["hf_s"], row["hf_cpu_s"], row["hf_tok_s"] = t, cpu, world * bsz * args.new_tokens / t
    row["hf_gather_s"] = float(gather)
    same = torch.tensor([int(torch.equal(hf_out.response_ids, plain_out))])
    if synced_tokens:
        sgen = greedy_config(synced_tokens, eos)
        synced_out, t, cpu = timed(functools.partial(backends["hf-synced"].generate, prompts, sgen))
        row["synced_new_tokens"] = synced_tokens
        row["hf_synced_s"], row["hf_synced_cpu_s"] = t, cpu
        row["hf_synced_tok_s"] = world * bsz * synced_tokens / t
        agree = torch.equal(hf_out.response_ids[:, :synced_tokens], synced_out.response_ids[:, :synced_tokens])
        same &= torch.tensor([int(agree)])
        row["hf_over_hf_synced"] = row["hf_tok_s"] / row["hf_synced_tok_s"]
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    row["greedy_tokens_identical"] = bool(same)
    row["hf_over_plain"] = row["hf_tok_s"] / row["plain_tok_s"]
    row["hf_over_plain_cpu"] = row["plain_cpu_s"] / row["hf_cpu_s"]  # same work: a ratio of CPU seconds
    return row


def print_table(rows: list[dict], meta: dict) -> None:
    header = (f"{'batch/rank':>10} {'new tok':>7} {'hf tok/s':>9} {'(gather s)':>10} {'hf-synced tok/s':>15} "
              f"{'plain tok/s':>11} {'hf/synced':>9} {'hf/plain':>8} {'(by cpu s)':>10} {'same tokens':>11}")
    print(f"\nrollout backends: {meta}")
    print("tok/s: all ranks' new tokens / the slowest rank's wall time (fastest of --repeats for hf and plain); "
          "hf includes its gather; hf-synced runs --synced_new_tokens (in brackets)")
    print(header)
    print("-" * len(header))
    for r in rows:
        synced = f"{r['hf_synced_tok_s']:.1f}" if "hf_synced_tok_s" in r else "-"
        synced += f" ({r['synced_new_tokens']})" if "synced_new_tokens" in r and r["synced_new_tokens"] != r["new_tokens"] else ""
        ratio = f"{r['hf_over_hf_synced']:.1f}x" if "hf_over_hf_synced" in r else "-"
        print(f"{r['batch_per_rank']:>10} {r['new_tokens']:>7} {r['hf_tok_s']:>9.1f} {r['hf_gather_s']:>10.2f} "
              f"{synced:>15} {r['plain_tok_s']:>11.1f} {ratio:>9} {r['hf_over_plain']:>7.2f}x "
              f"{r['hf_over_plain_cpu']:>9.2f}x "
              f"{'yes' if r['greedy_tokens_identical'] else 'no':>11}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]  # other work on the machine skews wall times: reported with the figures
    distributed.init()  # as the programs do: on one CPU host ZeRO's gathers go through shared memory
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(get_accelerator().current_device_name())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    plain, backends = build_models(args, DTYPES[args.dtype], device)

    # warm-up (first-call overheads)
    warm, warm_gen = rank_prompts(tok, rank, 1, device), greedy_config(2, tok.eos_token_id)
    plain_generate(plain, warm, warm_gen)
    for b in backends.values():
        b.generate(warm, warm_gen)

    synced_sizes = parse_sizes(args.synced_batch_sizes or args.batch_sizes)
    rows = []
    for bsz in parse_sizes(args.batch_sizes):
        synced_tokens = min(args.synced_new_tokens, args.new_tokens) if bsz in synced_sizes else None
        rows.append(measure(args, rank_prompts(tok, rank, bsz, device), plain, backends, tok.eos_token_id, synced_tokens))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)

    if rank == 0:
        meta = {"model": args.model, "dtype": args.dtype, "zero_stage": args.zero_stage, "ranks": world,
                "threads_per_rank": args.threads, "repeats": args.repeats, "device": str(device),
                "cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
                "torch": torch.__version__, "deepspeed": deepspeed.__version__}
        print_table(rows, meta)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
