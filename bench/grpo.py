"""GRPO step throughput on one rank, for comparison with TRL's GRPOTrainer on this machine type.

    python bench/grpo.py --model BASE_OR_SFT_DIR [--steps 4] [--out bench_grpo.json]
    python bench/grpo.py --model BASE_OR_SFT_DIR --against 5f6227d [--rounds 3]

Settings of the reference (TRL GRPOTrainer: one process, 2 threads, bf16, SmolLM2-135M, GSM8K
prompts, 1 prompt x 4 samples a step, 64 new tokens): ~11.7 s a step, 0.34 completions/s. Runs
step3_ppo/main.py for real with --algo grpo --reward_fn gsm8k on ../shared/data/gsm8k, every
completion forced to 64 tokens (--min_new_tokens 64: at least the reference's work), and reports the
steady-state seconds per step and completions/s (first step left out). A figure, never an assertion.
Every step-3 flag is on the command line (bench/pinned_flags.py), so a changed default never counts.

With --trl (needs `pip install trl`; not a dependency of rlhfkit) TRL's GRPOTrainer runs at the same
settings in the same minutes (bench/trl_grpo_baseline.py) and the ratio is taken against it too.
With --rounds R everything runs R times in turn (rlhfkit, variants, TRL, then again), so that a
drift of the machine's speed within the run (these VMs change by 1.5x within minutes) falls on
both sides; each round's ratio is printed and the table holds the means over rounds.
With --variant NAME=ARGS rlhfkit also runs with those extra step-3 arguments, in the same run.
With --against REV every rlhfkit run also runs REV's code from a git worktree (bench/revisions.py),
alternating with the current code (3 rounds unless --rounds), and the table gives each side's median
and spread over rounds and the ratio current/REV of the medians (variants' extra arguments go to both).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pinned_flags import STEP3, STEP3_UNSET
from revisions import (
    REPO, current_tree, pin_report, pinned_args, print_against, program_options, revision_tree, run_program, side_order,
    summarize, tree_env,
)

GSM8K = REPO / ".." / "shared" / "data" / "gsm8k" / "test_first1000.jsonl"
TRL = {"step_s": 11.7, "completions_per_s": 0.34}
SCRIPT = "step3_ppo/main.py"
METRICS = ("step_s", "generation_s", "experience_s", "training_s")


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--against", metavar="REV", help="also run this git revision's code (a worktree under .cache/against), "
                                                     "alternating with the current code")
    ap.add_argument("--current", metavar="DIR", help="the checkout that runs as 'current' (default: this one)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run everything this many times in turn (default 3 with --against, else 1)")
    ap.add_argument("--out", default="bench_grpo.json")
    args = ap.parse_args()
    args.rounds = args.rounds or (3 if args.against else 1)
    args.model, args.data = os.path.abspath(args.model), os.path.abspath(args.data)  # the programs run in a tree's root
    return args


def bench_flags(args) -> dict:
    """Every pinned step-3 flag at this bench's settings."""
    return {**STEP3, "algo": "grpo", "data_split": "0,0,1", "n_samples_per_prompt": args.samples,
            "per_device_generation_batch_size": 1, "per_device_training_batch_size": args.samples, "max_prompt_seq_len": 256,
            "max_answer_seq_len": args.new_tokens, "min_new_tokens": args.new_tokens, "dtype": "bf16", "actor_zero_stage": 0,
            "eval_fraction": 0.001, "max_eval_samples": 1}


