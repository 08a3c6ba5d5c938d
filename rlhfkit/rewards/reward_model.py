"""Scoring preference pairs with a reward model: the evaluation shared by step 2's training loop
and ``step2_reward/evaluate.py`` / ``rlhfkit score`` (one code path, so both print the same)."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from rlhfkit.eval_stats import wilson_interval


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: Optional[torch.Tensor] = None,
                 rejected_len: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Accuracy (chosen scored strictly higher) with its 95% Wilson interval, mean scores and mean margin
    over pairs ([N] each). With the sequences' token counts also: ``longer_baseline``, the accuracy of
    "prefer the longer answer" (equal lengths count half), and the accuracy on the pairs whose chosen
    answer is the shorter, where a model that only counts tokens is wrong every time."""
    n = int(chosen.numel())
    right = chosen > rejected
    low, high = wilson_interval(int(right.sum()), n)
    out = {
        "accuracy": float(right.sum()) / max(n, 1), "accuracy_ci_low": low, "accuracy_ci_high": high,
        "chosen_score": float(chosen.sum()) / max(n, 1),
        "rejected_score": float(rejected.sum()) / max(n, 1),
        "margin": float((chosen - rejected).sum()) / max(n, 1),
        "pairs": n,
    }
    if chosen_len is not None and rejected_len is not None and n:
        out["longer_baseline"] = float((chosen_len > rejected_len).sum() + 0.5 * (chosen_len == rejected_len).sum()) / n
        shorter = chosen_len < rejected_len
        out["chosen_shorter_pairs"] = int(shorter.sum())
        if shorter.any():
            out["chosen_shorter_accuracy"] = float(right[shorter].double().mean())
    return out


# the figures given per data source when a held-out set blends several
SOURCE_FIGURES = ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "pairs", "longer_baseline",
                  "chosen_shorter_accuracy", "chosen_shorter_pairs")


def source_tags(paths: Sequence[str]) -> dict[str, str]:
    """A short name for each data source in metric keys: its directory's name ("hh-rlhf-harmless-base"), or
    "directory/file" for every source whose directory another source shares."""
    dirs = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    return {p: d if dirs.count(d) == 1 else f"{d}/{os.path.basename(p)}" for p, d in zip(paths, dirs)}


def pair_metrics_by_source(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                           rejected_len: torch.Tensor, sources: Sequence[str]) -> dict[str, float]:
    """:func:`pair_metrics` over all pairs and, when they come from several sources (``sources[i]``: pair i's
    data path), each source's :data:`SOURCE_FIGURES` as "<tag>/<figure>" (:func:`source_tags`)."""
    out = pair_metrics(chosen, rejected, chosen_len, rejected_len)
    names = list(dict.fromkeys(sources))
    if len(names) < 2:
        return out
    for name, tag in source_tags(names).items():
        idx = torch.tensor([i for i, s in enumerate(sources) if s == name], dtype=torch.long)
        part = pair_metrics(chosen[idx], rejected[idx], chosen_len[idx], rejected_len[idx])
        out.update({f"{tag}/{k}": part[k] for k in SOURCE_FIGURES if k in part})
    return out


def by_source(ev: dict) -> dict[str, dict]:
    """{source tag: its held-out figures} from an evaluation's "<tag>/<figure>" keys."""
    out: dict[str, dict] = {}
    for key, value in ev.items():
        tag, _, figure = key.rpartition("/")
        if tag and figure in SOURCE_FIGURES:
            out.setdefault(tag, {})[figure] = value
    return out


def held_out_baselines(ev: dict) -> str:
    """The held-out line a length-only reward model would fail: "prefer the longer answer", and the accuracy
    on the pairs whose chosen answer is the shorter."""
    if "longer_baseline" not in ev:
        return "n/a"
    shorter = (f"{ev['chosen_shorter_accuracy']:.3f} where the chosen answer is the shorter ({ev['chosen_shorter_pairs']} pairs)"
               if ev.get("chosen_shorter_pairs") else "no pair has the shorter answer chosen")
    return f"longer answer {ev['longer_baseline']:.3f}; this model {shorter}"


@torch.no_grad()
def score_pairs(score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                batches: Iterable[tuple[dict, torch.Tensor]], device: Any = "cpu") -> tuple[torch.Tensor, ...]:
    """Run ``score_fn(input_ids, attention_mask) -> [2B]`` (or [2B, K]: K scores a sequence) over pair
    batches (``collate_pairs`` layout: B chosen rows then B rejected rows) with 0/1 row weights; returns
    this process's (chosen, rejected) scores of the weight-1 rows and their (chosen, rejected) token counts."""
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for batch, weights in batches:
        scores = score_fn(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
        lengths = batch["attention_mask"].sum(-1).cpu()
        b = scores.shape[0] // 2
        keep = weights.bool()
        for out, x in zip(parts, (scores[:b], scores[b:], lengths[:b], lengths[b:])):
            out.append(x[keep])
    if not parts[0]:
        return torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return tuple(torch.cat(p) for p in parts)
