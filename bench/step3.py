"""A PPO step with the `hf` rollout engine against the naive `hf-synced` one, side by side in one run.

    python bench/step3.py --actor RUN/step1 --critic RUN/step2 [--steps 3] [--out bench_step3.json]
    python bench/step3.py --actor RUN/step1 --critic RUN/step2 --against 5f6227d [--rounds 3]

Runs step3_ppo/main.py for real: 2 ranks, actor and critic ZeRO-3, bf16, --max_prompt_seq_len 128
--max_answer_seq_len 64, 2 prompts per rank, every prompt exactly 128 tokens (hh-rlhf text cut to length,
bench/workloads.py; unless --data is given) and every response forced to 64 tokens (--min_new_tokens 64),
so every backend and revision does the same work whichever prompts it draws. Reports seconds per
step, samples/s, the per-phase split (generation, experience forward passes, training) and peak
memory per rank, leaving out the first (warm-up) step. Figures, never assertions.

Every step-3 flag is on the command line (bench/pinned_flags.py), so a changed default never counts as
speed. With --against REV the same runs also use REV's code from a git worktree (bench/revisions.py),
alternating with the current code for --rounds rounds, and the table gives each side's median and
spread over rounds and the ratio current/REV of the medians. A flag that one tree lacks is passed to
neither (listed in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from pinned_flags import STEP3, STEP3_UNSET
from workloads import exact_length_prompts
from revisions import (
    REPO, current_tree, flag_value, pin_report, pinned_args, print_against, program_options, revision_tree, run_program, side_order,
    summarize, tree_env,
)

HH = REPO / ".." / "shared" / "data" / "hh-rlhf-harmless-base" / "pairs.jsonl.gz"
REFERENCE = {"name": "DeepSpeed-Chat (reference)", "step_s": 60.0, "generation_s": 41.0, "experience_s": 6.6, "training_s": 12.4,
             "peak_gb": 5.8}
SCRIPT = "step3_ppo/main.py"
PROMPT_TOKENS = 128
LOGGED = {"step_s": "time/step_s", "generation_s": "time/generation_s", "experience_s": "time/experience_s",
          "training_s": "time/training_s", "samples_per_s": "perf/samples_per_s", "gen_tokens_per_s": "perf/gen_tokens_per_s"}
METRICS = ("step_s", "generation_s", "experience_s", "training_s", "peak_gb")

VARIANTS = {  # name -> flags over the bench's own
    "hf": {"rollout_backend": "hf"},
    "hf-synced": {"rollout_backend": "hf-synced"},
    "hf-engine-experience": {"rollout_backend": "hf", "experience_on_copies": False},
    "hf-no-block-leaves": {"rollout_backend": "hf", "zero3_block_leaves": False},
    "hf-compiled": {"rollout_backend": "hf"},
}
# Flags of a variant passed only to a tree that has them (newer than the base revisions): a revision without
# the flag runs its own code, eager, in that variant's slot.
NEWER_FLAGS = {"hf-compiled": {"compile_blocks": True}}


def bench_flags(args, variant: str) -> dict:
    """Every pinned step-3 flag at this bench's settings, for one variant."""
    return {**STEP3, "actor_zero_stage": 3, "critic_zero_stage": 3, "dtype": "bf16", "max_prompt_seq_len": PROMPT_TOKENS,
            "max_answer_seq_len": args.answer, "min_new_tokens": args.answer, "per_device_generation_batch_size": 2,
            "per_device_training_batch_size": 2, "eval_fraction": 0.01, "max_eval_samples": 1, **VARIANTS[variant]}


