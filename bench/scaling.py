"""How cost grows: seconds per step and peak memory per rank of steps 1, 2 and 3, one factor at a time from the
default settings, all in one run.

    python bench/scaling.py --base BASE_DIR [--out scaling.json] [--png scaling.png]
    python bench/scaling.py --base BASE_DIR --quick          # ~5 min: step 1 at one point per axis, step 3 once

Default point: the default model (SmolLM2-135M, ``rlhfkit prepare-base``), 2 ranks, ZeRO-3, bf16, sequences of
256 tokens. Axes, each varied alone from it:
- model: the SmolLM2-360M architecture built from its config with random weights (nothing is downloaded);
- sequence length: 256, 512, 1024, 2048 tokens (step 3: half prompt, half answer, every prompt exactly half the
  length (bench/workloads.py) and every answer forced to its full length with --min_new_tokens);
- ranks and sharding: 1 and 2 ranks, ZeRO-2 and ZeRO-3.
The global batch stays fixed along every axis (step 1: 2 rows, step 2: 2 pairs, step 3: 2 prompts), so each
point does the same work. Every row is full length: hh-rlhf conversations are joined into long rows. The
programs run for real: step 2 starts from the base checkpoint and step 3's critic and reward model is the reward
model that step 2 wrote at the same point (the cost does not depend on the weights); the first step is warm-up
and left out. Prints a table and writes JSON and a PNG.
Figures, not assertions: compare within one run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from revisions import REPO, current_tree, run_program, tree_env
from workloads import exact_length_prompts

HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
PROGRAMS = {"step1": "step1_sft/main.py", "step2": "step2_reward/main.py", "step3": "step3_ppo/main.py"}
DEFAULT = {"model": "135M", "seq": 256, "ranks": 2, "zero": 3}
AXES = {
    "model": [{"model": "360M"}],
    "seq": [{"seq": 512}, {"seq": 1024}, {"seq": 2048}],
    "ranks": [{"ranks": 1, "zero": 2}, {"ranks": 1, "zero": 3}, {"ranks": 2, "zero": 2}],
}
QUICK_AXES = {"model": [{"model": "360M"}], "seq": [{"seq": 512}], "ranks": [{"ranks": 1, "zero": 3}]}
SMOLLM2_360M = {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
                "num_key_value_heads": 5}
GLOBAL_BATCH = 2


def points(quick: bool) -> list[dict]:
    """The default point, then each axis's other values with everything else at the default."""
    out = [{"axis": "default", **DEFAULT}]
    for axis, values in (QUICK_AXES if quick else AXES).items():
        out += [{"axis": axis, **DEFAULT, **v} for v in values]
    return out


def build_360m(base: str, out: str) -> str:
    """The SmolLM2-360M architecture (its published config's sizes) with seeded random weights and the base's
    tokenizer, saved as a checkpoint the programs load like any other."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if Path(out, "config.json").exists():
        return out
    config = AutoConfig.from_pretrained(base)
    for k, v in SMOLLM2_360M.items():
        setattr(config, k, v)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def long_rows(path: str, out: str, rows: int = 64, joined: int = 24) -> str:
    """hh-rlhf pairs whose prompts carry ``joined`` earlier conversations in front of their own (JSONL in
    ``out``): every prompt is longer than 2048 tokens, so every sequence fills --max_seq_len."""
    with gzip.open(path, "rt") as f:
        pairs = [json.loads(line) for _, line in zip(range(rows * (joined + 1)), f)]
    lines = []
    for i in range(rows):
        group = pairs[i * (joined + 1):(i + 1) * (joined + 1)]
        history = "".join(p["chosen"] for p in group[:-1])
        last = group[-1]
        lines.append(json.dumps({"chosen": history + last["chosen"], "rejected": history + last["rejected"]}) + "\n")
    Path(out).write_text("".join(lines))
    return out


def program_args(program: str, point: dict, model: str, data: str, out: str, critic: str = "") -> list[str]:
    per_rank = str(max(1, GLOBAL_BATCH // point["ranks"]))
    common = ["--data_path", data, "--output_dir", out, "--dtype", "bf16", "--progress_bar", "false", "--seed", "1234"]
    if program == "step3":
        half = str(point["seq"] // 2)
        return [*common, "--actor_model_name_or_path", model, "--critic_model_name_or_path", critic,
                "--actor_zero_stage", str(point["zero"]), "--critic_zero_stage", str(point["zero"]),
                "--per_device_generation_batch_size", per_rank, "--per_device_training_batch_size", per_rank,
                "--max_prompt_seq_len", half, "--max_answer_seq_len", half, "--min_new_tokens", half,
                "--max_steps", "2", "--eval_fraction", "0"]
    return [*common, "--model_name_or_path", model, "--zero_stage", str(point["zero"]), "--max_seq_len", str(point["seq"]),
            "--per_device_train_batch_size", per_rank, "--max_steps", "3", "--max_eval_samples", "2",
            "--lr_scheduler_type", "constant"]


def seconds_per_step(program: str, metrics: Path) -> float:
    """The median step time after the first (warm-up) step, from the program's metrics log."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    if program == "step3":
        times = [r["time/step_s"] for r in rows if "time/step_s" in r][1:]
    else:
        stamps = [r["time_s"] for r in rows if "train/samples" in r]
        times = [b - a for a, b in zip(stamps, stamps[1:])]
    if not times:
        raise SystemExit(f"{metrics}: no timed step after the warm-up")
    return statistics.median(times)


