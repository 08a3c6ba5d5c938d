"""What a pipeline run learned, on held-out data, stated plainly: the lines ``rlhfkit report`` prints and
writes at the top of report.md.

It reads the stage manifests of a ``launch/pipeline.sh`` run directory (``step2/rlhfkit.json``,
``step3/actor/rlhfkit.json``) and ``eval/results.json`` when ``rlhfkit eval`` wrote one, and checks each
figure against a target:

- step 2: held-out accuracy >= ``rm_accuracy`` with the 95% interval's lower end above 0.5, on at least
  ``min_pairs`` pairs;
- step 3: the actor's held-out reward above the step-1 model's, the paired 95% interval above 0, on at
  least ``min_prompts`` prompts.
A missed target says "MISSED" with the numbers; nothing here decides what a run trains on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Targets:
    rm_accuracy: float = 0.60
    min_pairs: int = 128
    min_prompts: int = 64


def _metrics(directory: Path) -> Optional[dict]:
    from rlhfkit.checkpoint import read_manifest

    return (read_manifest(directory) or {}).get("metrics") or None


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def reward_model_lines(m: dict, t: Targets) -> list[str]:
    """Step 2's held-out accuracy, its interval and baselines, against the targets."""
    acc, (low, high), n = m["eval_accuracy_after"], m.get("eval_accuracy_ci") or (None, None), m.get("eval_pairs", 0)
    if low is None:
        return [f"step 2 (reward model): held-out accuracy {acc:.3f} on {n} pairs (no interval recorded)"]
    ok = acc >= t.rm_accuracy and low > 0.5 and n >= t.min_pairs
    lines = [f"step 2 (reward model): held-out accuracy {acc:.3f}, 95% CI [{low:.3f}, {high:.3f}], on {n} pairs "
             f"(before training {m['eval_accuracy_before']:.3f}); target >= {t.rm_accuracy:.2f} with the CI above 0.5 "
             f"on >= {t.min_pairs} pairs: {_verdict(ok)}"]
    if "eval_longer_baseline" in m:
        shorter = (f"{m['eval_chosen_shorter_accuracy']:.3f} on the {m['eval_chosen_shorter_pairs']} pairs whose chosen answer "
                   f"is the shorter" if m.get("eval_chosen_shorter_pairs") else "no pair has the shorter answer chosen")
        lines.append(f"  baselines: 'prefer the longer answer' {m['eval_longer_baseline']:.3f}; the model {shorter}")
    return lines


def policy_lines(m: dict, t: Targets, label: str = "step 3") -> list[str]:
    """Step 3's paired held-out reward gain over the step-1 model and its KL, against the targets."""
    if m.get("eval_reward_gain") is None:
        return [f"{label}: no held-out evaluation recorded"]
    low, high = m["eval_reward_gain_ci"]
    n = m.get("eval_prompts", 0)
    ok = low is not None and low > 0 and n >= t.min_prompts
    kl = m.get("eval_kl_per_token_after")
    return [f"{label}: held-out reward {m['eval_reward_before']:.4f} (step-1 model) -> {m['eval_reward_after']:.4f} (actor), "
            f"gain {m['eval_reward_gain']:+.4f}, paired 95% CI [{low:+.4f}, {high:+.4f}] over {n} prompts"
            + (f"; KL {kl:.4f} nats per token" if kl is not None else "")
            + (f"; response length {m['eval_response_len_before']:.1f} -> {m['eval_response_len_after']:.1f} tokens"
               if "eval_response_len_after" in m else "")
            + f"; target: CI above 0 on >= {t.min_prompts} prompts: {_verdict(ok)}"]


def eval_lines(results: dict) -> list[str]:
    """``rlhfkit eval``'s win rates of the actor over the baseline, by each judge."""
    c = results.get("comparison") or {}
    if "win_rate_ties_half" not in c:
        return []
    n = results.get("prompts", {}).get("count")
    lo, hi = c["win_rate_ties_half_ci"]
    lc_lo, lc_hi = c.get("lc_win_rate_ci") or (float("nan"), float("nan"))
    lines = [f"rlhfkit eval (training reward model): win rate {c['win_rate_ties_half']:.3f} [{lo:.3f}, {hi:.3f}], "
             f"length-controlled {c.get('lc_win_rate', float('nan')):.3f} [{lc_lo:.3f}, {lc_hi:.3f}], over {n} prompts"]
    for name, j in (results.get("judges") or {}).items():
        jc = j.get("comparison", j)
        if "win_rate_ties_half" in jc:
            j_lo, j_hi = jc["win_rate_ties_half_ci"]
            lines.append(f"  judge {name}: win rate {jc['win_rate_ties_half']:.3f} [{j_lo:.3f}, {j_hi:.3f}], "
                         f"length-controlled {jc.get('lc_win_rate', float('nan')):.3f}")
    return lines


def outcome_lines(run_dir: str | Path, targets: Optional[Targets] = None) -> list[str]:
    """The held-out outcome lines of a pipeline run directory (empty when it has none of the stages)."""
    run, t = Path(run_dir), targets or Targets()
    lines: list[str] = []
    rm = _metrics(run / "step2")
    if rm and "eval_accuracy_after" in rm:
        lines += reward_model_lines(rm, t)
    actor = _metrics(run / "step3" / "actor")
    if actor:
        lines += policy_lines(actor, t)
    try:
        lines += eval_lines(json.loads((run / "eval" / "results.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    return lines
