"""Scoring preference pairs with a reward model: the evaluation shared by step 2's training loop
and ``step2_reward/evaluate.py`` / ``rlhfkit score`` (one code path, so both print the same)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Accuracy (chosen scored strictly higher), mean scores and mean margin over pairs ([N] each)."""
    n = max(int(chosen.numel()), 1)
    return {
        "accuracy": float((chosen > rejected).sum()) / n,
        "chosen_score": float(chosen.sum()) / n,
        "rejected_score": float(rejected.sum()) / n,
        "margin": float((chosen - rejected).sum()) / n,
        "pairs": int(chosen.numel()),
    }


@torch.no_grad()
def score_pairs(score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                batches: Iterable[tuple[dict, torch.Tensor]], device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``score_fn(input_ids, attention_mask) -> [2B]`` over pair batches (``collate_pairs``
    layout: B chosen rows then B rejected rows) with 0/1 row weights; returns this process's
    (chosen, rejected) scores of the weight-1 rows."""
    chosen, rejected = [], []
    for batch, weights in batches:
        scores = score_fn(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
        b = scores.shape[0] // 2
        keep = weights.bool()
        chosen.append(scores[:b][keep])
        rejected.append(scores[b:][keep])
    if not chosen:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(chosen), torch.cat(rejected)
