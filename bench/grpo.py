"""GRPO step throughput on one rank, for comparison with TRL's GRPOTrainer on this machine type.

    python bench/grpo.py --model BASE_OR_SFT_DIR [--steps 4] [--out bench_grpo.json]

Settings of the reference (TRL GRPOTrainer: one process, 2 threads, bf16, SmolLM2-135M, GSM8K
prompts, 1 prompt x 4 samples a step, 64 new tokens): ~11.7 s a step, 0.34 completions/s. Runs
step3_ppo/main.py for real with --algo grpo --reward_fn gsm8k on ../shared/data/gsm8k, every
completion forced to 64 tokens (--min_new_tokens 64: at least the reference's work), and reports the
steady-state seconds per step and completions/s (first step left out). A figure, never an assertion.

With --trl (needs `pip install trl`; not a dependency of rlhfkit) TRL's GRPOTrainer runs at the same
settings in the same minutes (bench/trl_grpo_baseline.py) and the ratio is taken against it too.
With --rounds R everything runs R times in turn (rlhfkit, variants, TRL, then again), so that a
drift of the machine's speed within the run (these VMs change by 1.5x within minutes) falls on
both sides; each round's ratio is printed and the table holds the means over rounds.
With --variant NAME=ARGS rlhfkit also runs with those extra step-3 arguments, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / ".." / "shared" / "data" / "gsm8k" / "test_first1000.jsonl"
TRL = {"step_s": 11.7, "completions_per_s": 0.34}


def run(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default=str(GSM8K))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer at the same settings")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also run rlhfkit with these extra step-3 arguments, e.g. 'unpacked=--pack_groups false'; "
                         "leading VAR=VALUE words set its environment, e.g. 'fp32=RLHFKIT_CPU_BF16_MATMUL=fp32'")
    ap.add_argument("--rounds", type=int, default=1, help="run everything this many times in turn; means over rounds")
    ap.add_argument("--out", default="bench_grpo.json")
    args = ap.parse_args()
    variants = {"rlhfkit": []}
    for v in args.variant:
        name, _, extra = v.partition("=")
        variants[name] = extra.split()
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 2), "PYTHONUNBUFFERED": "1"}
        for r in range(args.rounds):
            got = {name: run_rlhfkit(args, extra, os.path.join(work, f"{name}-{r}"), env) for name, extra in variants.items()}
            if args.trl:
                out = os.path.join(work, f"trl-{r}.json")
                cmd = [sys.executable, str(REPO / "bench/trl_grpo_baseline.py"), "--model", args.model, "--data", args.data,
                       "--steps", str(args.steps), "--samples", str(args.samples), "--new_tokens", str(args.new_tokens), "--out", out]
                run(cmd, env)
                got["TRL"] = json.load(open(out))
                print(f"round {r + 1}: rlhfkit {got['rlhfkit']['step_s']:.2f} s/step, TRL {got['TRL']['step_s']:.2f} s/step: "
                      f"{got['TRL']['step_s'] / got['rlhfkit']['step_s']:.2f}x", flush=True)
            rounds.append(got)
    results = {name: mean_result([g[name] for g in rounds]) for name in variants}
    trl = mean_result([g["TRL"] for g in rounds]) if args.trl else None
    print(f"\nGRPO, one rank, {os.cpu_count()} threads, bf16, 1 prompt x {args.samples} samples, {args.new_tokens} new tokens")
    print(f"{'':<16}{'s/step':>8}{'completions/s':>15}   split (gen / exp / train s)")
    for name, r in results.items():
        split = r["split_s"]
        print(f"{name:<16}{r['step_s']:>8.2f}{r['completions_per_s']:>15.3f}   "
              f"{split['generation']:.2f} / {split['experience']:.2f} / {split['training']:.2f}   {' '.join(variants[name])}")
    if trl is not None:
        print(f"{'TRL ' + trl['trl_version']:<16}{trl['step_s']:>8.2f}{trl['completions_per_s']:>15.3f}   (same run, beta {trl['beta']})")
    print(f"{'TRL (ref.)':<16}{TRL['step_s']:>8.2f}{TRL['completions_per_s']:>15.3f}   (fixed reference)")
    main_result = results["rlhfkit"]
    for name, r in results.items():
        if name != "rlhfkit":
            print(f"rlhfkit / {name}, completions/s: {main_result['completions_per_s'] / r['completions_per_s']:.2f}x")
    if trl is not None:
        print(f"rlhfkit / TRL same run, completions/s: {main_result['completions_per_s'] / trl['completions_per_s']:.2f}x (target >= 2x)")
    print(f"rlhfkit / TRL fixed reference, completions/s: {main_result['completions_per_s'] / TRL['completions_per_s']:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"rlhfkit": main_result, "variants": results, "trl_reference": TRL, "trl_same_run": trl, "rounds": rounds}, f,
                  indent=2)


def mean_result(runs: list[dict]) -> dict:
    """The mean over rounds of one configuration's figures (the first round's other fields)."""
    out = dict(runs[0])
    for key in ("step_s", "completions_per_s"):
        out[key] = sum(r[key] for r in runs) / len(runs)
    if "split_s" in out:
        out["split_s"] = {k: sum(r["split_s"][k] for r in runs) / len(runs) for k in out["split_s"]}
    return out


def run_rlhfkit(args, extra: list[str], out_dir: str, env: dict) -> dict:
    """step3_ppo/main.py --algo grpo on one rank -> steady-state seconds per step (first step left out).
    ``extra``: VAR=VALUE words for the environment, then step-3 arguments."""
    n_env = next((i for i, w in enumerate(extra) if w.startswith("-") or "=" not in w), len(extra))
    env = {**env, **dict(w.split("=", 1) for w in extra[:n_env])}
    extra = extra[n_env:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port", str(port),
           str(REPO / "step3_ppo/main.py"), "--algo", "grpo", "--reward_fn", "gsm8k", "--actor_model_name_or_path", args.model,
           "--data_path", args.data, "--data_split", "0,0,1", "--n_samples_per_prompt", str(args.samples),
           "--per_device_generation_batch_size", "1", "--per_device_training_batch_size", str(args.samples),
           "--max_prompt_seq_len", "256", "--max_answer_seq_len", str(args.new_tokens), "--min_new_tokens", str(args.new_tokens),
           "--dtype", "bf16", "--actor_zero_stage", "0", "--max_steps", str(args.steps), "--eval_fraction", "0.001",
           "--max_eval_samples", "1", "--output_dir", out_dir, "--progress_bar", "false", *extra]
    run(cmd, env)
    rows = [json.loads(x) for x in open(os.path.join(out_dir, "logs", "metrics.jsonl")) if "time/step_s" in x]
    timed = rows[1:] or rows
    step_s = sum(r["time/step_s"] for r in timed) / len(timed)
    split = {k: sum(r[f"time/{k}_s"] for r in timed) / len(timed) for k in ("generation", "experience", "training")}
    return {"step_s": step_s, "completions_per_s": args.samples / step_s, "split_s": split, "steps_timed": len(timed),
            "reward_mean": [r["reward/score_mean"] for r in rows]}


if __name__ == "__main__":
    main()
