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


def collate_prompts(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids [B, P] left-padded, attention_mask [B, P], index [B] (into the examples)."""
    _check_pad(pad_token_id)
    input_ids, attention_mask = _pad([f["prompt_ids"] for f in features], pad_token_id, left=True)
    index = torch.tensor([f["index"] for f in features], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "index": index}
