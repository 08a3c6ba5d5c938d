"""Training throughput of steps 1 and 2 against DeepSpeed-Chat's recipes, side by side in one run,
each also as a fraction of this machine's matmul peak measured in the same run.

    python bench/train_throughput.py --model BASE_DIR [--steps 6] [--out bench_train.json]
    python bench/train_throughput.py --stage reward --model SFT_DIR [--steps 8]
    python bench/train_throughput.py --stage dpo --model SFT_DIR [--steps 8]

--stage sft (default): step 1 on 1 rank ZeRO-0 and on 2 ranks ZeRO-3 at the same global batch, and
DeepSpeed-Chat's step-1 recipe (bench/dschat_baseline.py) at the 2-rank ZeRO-3 settings.
--stage reward: step 2 on 2 ranks ZeRO-3 with packed pairs (the default) and with the two
sequences of a pair in separate rows, and DeepSpeed-Chat's step-2 recipe, 2 pairs per rank each.
--stage dpo: step2_dpo the same two ways (DeepSpeed-Chat has no DPO), then packed with the reference's
forwards on a kept gathered copy and through the ZeRO-3 engine (the default runs them on a copy
gathered per forward).
Each stage also runs rlhfkit with --compile_blocks (each transformer block's training forward compiled):
step 1 on both layouts, steps 2 and DPO packed on 2 ranks ZeRO-3.

Runs the programs for real (bf16, --max_seq_len 256, hh-rlhf pairs) and reads their metrics logs;
the first optimiser step (warm-up) is left out of the steady-state figures. Prints a table and
writes JSON. Figures, not assertions: this machine is noisy, compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
COMPILED = ("--compile_blocks", "true")  # each transformer block's training forward compiled


def matmul_peak(dtype_name: str, threads: int, shapes: list[tuple[int, int, int]], seconds: float = 1.5) -> dict:
    """GFLOP/s of ``a @ b`` for each (m, k, n) in ``shapes`` on ``threads`` threads (in a subprocess, so the
    thread count is exact): ``{"peak": the fastest, "square_1024": that shape's rate if listed, "shape": the
    fastest's}``. One square size is not a peak: on the Xeon's AMX a 1024^3 bf16 product runs at about half
    the rate of SmolLM2-135M's own products at a few thousand tokens."""
    code = f"""
import json, time, torch
torch.set_num_threads({threads})
rates = []
for m, k, n in {shapes!r}:
    a = torch.randn(m, k, dtype=torch.{dtype_name}); b = torch.randn(k, n, dtype=torch.{dtype_name})
    for _ in range(3): a @ b
    t = time.time(); c = 0
    while time.time() - t < {seconds}:
        a @ b; c += 1
    rates.append(2 * m * k * n * c / (time.time() - t) / 1e9)
print(json.dumps(rates))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    best = max(range(len(shapes)), key=rates.__getitem__)
    return {"peak": rates[best], "shape": list(shapes[best]),
            "square_1024": rates[shapes.index((1024, 1024, 1024))] if (1024, 1024, 1024) in shapes else None}


def peak_shapes(hidden: int, intermediate: int, tokens: int = 4096) -> list[tuple[int, int, int]]:
    """Square products and the model's own (query/output, gate/up, down) at ``tokens`` rows."""
    return [(1024, 1024, 1024), (2048, 2048, 2048), (tokens, hidden, hidden), (tokens, hidden, intermediate),
            (tokens, intermediate, hidden)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rlhfkit(stage: str, model: str, ranks: int, zero: int, micro: int, steps: int, seq: int, data: str, workdir: str,
                extra: tuple[str, ...] = ()) -> dict:
    """step1_sft, step2_reward or step2_dpo (``stage``) for ``steps`` optimiser steps; samples are sequences."""
    out = os.path.join(workdir, f"{stage}-r{ranks}-z{zero}-" + ("_".join(e.strip("-") for e in extra) or "default"))
    threads = max(1, (os.cpu_count() or 2) // ranks)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    program = {"sft": "step1_sft/main.py", "reward": "step2_reward/main.py", "dpo": "step2_dpo/main.py"}[stage]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
           str(REPO / program), "--model_name_or_path", model, "--data_path", data, "--output_dir", out,
           "--zero_stage", str(zero), "--dtype", "bf16", "--max_seq_len", str(seq), "--per_device_train_batch_size", str(micro),
           "--max_steps", str(steps), "--max_eval_samples", "2", "--progress_bar", "false", "--lr_scheduler_type", "constant",
           *extra]
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "logs", "metrics.jsonl")) if "train/samples" in x]
    first, last = rows[0], rows[-1]
    dt = last["time_s"] - first["time_s"]
    samples = last["train/samples"] - first["train/samples"]
    tokens = last["train/tokens"] - first["train/tokens"]
    return {"name": f"rlhfkit {ranks} rank ZeRO-{zero} ({micro}x{ranks}){' ' + ' '.join(extra) if extra else ''}",
            "ranks": ranks, "zero_stage": zero, "micro_batch": micro, "global_batch": micro * ranks,
            "steps_timed": len(rows) - 1, "seconds_per_step": dt / max(len(rows) - 1, 1),
            "samples_per_s": samples / dt, "tokens_per_s": tokens / dt, "wall_s": time.time() - t}


