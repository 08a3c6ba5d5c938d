"""The hf backend's sampling loop against transformers' ``generate``, alternated in one run.

    python bench/sampling.py --model DIR [--prompts 6] [--samples 4] [--new_tokens 64] [--dtype bf16]

One process, the machine's threads. Each GSM8K prompt (chat template) is sampled ``--samples`` times
in one batch (a GRPO group), every response forced to ``--new_tokens`` tokens (min_new_tokens), at
temperature 1. For each prompt, ``generate(do_sample=True)`` and ``rlhfkit.rollout.sampling.decode``
run back to back (order alternating), so both see the same machine speed. Prints seconds per batch
and the ratio; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlhfkit.models import load_model, load_tokenizer  # noqa: E402
from rlhfkit.rollout import GenerationConfig, PromptBatch  # noqa: E402
from rlhfkit.rollout.sampling import hf_generate  # noqa: E402

GSM8K = REPO / ".." / "shared" / "data" / "gsm8k" / "test_first1000.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default=str(GSM8K))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    tok = load_tokenizer(args.model, padding_side="left")
    model = load_model(args.model, "causal_lm", dtype=args.dtype, pad_token_id=tok.pad_token_id).eval()
    rows = [json.loads(x) for x in open(args.data)][: args.prompts + 1]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)

    def batch(question: str) -> PromptBatch:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        t = torch.tensor([ids] * args.samples)
        return PromptBatch(t, torch.ones_like(t))

    def with_generate(p: PromptBatch):
        with torch.no_grad():
            return model.generate(input_ids=p.input_ids, attention_mask=p.attention_mask, generation_config=gen.to_hf())

    def with_decode(p: PromptBatch):
        return hf_generate(model, p, gen, torch.device("cpu"), synced_gpus=False)

    methods = {"transformers generate": with_generate, "rlhfkit decode": with_decode}
    times = {k: [] for k in methods}
    for i, row in enumerate(rows):
        p = batch(row["question"])
        for name in (list(methods) if i % 2 else list(methods)[::-1]):
            t0 = time.perf_counter()
            methods[name](p)
            if i > 0:  # the first prompt warms both up
                times[name].append(time.perf_counter() - t0)
    print(f"\n{args.prompts} GSM8K prompts x {args.samples} samples, {args.new_tokens} new tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    for name, s in mean.items():
        print(f"{name:<24}{s:8.2f} s/batch {args.samples * args.new_tokens / s:8.1f} tokens/s")
    print(f"rlhfkit decode / generate, tokens/s: {mean['transformers generate'] / mean['rlhfkit decode']:.2f}x")


if __name__ == "__main__":
    main()