def main() -> None:
    args = parse_args()
    variants = {"rlhfkit": []}
    for v in args.variant:
        name, _, extra = v.partition("=")
        variants[name] = extra.split()
    trees = ([revision_tree(args.against)] if args.against else []) + [current_tree(args.current)]
    options = {t.name: program_options(t, SCRIPT) for t in trees}
    report = pin_report(bench_flags(args), STEP3_UNSET, options)
    print("\n".join(report) or "every option of every tree is pinned or knowingly unset")
    pinned, dropped = pinned_args(bench_flags(args), *options.values())
    runs: list[dict] = []
    trl_rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        env = {"OMP_NUM_THREADS": str(os.cpu_count() or 2), "MKL_NUM_THREADS": str(os.cpu_count() or 2)}
        for r in range(args.rounds):
            for name, extra in variants.items():
                for tree in side_order(trees, r):
                    got = run_rlhfkit(tree, args, pinned, extra, os.path.join(work, f"{tree.name}-{name}-{r}"), env)
                    runs.append({"round": r, "config": name, "side": tree.name, **got})
                    print(f"round {r + 1} {name} [{tree.name}]: {got['step_s']:.2f} s/step", flush=True)
            if args.trl:
                trl_rounds.append(run_trl(args, os.path.join(work, f"trl-{r}.json"), env))
                mine = next(x for x in runs if x["round"] == r and x["config"] == "rlhfkit" and x["side"] == "current")
                print(f"round {r + 1}: rlhfkit {mine['step_s']:.2f} s/step, TRL {trl_rounds[-1]['step_s']:.2f} s/step: "
                      f"{trl_rounds[-1]['step_s'] / mine['step_s']:.2f}x", flush=True)
    record = {"pinned_argv": pinned, "dropped_flags": dropped, "pin_report": report, "runs": runs}
    current = [x for x in runs if x["side"] == "current"]
    results = {name: mean_result([x for x in current if x["config"] == name]) for name in variants}
    trl = mean_result(trl_rounds) if args.trl else None
    print_plain(args, results, variants, trl)
    record.update(rlhfkit=results["rlhfkit"], variants=results, trl_reference=TRL, trl_same_run=trl, trl_rounds=trl_rounds)
    if args.against:
        rev = trees[0].name
        summary = summarize(runs, METRICS, rev)
        print(f"\nGRPO, current vs {rev}" + (f" ({args.against})" if args.against != rev else "") + f", {args.rounds} rounds alternated")
        print_against(runs, summary, METRICS, rev)
        record.update(against=args.against, against_sha=rev, summary=summary)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"written {args.out}")


def print_plain(args, results: dict, variants: dict, trl: dict | None) -> None:
    print(f"\nGRPO, one rank, {os.cpu_count()} threads, bf16, 1 prompt x {args.samples} samples, {args.new_tokens} new tokens"
          f" (current code, means over {args.rounds} round(s))")
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
        print(f"rlhfkit / TRL same run, completions/s: {main_result['completions_per_s'] / trl['completions_per_s']:.2f}x (target >= 3x)")
    print(f"rlhfkit / TRL fixed reference, completions/s: {main_result['completions_per_s'] / TRL['completions_per_s']:.2f}x")


def mean_result(runs: list[dict]) -> dict:
    """The mean over rounds of one configuration's figures (the first round's other fields)."""
    out = dict(runs[0])
    for key in ("step_s", "completions_per_s", *METRICS):
        if key in out:
            out[key] = sum(r[key] for r in runs) / len(runs)
    if "split_s" in out:
        out["split_s"] = {k: sum(r["split_s"][k] for r in runs) / len(runs) for k in out["split_s"]}
    return out


def run_trl(args, out: str, env: dict) -> dict:
    """TRL's GRPOTrainer at the same settings (bench/trl_grpo_baseline.py) -> its figures."""
    cmd = [sys.executable, str(REPO / "bench/trl_grpo_baseline.py"), "--model", args.model, "--data", args.data,
           "--steps", str(args.steps), "--samples", str(args.samples), "--new_tokens", str(args.new_tokens), "--out", out]
    proc = subprocess.run(cmd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def run_rlhfkit(tree, args, pinned: list[str], extra: list[str], out_dir: str, env: dict) -> dict:
    """``tree``'s step3_ppo/main.py --algo grpo on one rank -> steady-state seconds per step (first step left out).
    ``pinned``: the pinned flags; ``extra``: a variant's VAR=VALUE words for the environment, then its step-3 arguments."""
    n_env = next((i for i, w in enumerate(extra) if w.startswith("-") or "=" not in w), len(extra))
    env = {**env, **dict(w.split("=", 1) for w in extra[:n_env])}
    cmd = [*pinned, "--reward_fn", "gsm8k", "--actor_model_name_or_path", args.model, "--data_path", args.data,
           "--max_steps", str(args.steps), "--output_dir", out_dir, *extra[n_env:]]
    run_program(tree, SCRIPT, cmd, nprocs=1, env=tree_env(tree, extra=env))
    rows = [json.loads(x) for x in Path(out_dir, "logs", "metrics.jsonl").read_text().splitlines() if "time/step_s" in x]
    timed = rows[1:] or rows
    step_s = sum(r["time/step_s"] for r in timed) / len(timed)
    split = {k: sum(r[f"time/{k}_s"] for r in timed) / len(timed) for k in ("generation", "experience", "training")}
    return {"step_s": step_s, "completions_per_s": args.samples / step_s, "split_s": split, "steps_timed": len(timed),
            **{f"{k}_s": v for k, v in split.items()}, "reward_mean": [r["reward/score_mean"] for r in rows]}


if __name__ == "__main__":
    main()