def run_dschat(stage: str, model: str, micro: int, steps: int, seq: int, data: str, workdir: str) -> dict:
    out = os.path.join(workdir, "dschat.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "bench/dschat_baseline.py"), "--stage", stage, "--model", model, "--data", data, "--steps", str(steps),
           "--micro", str(micro), "--seq", str(seq), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"name": f"DS-Chat recipe 2r Z3 ({micro}x2)", "ranks": 2, "zero_stage": 3, "micro_batch": micro,
            "global_batch": 2 * micro, "recipe": "deepspeed-chat", **json.load(open(out))}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="base or SFT checkpoint directory (SmolLM2-135M: rlhfkit prepare-base)")
    ap.add_argument("--stage", choices=["sft", "reward", "dpo"], default="sft")
    ap.add_argument("--data", default=str(HH))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global_batch", type=int, default=None, help="rows (sft, default 8) or pairs (reward, default 4)")
    ap.add_argument("--out", default="bench_train_throughput.json")
    return ap.parse_args()


def run_stage(args: argparse.Namespace, work: str) -> list[dict]:
    """The stage's runs, in the order :func:`ratios` reads them."""
    common = (args.steps, args.seq, args.data)
    if args.stage == "sft":
        batch = args.global_batch or 8
        # rows: 1 rank ZeRO-0, 2 ranks ZeRO-3, the same two compiled, DeepSpeed-Chat's recipe
        runs = [run_rlhfkit("sft", args.model, ranks, zero, batch // ranks, *common, work, extra=extra)
                for extra in ((), COMPILED) for ranks, zero in ((1, 0), (2, 3))]
        return runs + [run_dschat("sft", args.model, batch // 2, *common, work)]
    micro = (args.global_batch or 4) // 2
    runs = [run_rlhfkit(args.stage, args.model, 2, 3, micro, *common, work),
            run_rlhfkit(args.stage, args.model, 2, 3, micro, *common, work, extra=("--pack_pairs", "false"))]
    if args.stage == "dpo":  # the reference's forwards on its gathered copy (default), kept, and through the engine
        runs += [run_rlhfkit("dpo", args.model, 2, 3, micro, *common, work, extra=(flag, value))
                 for flag, value in (("--keep_reference_copy", "true"), ("--reference_on_copy", "false"))]
    runs.append(run_rlhfkit(args.stage, args.model, 2, 3, micro, *common, work, extra=COMPILED))
    if args.stage == "reward":
        runs.append(run_dschat("reward", args.model, micro, *common, work))
    return runs


def add_rates(runs: list[dict], stage: str, flop_per_token: float, peaks: dict) -> None:
    """Each run's model GFLOP/s and its fractions of the measured peaks (and pairs/s for pair stages)."""
    for r in runs:
        achieved = r["tokens_per_s"] * flop_per_token / 1e9
        r["model_gflops"] = achieved
        r["fraction_of_bf16_peak"] = achieved / peaks["bf16"]
        r["fraction_of_fp32_peak"] = achieved / peaks["fp32"]
        r["fraction_of_bf16_square_1024"] = achieved / peaks["bf16_square_1024"]
        if stage != "sft":
            r["pairs_per_s"] = r["samples_per_s"] / 2


def rate_key(stage: str) -> tuple[str, str]:
    """(the run's rate key, its unit): sequences for step 1, pairs for the pair stages."""
    return ("samples_per_s", "samples/s") if stage == "sft" else ("pairs_per_s", "pairs/s")


def ratios(runs: list[dict], stage: str) -> dict:
    """The same-run ratios (keyed as in the JSON summary), each printed with what it compares."""
    key, unit = rate_key(stage)
    out = {}
    if stage == "sft":
        out["zero3_over_zero0"] = runs[1]["samples_per_s"] / runs[0]["samples_per_s"]
        print(f"2-rank ZeRO-3 / 1-rank ZeRO-0 samples/s: {out['zero3_over_zero0']:.2f}")
        out["compiled_over_eager"] = [runs[2]["tokens_per_s"] / runs[0]["tokens_per_s"],
                                      runs[3]["tokens_per_s"] / runs[1]["tokens_per_s"]]
        print("--compile_blocks / eager tokens/s: {:.2f} (1 rank ZeRO-0), {:.2f} (2 ranks ZeRO-3)".format(*out["compiled_over_eager"]))
    else:
        out["compiled_over_eager"] = runs[-2 if stage == "reward" else -1]["tokens_per_s"] / runs[0]["tokens_per_s"]
        print(f"--compile_blocks / eager tokens/s, packed, 2 ranks ZeRO-3: {out['compiled_over_eager']:.2f}")
        out["packed_over_apart"] = runs[0][key] / runs[1][key]
        print(f"packed pairs / pairs in separate rows, pairs/s: {out['packed_over_apart']:.2f}")
    if stage == "dpo":
        out["copy_over_engine"] = runs[0][key] / runs[3][key]
        out["kept_copy_over_engine"] = runs[2][key] / runs[3][key]
        print(f"reference on a gathered copy / through the ZeRO-3 engine, {unit}: {out['copy_over_engine']:.2f} "
              f"(kept copy: {out['kept_copy_over_engine']:.2f})")
    else:
        out["rlhfkit_over_dschat"] = runs[1 if stage == "sft" else 0][key] / runs[-1][key]
        print(f"rlhfkit / DeepSpeed-Chat recipe, both 2-rank ZeRO-3, {unit}: {out['rlhfkit_over_dschat']:.2f} (target >= 1.5)")
    return out


def print_table(runs: list[dict], stage: str) -> None:
    key, unit = rate_key(stage)
    print(f"{'setup':<48}{'s/step':>8}{unit:>11}{'tokens/s':>10}{'GFLOP/s':>9}{'of bf16':>9}{'of 1024^3':>10}")
    for r in runs:
        print(f"{r['name']:<48}{r['seconds_per_step']:>8.2f}{r[key]:>11.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['model_gflops']:>9.0f}{r['fraction_of_bf16_peak']:>9.1%}{r['fraction_of_bf16_square_1024']:>10.1%}")


def main() -> None:
    args = parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhfkit.models import cpu_bf16

    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)).parameters())
    flop_per_token = 6 * n_params  # forward + backward, dense part (the tied LM head counted once)
    threads = os.cpu_count() or 2
    # where oneDNN has no bf16 kernels the programs' bf16 linears take fp32 products: that is their peak
    bf16_products = "float32" if cpu_bf16.wanted() else "bfloat16"
    # the peak is measured before and after the runs and the higher one kept: a noisy machine's low
    # reading would otherwise inflate every fraction of it
    cfg = AutoConfig.from_pretrained(args.model)
    shapes = peak_shapes(cfg.hidden_size, getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size)
    before = {"bf16": matmul_peak(bf16_products, threads, shapes), "fp32": matmul_peak("float32", threads, shapes)}
    with tempfile.TemporaryDirectory() as work:
        runs = run_stage(args, work)
    after = {"bf16": matmul_peak(bf16_products, threads, shapes), "fp32": matmul_peak("float32", threads, shapes)}
    peaks = {k: max(before[k]["peak"], after[k]["peak"]) for k in before}
    peaks["bf16_square_1024"] = max(before["bf16"]["square_1024"], after["bf16"]["square_1024"])
    add_rates(runs, args.stage, flop_per_token, peaks)
    best = max((before["bf16"], after["bf16"]), key=lambda r: r["peak"])["shape"]
    print(f"\nmatmul peak on {threads} threads, the fastest of {shapes} (higher of before / after the runs: bf16 "
          f"{before['bf16']['peak']:.0f} / {after['bf16']['peak']:.0f}): bf16 {peaks['bf16']:.0f} GFLOP/s at {best}"
          f"{' (fp32 products: no oneDNN bf16 kernels)' if bf16_products == 'float32' else ''}, fp32 {peaks['fp32']:.0f} GFLOP/s; "
          f"a 1024^3 bf16 product alone (the peak of figures before 2026-12-07): {peaks['bf16_square_1024']:.0f} GFLOP/s; "
          f"model {n_params / 1e6:.0f}M params, {flop_per_token / 1e9:.2f} GFLOP per trained token")
    print_table(runs, args.stage)
    summary = {"peaks_gflops": peaks, "peaks_before_after": [before, after], "params": n_params, "stage": args.stage,
               "runs": runs, **ratios(runs, args.stage)}
    print("(tokens/s count every real token a recipe computes: separate rows count a pair's prompt twice, packed pairs once)")
    if args.stage != "dpo":
        print("fixed reference on this machine type: DeepSpeed-Chat step 1 ~0.80 samples/s, step 2 ~0.53 pairs/s")
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
