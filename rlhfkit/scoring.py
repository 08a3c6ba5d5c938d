"""Evaluate or use a reward model in one process (no DeepSpeed): `rlhfkit score`, also
`python step2_reward/evaluate.py` with the same flags.

Pairs (any supported format):
    python step2_reward/evaluate.py --model out/step2 --data_path pairs.jsonl [--split all|heldout] [--out scores.jsonl]
  --split heldout (default when no --data_path is given) re-creates the training run's held-out
  pairs from the model's manifest (data paths, split, seed, eval fraction, max_seq_len), so it prints
  the same accuracy as the training program's final evaluation.
Single responses:
    python step2_reward/evaluate.py --model out/step2 --prompt "..." --response "..."
    python step2_reward/evaluate.py --model out/step2 --responses responses.jsonl   # rows {"prompt", "response"}
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from rlhfkit.errors import ConfigError, DataError

# torch, transformers and the rest are imported where used, so `rlhfkit --help` stays fast

DESCRIPTION = "Score pairs or responses with a reward model (step 2 output)."


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="reward model directory (step 2 output)")
    p.add_argument("--data_path", nargs="+", default=None, help="pairs file(s) in any supported format")
    p.add_argument("--split", choices=["all", "heldout"], default=None,
                   help="all rows of --data_path, or the training run's held-out pairs (default: heldout without --data_path)")
    p.add_argument("--max_seq_len", type=int, default=None, help="default: the training run's")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default: the training run's")
    p.add_argument("--out", default=None, help="write per-pair (or per-response) scores as JSONL here")
    p.add_argument("--prompt", default=None, help="score one response to this prompt (with --response)")
    p.add_argument("--response", default=None)
    p.add_argument("--responses", default=None, help="JSONL of {prompt, response} rows to score")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--allow_pickle_weights", action="store_true")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(description=DESCRIPTION))


def load_reward_model(path: str, dtype: Optional[str], trust_remote_code: bool = False, allow_pickle: bool = False):
    from rlhfkit.checkpoint import check_model_dir
    from rlhfkit.models import load_model, load_tokenizer

    manifest = check_model_dir(path, expect=("reward", "critic"), role="--model")
    tokenizer = load_tokenizer(path, trust_remote_code)
    dtype = dtype or manifest.get("dtype") or "fp32"
    model = load_model(path, "reward", dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                       pad_token_id=tokenizer.pad_token_id).eval()
    return model, tokenizer, manifest


def score_responses(model, tokenizer, rows: list[dict], batch_size: int) -> list[float]:
    """Scores of (prompt, response) rows, in batches of ``batch_size`` in row order: the prompt through the
    chat template (``prompt`` a user turn, or ``messages`` a conversation), then the response + EOS.
    ``rlhfkit serve-rm`` scores with this same function."""
    import torch

    from rlhfkit.data import collate_sft, encode_prompt, encode_response
    from rlhfkit.models import sequence_scores

    feats = []
    for r in rows:
        messages = r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}]
        ids = encode_prompt(tokenizer, messages) + encode_response(tokenizer, r["response"])
        feats.append({"input_ids": ids, "labels": ids})
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(feats), batch_size):
            batch = collate_sft(feats[i:i + batch_size], tokenizer.pad_token_id)
            out += sequence_scores(model, batch["input_ids"], batch["attention_mask"]).tolist()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> None:
    from rlhfkit.data import collate_pairs, load_phase_data, tokenize_by_source, tokenize_pairs
    from rlhfkit.models import sequence_scores
    from rlhfkit.rewards import by_source, held_out_baselines, pair_metrics_by_source, score_pairs
    from rlhfkit.loaders import eval_batches

    model, tokenizer, manifest = load_reward_model(args.model, args.dtype, args.trust_remote_code, args.allow_pickle_weights)
    train_cfg = manifest.get("config", {})

    if args.prompt is not None or args.responses:
        if args.responses:
            with open(args.responses, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        elif args.response is None:
            raise ConfigError("--prompt needs --response")
        else:
            rows = [{"prompt": args.prompt, "response": args.response}]
        scores = score_responses(model, tokenizer, rows, args.batch_size)
        for r, s in zip(rows, scores):
            print(f"{s:.4f}\t{r['prompt'][:60]!r} -> {r['response'][:60]!r}")
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                for r, s in zip(rows, scores):
                    f.write(json.dumps({**r, "score": s}, ensure_ascii=False) + "\n")
        return

    split = args.split or ("all" if args.data_path else "heldout")
    data_path = args.data_path or train_cfg.get("data_path")
    if not data_path:
        raise ConfigError("--data_path is required (the model's manifest names no training data)")
    max_seq_len = args.max_seq_len or train_cfg.get("max_seq_len", 512)
    if split == "heldout":
        _, rows, _ = load_phase_data(data_path, phase=2, need="pairs", data_split=train_cfg.get("data_split", "2,4,4"),
                                     seed=train_cfg.get("seed", 1234), eval_fraction=train_cfg.get("eval_fraction", 0.1),
                                     max_eval=train_cfg.get("max_eval_samples"), max_per_prompt=train_cfg.get("max_per_prompt"))
    else:
        rows, extra, _ = load_phase_data(data_path, phase=1, need="pairs", data_split="1,0,0", eval_fraction=0.0)
        rows = rows + extra
    feats, report = tokenize_by_source(tokenize_pairs, rows, tokenizer, max_seq_len)
    if not feats:
        raise DataError(f"no usable pairs in {data_path}: {report.summary()}")
    chosen, rejected, c_len, r_len = score_pairs(lambda ids, mask: sequence_scores(model, ids, mask),
                                   eval_batches(feats, lambda r: collate_pairs(r, tokenizer.pad_token_id), args.batch_size))
    m = pair_metrics_by_source(chosen, rejected, c_len, r_len, [f["source"] for f in feats])
    print(f"pairs {m['pairs']} ({split})  accuracy {m['accuracy']:.4f}  chosen {m['chosen_score']:.4f}  "
          f"rejected {m['rejected_score']:.4f}  margin {m['margin']:.4f}")
    for tag, v in by_source(m).items():
        print(f"  {tag}: pairs {v['pairs']}  accuracy {v['accuracy']:.4f}  {held_out_baselines(v)}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for c, r in zip(chosen.tolist(), rejected.tolist()):
                f.write(json.dumps({"chosen_score": c, "rejected_score": r, "margin": c - r}) + "\n")
