"""``rlhfkit plan`` against measured memory: real CPU runs of steps 1-3 on the default model, ZeRO-0 and
ZeRO-3, 1 and 2 ranks, each ranks' peak resident memory minus its resident memory right after imports
(``RLHFKIT_REPORT_MEMORY=1``; freed-memory caching as the programs run by default), next to the planner's
prediction for the same settings.

    python bench/plan_check.py --base BASE_DIR --sft RUN/step1 --rm RUN/step2 [--out plan_check.json]
    python bench/plan_check.py --measured plan_check.json      # predictions only, from saved measurements

The planner's few fitted constants come from the rows marked "fit" (rlhfkit/plan.py says which); every other
row is a check. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
SETTINGS = {  # the batch and length flags of every run (the planner takes the same)
    "step1": {"per_device_train_batch_size": 4, "max_seq_len": 256},
    "step2": {"per_device_train_batch_size": 2, "max_seq_len": 256},
    "step3": {"per_device_generation_batch_size": 2, "per_device_training_batch_size": 2, "max_prompt_seq_len": 128,
              "max_answer_seq_len": 64},
}
PROGRAMS = {"step1": "step1_sft/main.py", "step2": "step2_reward/main.py", "step3": "step3_ppo/main.py"}
CASES = [(p, r, z) for p in ("step1", "step2", "step3") for r in (1, 2) for z in (0, 3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def program_args(program: str, zero: int, args, out: str) -> list[str]:
    flags = [f"--{k}={v}" for k, v in SETTINGS[program].items()]
    common = ["--data_path", str(args.data), "--output_dir", out, "--dtype", "bf16", "--progress_bar", "false"]
    if program == "step3":
        return [*flags, *common, "--actor_model_name_or_path", args.sft, "--critic_model_name_or_path", args.rm,
                "--actor_zero_stage", str(zero), "--critic_zero_stage", str(zero), "--max_steps", "2", "--eval_fraction", "0",
                "--min_new_tokens", str(SETTINGS["step3"]["max_answer_seq_len"])]
    model = args.base if program == "step1" else args.sft
    return [*flags, *common, "--model_name_or_path", model, "--zero_stage", str(zero), "--max_steps", "3",
            "--max_eval_samples", "2"]


def long_rows(path: str, tokenizer_dir: str, out: str, least: int = 300) -> str:
    """The pairs of ``path`` whose two sides are both longer than ``least`` tokens, as JSONL in ``out``: every batch
    then fills --max_seq_len (the planner's figure is for full-length batches)."""
    import gzip

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(line) for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
    keep = [r for r in rows if min(len(tok(r["chosen"]).input_ids), len(tok(r["rejected"]).input_ids)) > least]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in keep))
    return out


def measure(program: str, ranks: int, zero: int, args) -> dict:
    out = os.path.join(args.workdir, f"{program}-r{ranks}-z{zero}")
    threads = str(max(1, (os.cpu_count() or 2) // ranks))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "RLHFKIT_REPORT_MEMORY": "1"}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
           str(REPO / PROGRAMS[program]), *program_args(program, zero, args, out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    found = re.findall(r"\[memory\] rank (\d+): peak ([\d.]+) GiB, after imports ([\d.]+) GiB", proc.stdout)
    if proc.returncode != 0 or len(found) != ranks:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"program": program, "ranks": ranks, "zero_stage": zero,
            "measured_gib": max(float(peak) - float(base) for _, peak, base in found),
            "imports_gib": max(float(base) for _, _, base in found)}


def predict(row: dict, args) -> float:
    from rlhfkit.plan import PlanSettings, plan

    model = args.base if row["program"] != "step3" else args.sft
    s = PlanSettings(program=row["program"], world_size=row["ranks"], zero_stage=row["zero_stage"], dtype="bf16", device="cpu",
                     **SETTINGS[row["program"]])
    return plan(model, s, critic=args.rm if row["program"] == "step3" else None).host_total_gib


def fit_constants(rows: list[dict], args) -> tuple[float, float]:
    """rlhfkit.plan's fitted constants from the FIT_CASES rows: the runtime constant from step 1 on 1 rank, ZeRO-0,
    then the CPU collective bytes per gathered parameter from step 1 on 2 ranks, ZeRO-3."""
    import rlhfkit.plan as P

    saved = P.RUNTIME_GIB, P.CPU_COLLECTIVE_BYTES
    P.RUNTIME_GIB, P.CPU_COLLECTIVE_BYTES = 0.0, 0.0
    try:
        by_case = {(r["program"], r["ranks"], r["zero_stage"]): r for r in rows}
        one, two = by_case[("step1", 1, 0)], by_case[("step1", 2, 3)]
        runtime = one["measured_gib"] - predict(one, args)
        live = P.load_arch(args.base).params(lm_head=True)
        collective = (two["measured_gib"] - predict(two, args) - runtime) * P.GIB / live
    finally:
        P.RUNTIME_GIB, P.CPU_COLLECTIVE_BYTES = saved
    return runtime, collective


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the default model's base checkpoint (rlhfkit prepare-base)")
    ap.add_argument("--sft", help="a step-1 checkpoint of it (step 2 and the step-3 actor start here)")
    ap.add_argument("--rm", help="a step-2 reward model (the step-3 critic and reward model)")
    ap.add_argument("--data", default=str(HH))
    ap.add_argument("--workdir", default="/tmp/plan_check")
    ap.add_argument("--measured", help="read measurements from this JSON instead of running")
    ap.add_argument("--out", default="plan_check.json")
    ap.add_argument("--fit", action="store_true", help="print the constants the FIT_CASES rows give (rlhfkit/plan.py holds them)")
    args = ap.parse_args()
    if args.measured:
        rows = json.load(open(args.measured))["rows"]
    else:
        args.data = long_rows(str(args.data), args.base, os.path.join(args.workdir, "long_pairs.jsonl"))
        rows = []
        for program, ranks, zero in CASES:
            rows.append(measure(program, ranks, zero, args))
            print(json.dumps(rows[-1]), flush=True)
            json.dump({"rows": rows}, open(args.out, "w"), indent=1)
    from rlhfkit.plan import FIT_CASES

    if args.fit:
        runtime, collective = fit_constants(rows, args)
        print(f"fitted: RUNTIME_GIB = {runtime:.3f}, CPU_COLLECTIVE_BYTES = {collective:.2f}")

    print(f"{'program':8} {'ranks':>5} {'ZeRO':>4} {'measured GiB':>12} {'planned GiB':>11} {'planned/measured':>16}  role")
    for row in rows:
        row["planned_gib"] = predict(row, args)
        row["ratio"] = row["planned_gib"] / row["measured_gib"]
        role = "fit" if (row["program"], row["ranks"], row["zero_stage"]) in FIT_CASES else "check"
        row["role"] = role
        print(f"{row['program']:8} {row['ranks']:5d} {row['zero_stage']:4d} {row['measured_gib']:12.2f} {row['planned_gib']:11.2f} "
              f"{row['ratio']:16.2f}  {role}")
    json.dump({"rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
