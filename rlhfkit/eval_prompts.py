"""The prompts of ``rlhfkit eval``: all prompts of given data (seeded shuffle), or the held-out step-3
prompts re-created from the actor's manifest, tokenised until enough fit."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rlhfkit.errors import ConfigError, DataError


@dataclass
class PromptSet:
    examples: list  # [N] Example, in evaluation order
    features: list[dict]  # [N] {"prompt_ids", "index"} (index into examples)
    origin: str  # where they come from, in words
    data: list[str]  # one summary line per source
    tokenize: str  # what tokenisation kept / cut / dropped


def display_prompt(ex: Any) -> str:
    """The prompt as a reader should see it: the user's message, or the plain-text dialogue."""
    from rlhfkit.data.tokenize import plain_prompt_text

    msgs = [m for m in ex.prompt if m["role"] != "system"]
    if len(msgs) == 1:
        return msgs[0]["content"]
    return plain_prompt_text(ex.prompt)[: -len("Assistant:")].rstrip()


def given_prompt_rows(paths: list[str], seed: int, n: int) -> tuple[list, list, str]:
    """(rows, sources, origin in words): every prompt of ``paths``, shuffled with ``seed``."""
    from rlhfkit.data import load_phase_data

    train, _, sources = load_phase_data(paths, phase=3, need="prompts", data_split="0,0,1", seed=seed, eval_fraction=0.0)
    rows = list(train)
    random.Random(seed).shuffle(rows)  # blended sources: shuffle across them too
    return rows, sources, f"{', '.join(paths)} (all prompts, shuffled with seed {seed}, first {n})"


def held_out_prompt_rows(actor: str, actor_manifest: dict, n: int) -> tuple[list, list, str]:
    """(rows, sources, origin in words): the step-3 prompts the actor's run held out, re-created from
    its manifest (data_path, data_split, seed, eval_fraction, max_eval_samples, max_per_prompt); neither model trained on them."""
    from rlhfkit.data import load_phase_data

    config = (actor_manifest or {}).get("config") or {}
    if actor_manifest.get("stage") != "actor" or not config.get("data_path"):
        raise ConfigError(
            f"--actor {actor}: a '{actor_manifest.get('stage')}' checkpoint without a step-3 data config, so its "
            "held-out prompts cannot be re-created; pass --prompts DATA")
    data_path = config["data_path"]
    try:
        _, rows, sources = load_phase_data(data_path, phase=3, need="prompts", data_split=config.get("data_split", "2,4,4"),
                                           seed=config.get("seed", 1234), eval_fraction=config.get("eval_fraction", 0.05),
                                           strict=bool(config.get("strict", False)), max_eval=config.get("max_eval_samples"),
                                           max_per_prompt=config.get("max_per_prompt"))
    except DataError as e:
        raise DataError(f"the held-out step-3 prompts of --actor {actor} (data {data_path} from its manifest) "
                        f"cannot be re-created: {e} Pass --prompts DATA instead.") from None
    if not rows:
        raise DataError(f"--actor {actor}: step 3 held out no prompts (eval_fraction {config.get('eval_fraction')}, "
                        f"max_eval_samples {config.get('max_eval_samples')}); pass --prompts DATA")
    origin = (f"held-out step-3 prompts of {', '.join(map(str, data_path if isinstance(data_path, list) else [data_path]))} "
              f"(data_split {config.get('data_split')}, seed {config.get('seed')}, eval_fraction "
              f"{config.get('eval_fraction')}, max_eval_samples {config.get('max_eval_samples')}; first {n})")
    return rows, sources, origin


def take_prompts(rows: list, tokenizer: Any, max_len: int, n: int) -> tuple[list, list[dict], str]:
    """The first ``n`` rows that survive tokenisation (chunk by chunk, so a large file is not all
    tokenised) -> (rows, features, what was kept / cut / dropped in words)."""
    from rlhfkit.data import tokenize_prompts

    kept, feats = [], []
    seen = cut = 0
    dropped: dict[str, int] = {}
    start = 0
    while len(feats) < n and start < len(rows):
        chunk = rows[start:start + (n - len(feats))]
        start += len(chunk)
        seen += len(chunk)
        try:
            f, rep = tokenize_prompts(chunk, tokenizer, max_len)
        except DataError:  # no prompt of this chunk survived (too long, or rejected by the chat template)
            reason = "prompt too long or rejected by the chat template"
            dropped[reason] = dropped.get(reason, 0) + len(chunk)
            continue
        cut += rep.prompt_truncated
        for reason, k in rep.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + k
        for feat in f:
            feats.append({"prompt_ids": feat["prompt_ids"], "index": len(kept)})
            kept.append(chunk[feat["index"]])
    if not feats:
        raise DataError(f"no prompt fits --max_prompt_len {max_len} tokens ({seen} tried); raise --max_prompt_len")
    line = f"tokenised {seen} prompts: kept {len(feats)}, left-truncated {cut}"
    line += (", dropped " + ", ".join(f"{r} {k}" for r, k in dropped.items())) if dropped else ", none dropped"
    return kept, feats, line
