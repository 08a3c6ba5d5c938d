"""A PPO step with the `hf` rollout engine against the naive `hf-synced` one, side by side in one run.

    python bench/step3.py --actor RUN/step1 --critic RUN/step2 [--steps 3] [--out bench_step3.json]

Runs step3_ppo/main.py for real: 2 ranks, actor and critic ZeRO-3, bf16, --max_prompt_seq_len 128
--max_answer_seq_len 64, 2 prompts per rank, every response forced to 64 tokens (--min_new_tokens 64,
so both backends do the same work). Reports seconds per step, samples/s, the per-phase split
(generation, experience forward passes, training) and peak memory per rank, leaving out the first
(warm-up) step. Figures, never assertions.
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
HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
REFERENCE = {"name": "DeepSpeed-Chat (reference)", "step_s": 60.0, "generation_s": 41.0, "experience_s": 6.6, "training_s": 12.4,
             "peak_gb": 5.8}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VARIANTS = {  # name -> (rollout backend, extra flags)
    "hf": ("hf", []),
    "hf-synced": ("hf-synced", []),
    "hf-engine-experience": ("hf", ["--experience_on_copies", "false"]),
    "hf-no-block-leaves": ("hf", ["--zero3_block_leaves", "false"]),
}


def run(name: str, args, work: str) -> dict:
    backend, extra = VARIANTS[name]
    out = os.path.join(work, name)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)), "PYTHONUNBUFFERED": "1"}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "step3_ppo/main.py"), "--actor_model_name_or_path", args.actor, "--critic_model_name_or_path", args.critic,
           "--data_path", args.data, "--output_dir", out, "--rollout_backend", backend, "--actor_zero_stage", "3",
           "--critic_zero_stage", "3", "--dtype", "bf16", "--max_prompt_seq_len", "128", "--max_answer_seq_len", str(args.answer),
           "--min_new_tokens", str(args.answer), "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
           "--max_steps", str(args.steps), "--eval_fraction", "0.01", "--max_eval_samples", "1",
           "--progress_bar", "false", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "logs", "metrics.jsonl")) if "time/step_s" in x]
    timed = rows[1:] or rows
    mean = lambda k: sum(r[k] for r in timed) / len(timed)  # noqa: E731
    return {"name": name, "steps_timed": len(timed), "step_s": mean("time/step_s"), "generation_s": mean("time/generation_s"),
            "experience_s": mean("time/experience_s"), "training_s": mean("time/training_s"),
            "samples_per_s": mean("perf/samples_per_s"), "gen_tokens_per_s": mean("perf/gen_tokens_per_s"),
            "peak_gb": max(r["mem/peak_rss_gb"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actor", required=True, help="step-1 (SFT) checkpoint of the default model")
    ap.add_argument("--critic", required=True, help="step-2 reward model checkpoint")
    ap.add_argument("--data", default=str(HH))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--backends", default="hf,hf-synced",
                    help=f"comma-separated runs, each one of: {', '.join(VARIANTS)} (hf-engine-experience: step 3's "
                         "experience passes through the ZeRO-3 engines instead of gathered copies; hf-no-block-leaves: ZeRO-3 "
                         "hooks every linear layer, not each transformer block)")
    ap.add_argument("--out", default="bench_step3.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        results = [run(n.strip(), args, work) for n in args.backends.split(",")]
    rows = results + [REFERENCE]
    print(f"\nPPO step, 2 ranks, actor+critic ZeRO-3, bf16, prompt<=128, answer={args.answer}, 2 prompts/rank")
    print(f"{'':<28}{'s/step':>8}{'gen s':>8}{'exp s':>8}{'train s':>9}{'samples/s':>11}{'peak GiB/rank':>15}")
    for r in rows:
        sps = r.get("samples_per_s", 4 / r["step_s"])
        print(f"{r['name']:<28}{r['step_s']:>8.1f}{r['generation_s']:>8.1f}{r['experience_s']:>8.1f}{r['training_s']:>9.1f}"
              f"{sps:>11.3f}{r['peak_gb']:>15.2f}")
    by = {r["name"]: r for r in results}
    if "hf" in by:
        for other in [r for r in rows if r["name"] != "hf"]:
            print(f"hf speed-up over {other['name']}: {other['step_s'] / by['hf']['step_s']:.2f}x per step, "
                  f"{other['generation_s'] / by['hf']['generation_s']:.2f}x generation")
    with open(args.out, "w") as f:
        json.dump({"results": results, "reference": REFERENCE, "answer_tokens": args.answer}, f, indent=2)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
