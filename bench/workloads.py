"""Bench data whose shapes do not depend on the code under test: real hh-rlhf text, cut to fixed lengths.

A speed comparison between revisions must give both the same work. A step-3 run's cost follows its
prompts' padded length, and which prompts a run draws depends on the revision's data split (how rows
are shuffled and grouped) and its truncation: with hh-rlhf as it is, two revisions can draw batches
of different lengths and the difference counts as speed. Here every prompt has the same length, so
whichever rows a revision draws, every batch has the same shape.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from rlhfkit.data.tokenize import encode_prompt


def exact_prompt(tokenizer, text: str, length: int) -> str | None:
    """A prefix of ``text`` that, as one user turn through the chat template with the generation prompt,
    is exactly ``length`` tokens (``encode_prompt``, as step 3 encodes it); None if none is found."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    overhead = len(encode_prompt(tokenizer, [{"role": "user", "content": ""}]))
    keep = length - overhead
    for _ in range(8):  # decoding and encoding again may merge tokens at the cut: correct the count and retry
        if keep <= 0 or keep > len(ids):
            return None
        prefix = tokenizer.decode(ids[:keep]).strip()  # the prompt-only format strips its text
        got = len(encode_prompt(tokenizer, [{"role": "user", "content": prefix}]))
        if got == length:
            return prefix
        keep += length - got
    return None


def exact_length_prompts(path: str, tokenizer, out: str, rows: int, length: int) -> str:
    """``rows`` prompt-only rows (JSONL in ``out``) of exactly ``length`` prompt tokens each, cut from hh-rlhf
    conversations joined end to end until each is long enough (about 6 characters a token: a safe margin)."""
    with gzip.open(path, "rt") as f:
        texts = [json.loads(line)["chosen"] for line in f]
    joined, current, chars = [], [], 0
    for text in texts:
        # plain text, not an hh dialogue (a prompt starting with "Human:" would be parsed into turns)
        current.append(text.replace("\n\nHuman:", "\nUser:").replace("\n\nAssistant:", "\nAssistant:").strip())
        chars += len(current[-1])
        if chars >= 6 * length:
            joined.append(" ".join(current))
            current, chars = [], 0
    prompts = []
    for text in joined:
        if len(prompts) == rows:
            break
        prompt = exact_prompt(tokenizer, text, length)
        if prompt is not None:
            prompts.append(prompt)
    if len(prompts) < rows:
        raise SystemExit(f"{path}: only {len(prompts)} prompts of exactly {length} tokens, {rows} wanted")
    Path(out).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return out
