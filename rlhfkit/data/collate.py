"""Collators: lists of tokenised features -> padded LongTensor batches.

SFT and pair batches are right-padded (the sequence starts at position 0, the reward is read at the
last real token); RL prompt batches are left-padded so that generation continues from the last
column. ``attention_mask`` is 1 on real tokens, 0 on padding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhfkit.data.tokenize import IGNORE_INDEX
from rlhfkit.errors import ConfigError


def _pad(seqs: Sequence[Sequence[int]], value: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids [N, T], attention_mask [N, T]) with T the longest sequence."""
    if not seqs:
        raise ValueError("cannot collate an empty batch")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[row, cols] = torch.tensor(s, dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask


def _check_pad(pad_token_id) -> None:
    if pad_token_id is None:
        raise ConfigError("the tokenizer has no pad token; set tokenizer.pad_token (distinct from EOS).")


def collate_sft(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids [B, T] (right-padded), attention_mask [B, T], labels [B, T] (IGNORE_INDEX at pads)."""
    _check_pad(pad_token_id)
    input_ids, attention_mask = _pad([f["input_ids"] for f in features], pad_token_id)
    labels, _ = _pad([f["labels"] for f in features], IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_pairs(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids [2B, T] right-padded, rows 0..B-1 chosen and B..2B-1 the matching rejected;
    attention_mask [2B, T]; prompt_len [2B] (tokens before the response in each row)."""
    _check_pad(pad_token_id)
    seqs = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
    input_ids, attention_mask = _pad(seqs, pad_token_id)
    prompt_len = torch.tensor([f["prompt_len"] for f in features] * 2, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_len": prompt_len}


def collate_kto(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """KTO's batch in :func:`collate_pairs`' layout: rows 0..B-1 each prompt with its own completion, rows
    B..2B-1 prompt i with completion (i+1) mod B, a mismatched pair for KTO's reference point (TRL's shifted
    completions; cut to the feature's max_seq_len). desirable [B] bool; kl_weight [B]: 1, or 0 when B is 1
    (no mismatched pair exists)."""
    n = len(features)
    rows = []
    for i, f in enumerate(features):
        other = features[(i + 1) % n]["completion_ids"][:max(f["max_seq_len"] - len(f["prompt_ids"]), 0)]
        rows.append({"chosen_input_ids": f["prompt_ids"] + f["completion_ids"], "rejected_input_ids": f["prompt_ids"] + other,
                     "prompt_len": len(f["prompt_ids"])})
    batch = collate_pairs(rows, pad_token_id)
    batch["desirable"] = torch.tensor([bool(f["desirable"]) for f in features])
    batch["kl_weight"] = torch.full((n,), 1.0 if n > 1 else 0.0)
    return batch


def collate_packed_pairs(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Each pair as ONE row: its shared prompt once, then the chosen response, then the rejected one.

    -> input_ids [B, T] right-padded; attention_mask [B, T] (1 on the real tokens); position_ids
    [B, T] (the rejected response restarts where the prompt ends); pair_mask [B, T, T] bool (query
    row may attend to key column: causal, but the rejected response does not see the chosen one and
    padding sees only itself); chosen_end / rejected_end [B] (the column of each side's last real
    token, where its score is read: the same token as in a ``collate_pairs`` row); prompt_len [B]
    (the shared prompt's tokens: the chosen response starts at that column).

    A row thus computes exactly what the two rows of ``collate_pairs`` compute, with the prompt's
    tokens run once (about 40% fewer tokens on hh-rlhf at 256).
    """
    _check_pad(pad_token_id)
    rows, positions, spans = [], [], []
    for f in features:
        p = f["prompt_len"]
        chosen, rejected = f["chosen_input_ids"], f["rejected_input_ids"][p:]
        if f["rejected_input_ids"][:p] != chosen[:p]:
            raise ValueError("a pair's chosen and rejected sequences must share their first prompt_len tokens")
        rows.append(chosen + rejected)
        positions.append(list(range(len(chosen))) + list(range(p, p + len(rejected))))
        spans.append((p, len(chosen), len(chosen) + len(rejected)))
    input_ids, attention_mask = _pad(rows, pad_token_id)
    pos, _ = _pad(positions, 0)
    width = input_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    pair_mask = causal.repeat(len(rows), 1, 1)
    for row, (p, c_end, n) in enumerate(spans):
        pair_mask[row, c_end:n, p:c_end] = False  # the rejected response does not see the chosen one
        pair_mask[row, :, n:] = False  # nobody sees padding ...
        pair_mask[row, n:, :] = False
        pair_mask[row, range(n, width), range(n, width)] = True  # ... and a pad sees only itself (no empty softmax row)
    chosen_end = torch.tensor([c_end - 1 for _, c_end, _ in spans], dtype=torch.long)
    rejected_end = torch.tensor([n - 1 if n > c_end else p - 1 for p, c_end, n in spans], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": pos, "pair_mask": pair_mask,
            "chosen_end": chosen_end, "rejected_end": rejected_end,
            "prompt_len": torch.tensor([p for p, _, _ in spans], dtype=torch.long)}


def collate_prompts(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids [B, P] left-padded, attention_mask [B, P], index [B] (into the examples)."""
    _check_pad(pad_token_id)
    input_ids, attention_mask = _pad([f["prompt_ids"] for f in features], pad_token_id, left=True)
    index = torch.tensor([f["index"] for f in features], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "index": index}