def step3_prompts(tokenizer, workdir: str, length: int) -> str:
    """Prompt-only rows of exactly ``length`` tokens (bench/workloads.py), written once per length."""
    path = os.path.join(workdir, f"prompts-{length}.jsonl")
    return path if Path(path).exists() else exact_length_prompts(str(HH), tokenizer, path, rows=64, length=length)


def run_dir(workdir: str, program: str, point: dict) -> str:
    return os.path.join(workdir, f"{program}-{point['axis']}-{point['model']}-s{point['seq']}-r{point['ranks']}-z{point['zero']}")


def measure(tree, program: str, point: dict, models: dict, data: str, workdir: str) -> dict:
    out = run_dir(workdir, program, point)
    critic = run_dir(workdir, "step2", point)
    if program == "step3" and not Path(critic, "config.json").exists():
        raise SystemExit("step3 takes its critic from step2's run at the same point: include step2 in --programs")
    threads = max(1, (os.cpu_count() or 2) // point["ranks"])
    env = tree_env(tree, threads=threads, extra={"RLHFKIT_REPORT_MEMORY": "1"})
    start = time.time()
    try:
        proc = run_program(tree, PROGRAMS[program], program_args(program, point, models[point["model"]], data, out, critic),
                           nprocs=point["ranks"], env=env)
    except SystemExit as e:  # a point that does not run here (out of memory) is a result of the curve too
        return {"program": program, **point, "failed": failure(str(e)), "wall_s": time.time() - start}
    peaks = [float(p) for p in re.findall(r"\[memory\] rank \d+: peak ([\d.]+) GiB", proc.stdout)]
    return {"program": program, **point, "step_s": seconds_per_step(program, Path(out, "logs", "metrics.jsonl")),
            "peak_gib": max(peaks) if peaks else float("nan"), "wall_s": time.time() - start}


def failure(message: str) -> str:
    """One line for a failed run: out of memory when the kernel killed a rank, else the last error line."""
    if "out of memory" in message.lower() or "exits with return code = -9" in message or "(-9)" in message:
        return "out of memory (a rank was killed)"
    lines = [x for x in message.splitlines() if x.startswith("error:")] or message.splitlines()[-1:]
    return lines[0][:120] if lines else "failed"


def label(row: dict) -> str:
    return {"model": row["model"], "seq": str(row["seq"]), "ranks": f"{row['ranks']}r Z{row['zero']}"}.get(row["axis"], "default")


def print_table(rows: list[dict]) -> None:
    """Per program and point: s/step and peak GiB/rank, and both as ratios to the default point."""
    print(f"\n{'program':8}{'axis':>8}{'point':>16}{'s/step':>9}{'x default':>11}{'peak GiB/rank':>15}{'x default':>11}")
    for program in PROGRAMS:
        mine = [r for r in rows if r["program"] == program]
        base = next((r for r in mine if r["axis"] == "default" and "failed" not in r), None)
        for r in mine:
            point = label(r) if r["axis"] != "default" else "135M/256/2r Z3"
            if "failed" in r:
                print(f"{program:8}{r['axis']:>8}{point:>16}  {r['failed']}")
                continue
            t_ratio = r["step_s"] / base["step_s"] if base else float("nan")
            m_ratio = r["peak_gib"] / base["peak_gib"] if base else float("nan")
            print(f"{program:8}{r['axis']:>8}{point:>16}{r['step_s']:>9.2f}{t_ratio:>11.2f}{r['peak_gib']:>15.2f}{m_ratio:>11.2f}")


def plot(rows: list[dict], png: str) -> None:
    """One column per axis (the default point included), seconds per step above and peak memory below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for col, axis in enumerate(AXES):
        for program in PROGRAMS:
            mine = [r for r in rows if r["program"] == program and r["axis"] in ("default", axis) and "failed" not in r]
            mine.sort(key=lambda r: (r["seq"], r["ranks"], r["zero"], r["model"]))
            if axis == "seq":
                xs = [r["seq"] for r in mine]
            else:
                xs = [label({**r, "axis": axis}) for r in mine]
            for row, key in ((0, "step_s"), (1, "peak_gib")):
                axes[row][col].plot(xs, [r[key] for r in mine], marker="o", label=program)
        failed = [f"{r['program']} at {label(r)}: {r['failed']}" for r in rows if r["axis"] == axis and "failed" in r]
        if failed:
            axes[1][col].text(0.02, 0.98, "\n".join(failed), transform=axes[1][col].transAxes, va="top", fontsize=8)
        if axis == "seq":
            for row in (0, 1):
                axes[row][col].set_xscale("log", base=2)
                axes[row][col].set_yscale("log", base=2)
        axes[0][col].set_title({"model": "model size", "seq": "sequence length (tokens)", "ranks": "ranks and ZeRO stage"}[axis])
    axes[0][0].set_ylabel("seconds per step")
    axes[1][0].set_ylabel("peak GiB per rank")
    axes[0][0].legend()
    fig.suptitle("rlhfkit cost, one factor at a time from 135M / 256 tokens / 2 ranks ZeRO-3 (CPU)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the default model's base checkpoint (rlhfkit prepare-base)")
    ap.add_argument("--quick", action="store_true",
                    help="steps 1-3 at the default point, step 1 alone at one more point per axis")
    ap.add_argument("--programs", default="step1,step2,step3")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default="bench_scaling.json")
    ap.add_argument("--keep", action="store_true", help="keep the rows --out already holds (an interrupted run) and "
                                                        "measure only the rest; step 3 then needs --workdir's step-2 runs")
    ap.add_argument("--png", default="bench_scaling.png")
    args = ap.parse_args()
    done = json.loads(Path(args.out).read_text())["rows"] if args.keep and Path(args.out).exists() else []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        Path(work).mkdir(parents=True, exist_ok=True)
        data = long_rows(str(HH), os.path.join(work, "long_pairs.jsonl"))
        todo = points(args.quick)
        tree = current_tree()  # checks once that the programs import this checkout's rlhfkit
        models = {"135M": args.base}
        tokenizer = AutoTokenizer.from_pretrained(args.base)  # also the 360M architecture's
        if any(p["model"] == "360M" for p in todo):
            models["360M"] = build_360m(args.base, os.path.join(work, "smollm2-360m-random"))
        for point in todo:
            chosen = args.programs.split(",")
            if args.quick and point["axis"] != "default":  # off the default point --quick runs step 1 only
                chosen = [p for p in chosen if p == "step1"]
            for program in chosen:
                kept = [r for r in done if r["program"] == program and all(r[k] == v for k, v in point.items())]
                source = step3_prompts(tokenizer, work, point["seq"] // 2) if program == "step3" else data
                rows.append(kept[0] if kept else measure(tree, program, point, models, source, work))
                print(json.dumps(rows[-1]), flush=True)
                Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print_table(rows)
    plot(rows, args.png)
    print(f"written {args.out} and {args.png}")


if __name__ == "__main__":
    sys.exit(main())
