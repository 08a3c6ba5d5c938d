"""`rlhfkit best-of-n`: does a reward model carry signal? Best-of-N sampling with it, scored by judges.

For each prompt the policy samples max(N) responses (temperature 1, top_p 1, seeded). The reward model
(the proxy) scores every response; for each N of ``--n`` the pick is the proxy's best of the prompt's
first N samples (N = 1: a plain sample; ties: the first). Each ``--judge`` (a reward model trained on
other data) scores the picks. Reported per N, over prompts: each judge's mean score of the picks with a
95% t interval, the paired gain over N = 1 with its interval, the proxy's own score of the picks, and
their mean length. A proxy that shares signal with a judge raises the judge's score as N grows; the
proxy's own score always rises, so it proves nothing on its own.

Prompts: the held-out step-3 prompts of a step-3 actor (``--held_out_of DIR``, re-created from its
manifest) or every prompt of ``--prompts DATA`` (seeded shuffle, first ``--n_prompts``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from rlhfkit.errors import ConfigError
from rlhfkit.eval_stats import mean_ci


def pick_best(proxy: Sequence[Sequence[float]], n: int) -> list[int]:
    """Per prompt, the index of the highest proxy score among its first ``n`` samples (the first on a tie)."""
    return [max(range(n), key=lambda k: (scores[k], -k)) for scores in proxy]


def best_of_n_table(proxy: Sequence[Sequence[float]], judges: dict[str, Sequence[Sequence[float]]],
                    lengths: Sequence[Sequence[int]], ns: Sequence[int]) -> list[dict]:
    """One row per N: the picks' mean proxy score and length, and per judge the picks' mean score (t interval
    over prompts) and the paired gain over N = 1. Every argument is per prompt, then per sample."""
    rows, first = [], pick_best(proxy, 1)
    for n in ns:
        picks = pick_best(proxy, n)
        row = {"n": n, "proxy": mean_ci([s[k] for s, k in zip(proxy, picks)]),
               "length": mean_ci([float(s[k]) for s, k in zip(lengths, picks)]), "judges": {}}
        for name, scores in judges.items():
            chosen = [s[k] for s, k in zip(scores, picks)]
            row["judges"][name] = {"score": mean_ci(chosen),
                                   "gain_over_n1": mean_ci([c - s[k] for c, s, k in zip(chosen, scores, first)])}
        rows.append(row)
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        parts = [f"N={r['n']:<3} proxy {r['proxy']['mean']:+.4f}  length {r['length']['mean']:5.1f}"]
        for name, j in r["judges"].items():
            g = j["gain_over_n1"]
            gain = (f"gain over N=1 {g['mean']:+.4f} [{g['ci_low']:+.4f}, {g['ci_high']:+.4f}]"
                    if g["ci_low"] is not None else "")
            parts.append(f"judge {Path(name).name}: {j['score']['mean']:+.4f} {gain}")
        out.append("  ".join(parts))
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--policy", required=True, help="the model that samples (usually the step-1 model)")
    p.add_argument("--reward_model", required=True, help="the proxy reward model that picks the best of N")
    p.add_argument("--judge", dest="judges", action="append", default=[], required=True,
                   help="a reward model that scores the picks (repeatable); train it on data the proxy never saw")
    p.add_argument("--n", default="1,4,16", help="comma-separated N values (default 1,4,16)")
    p.add_argument("--held_out_of", default=None, help="a step-3 actor dir: use its held-out prompts")
    p.add_argument("--prompts", nargs="+", default=[], help="prompt data instead of --held_out_of")
    p.add_argument("--n_prompts", type=int, default=64, help="at most this many prompts (default 64)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--max_prompt_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16, help="sequences per generation / scoring batch")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="write results.json here (a directory)")
    return p


def prompts_for(args: argparse.Namespace, tokenizer) -> tuple[list, list[dict], str]:
    from rlhfkit.checkpoint import read_manifest
    from rlhfkit.eval_prompts import given_prompt_rows, held_out_prompt_rows, take_prompts

    if bool(args.held_out_of) == bool(args.prompts):
        raise ConfigError("pass one of --held_out_of STEP3_ACTOR_DIR and --prompts DATA")
    if args.held_out_of:
        rows, _, origin = held_out_prompt_rows(args.held_out_of, read_manifest(args.held_out_of) or {}, args.n_prompts)
    else:
        rows, _, origin = given_prompt_rows(args.prompts, args.seed, args.n_prompts)
    examples, features, tok_line = take_prompts(rows, tokenizer, args.max_prompt_len, args.n_prompts)
    return examples, features, f"{origin}; {tok_line}"


def per_prompt(values: list, k: int) -> list[list]:
    return [values[i:i + k] for i in range(0, len(values), k)]


def run(args: argparse.Namespace) -> list[dict]:
    from rlhfkit.eval_models import free_memory, generate, load_lm, load_reward_model, reward_model_scores, unpack
    from rlhfkit.models import load_tokenizer
    from rlhfkit.program import silence_libraries
    from rlhfkit.rollout import GenerationConfig

    silence_libraries()
    ns = sorted({int(x) for x in str(args.n).split(",") if x.strip()})
    if not ns or ns[0] < 1:
        raise ConfigError(f"--n {args.n}: give N values >= 1, e.g. 1,4,16")
    tokenizer = load_tokenizer(args.policy, False, padding_side="left")
    _, features, origin = prompts_for(args, tokenizer)
    k, pad = ns[-1], tokenizer.pad_token_id
    print(f"prompts: {origin}\nsampling {k} responses to each of {len(features)} prompts ...", flush=True)
    model = load_lm(args.policy, "fp32", "cpu", pad, trust_remote_code=False, allow_pickle=False)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    batches = generate(model, [f for f in features for _ in range(k)], gen, args.batch_size, pad, args.seed)
    del model
    free_memory("cpu")
    scores = {}
    for path in [args.reward_model, *args.judges]:
        rm = load_reward_model(path, "fp32", "cpu", pad, trust_remote_code=False, allow_pickle=False)
        scores[path] = per_prompt(reward_model_scores(rm, batches, "cpu"), k)
        del rm
        free_memory("cpu")
    lengths = per_prompt(unpack(batches, tokenizer).tokens, k)
    rows = best_of_n_table(scores[args.reward_model], {j: scores[j] for j in args.judges}, lengths, ns)
    print("\n".join(table_lines(rows)))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps({"prompts": origin, "n_prompts": len(features), "rows": rows,
                                                                 "config": vars(args)}, indent=2, default=str) + "\n")
    return rows