def run(tree, name: str, args, out: str, options: dict[str, dict]) -> dict:
    """One step-3 run of ``tree``'s code -> its figures (means over the timed steps)."""
    pinned, _ = pinned_args(bench_flags(args, name), *options.values())
    pinned += [a for dest, value in NEWER_FLAGS.get(name, {}).items() if dest in options[tree.name]
               for a in (f"--{dest}", *flag_value(value))]
    argv = [*pinned, "--actor_model_name_or_path", args.actor, "--critic_model_name_or_path", args.critic,
            "--data_path", args.data, "--output_dir", out, "--max_steps", str(args.steps)]
    run_program(tree, SCRIPT, argv, nprocs=2, env=tree_env(tree, threads=max(1, (os.cpu_count() or 2) // 2)))
    return {"name": name, **step_figures(out)}


def step_figures(out: str) -> dict:
    """A step-3 run's figures from its metrics log: means over the timed steps (the first, a warm-up, left
    out), their count, and the peak memory of any step."""
    rows = [json.loads(x) for x in Path(out, "logs", "metrics.jsonl").read_text().splitlines() if "time/step_s" in x]
    timed = rows[1:] or rows
    figures = {field: sum(r[key] for r in timed) / len(timed) for field, key in LOGGED.items()}
    return {"steps_timed": len(timed), **figures, "peak_gb": max(r["mem/peak_rss_gb"] for r in rows)}


def print_plain(results: list[dict], answer: int) -> None:
    rows = results + [REFERENCE]
    print(f"\nPPO step, 2 ranks, actor+critic ZeRO-3, bf16, prompt<=128, answer={answer}, 2 prompts/rank")
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


def mean_over_rounds(runs: list[dict], name: str) -> dict:
    mine = [r for r in runs if r["name"] == name]
    out = dict(mine[0])
    for k in ("step_s", "generation_s", "experience_s", "training_s", "samples_per_s", "gen_tokens_per_s"):
        out[k] = sum(r[k] for r in mine) / len(mine)
    out["peak_gb"] = max(r["peak_gb"] for r in mine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actor", required=True, help="step-1 (SFT) checkpoint of the default model")
    ap.add_argument("--critic", required=True, help="step-2 reward model checkpoint")
    ap.add_argument("--data", help="prompt data (default: hh-rlhf conversations cut to exactly 128 prompt tokens)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--backends", default="hf,hf-synced",
                    help=f"comma-separated runs, each one of: {', '.join(VARIANTS)} (hf-engine-experience: step 3's "
                         "experience passes through the ZeRO-3 engines instead of gathered copies; hf-no-block-leaves: ZeRO-3 "
                         "hooks every linear layer, not each transformer block; hf-compiled: --compile_blocks true where "
                         "the tree has the flag)")
    ap.add_argument("--against", metavar="REV", help="also run this git revision's code (a worktree under .cache/against), "
                                                     "alternating with the current code")
    ap.add_argument("--current", metavar="DIR", help="the checkout that runs as 'current' (default: this one)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of every backend (and side); default 3 with --against, else 1")
    ap.add_argument("--out", default="bench_step3.json")
    args = ap.parse_args()
    args.actor, args.critic = os.path.abspath(args.actor), os.path.abspath(args.critic)  # runs in a tree's root
    rounds = args.rounds or (3 if args.against else 1)
    names = [n.strip() for n in args.backends.split(",")]
    trees = ([revision_tree(args.against)] if args.against else []) + [current_tree(args.current)]
    options = {t.name: program_options(t, SCRIPT) for t in trees}
    report = pin_report(bench_flags(args, names[0]), STEP3_UNSET, options)
    print("\n".join(report) or "every option of every tree is pinned or knowingly unset")
    runs = []
    with tempfile.TemporaryDirectory() as work:
        args.data = os.path.abspath(args.data) if args.data else exact_length_prompts(
            str(HH), AutoTokenizer.from_pretrained(args.actor), os.path.join(work, "prompts.jsonl"), rows=64 + 12 * args.steps,
            length=PROMPT_TOKENS)
        for rnd in range(rounds):
            for name in names:
                for tree in side_order(trees, rnd):
                    got = run(tree, name, args, os.path.join(work, f"{tree.name}-{name}-{rnd}"), options)
                    runs.append({"round": rnd, "config": name, "side": tree.name, **got})
                    print(f"round {rnd + 1} {name} [{tree.name}]: {got['step_s']:.2f} s/step", flush=True)
    pinned, dropped = pinned_args(bench_flags(args, names[0]), *options.values())
    record = {"answer_tokens": args.answer, "pinned_argv": pinned, "dropped_flags": dropped, "pin_report": report, "runs": runs}
    if args.against:
        rev = trees[0].name
        summary = summarize(runs, METRICS, rev)
        print(f"\nPPO step, 2 ranks, actor+critic ZeRO-3, bf16, prompt<=128, answer={args.answer}, 2 prompts/rank, "
              f"{rounds} rounds alternated, current vs {rev}" + (f" ({args.against})" if args.against != rev else ""))
        print_against(runs, summary, METRICS, rev)
        record.update(against=args.against, against_sha=rev, summary=summary)
    else:
        results = [mean_over_rounds(runs, n) for n in names]
        print_plain(results, args.answer)
        record.update(results=results, reference=REFERENCE)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
