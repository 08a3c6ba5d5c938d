"""What a pipeline run learned, on held-out data, stated plainly: the lines ``rlhfkit report`` prints and
writes at the top of report.md.

It reads the stage manifests of a ``launch/pipeline.sh`` run directory (``step2/rlhfkit.json``,
``step3/actor/rlhfkit.json``) and ``eval/results.json`` when ``rlhfkit eval`` wrote one, and checks each
figure against a target:

- step 2: held-out accuracy >= ``rm_accuracy`` with the 95% interval's lower end above 0.5, on at least
  ``min_pairs`` pairs, over all pairs and for each preference set the run trained on. With ``shorter_accuracy``
  (the quality recipe) a *length-biased* set, one where "prefer the longer answer" is right more often than not
  (its 95% interval above 0.5, as on AlpacaEval's helpfulness pairs), is judged instead by whether the model
  beats that baseline and reaches ``shorter_accuracy`` on the pairs whose chosen answer is the shorter;
- step 3: the actor's held-out reward above the step-1 model's, the paired 95% interval above 0, on at
  least ``min_prompts`` prompts.
With the quality recipe's targets (``launch/pipeline.sh --size quality`` writes ``pipeline.json`` naming its
size), also:
- the independent judge (``judge/``): its held-out accuracy no lower than the training reward model's;
- ``rlhfkit eval``: the actor's win rate over the step-1 model >= ``win_rate`` under the training reward model
  and under each judge, and the judges' length-controlled win rate >= ``lc_win_rate``, on at least
  ``min_prompts`` prompts with several samples each.
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
    win_rate: Optional[float] = None  # rlhfkit eval: win rate (ties half) under every reward model
    lc_win_rate: Optional[float] = None  # rlhfkit eval: length-controlled win rate under each judge
    judge_no_worse: bool = False  # judge/: held-out accuracy >= the training reward model's
    shorter_accuracy: Optional[float] = None  # a length-biased set: beat the longer answer, and this where the chosen is shorter


# the targets of issue 21 per pipeline size (launch/pipeline.sh writes pipeline.json with its size)
TARGETS = {"quality": Targets(rm_accuracy=0.65, min_pairs=256, min_prompts=128, win_rate=0.60, lc_win_rate=0.55,
                              judge_no_worse=True, shorter_accuracy=0.55)}


def run_targets(run: Path) -> Targets:
    """The targets of the pipeline size that made ``run`` (its pipeline.json), else the default run's."""
    try:
        size = json.loads((run / "pipeline.json").read_text(encoding="utf-8")).get("size")
    except (OSError, ValueError, AttributeError):
        size = None
    return TARGETS.get(size, Targets())


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
    sets = m.get("eval_by_source") or {}
    pooled = {"accuracy": acc, "accuracy_ci_low": low, "pairs": n, "longer_baseline": m.get("eval_longer_baseline"),
              "chosen_shorter_accuracy": m.get("eval_chosen_shorter_accuracy")}
    ok = all(_set_ok(v, t) for v in sets.values()) if sets else _set_ok(pooled, t)
    rule = _length_rule(t) if not sets and _length_rule_applies(pooled, t) else f">= {t.rm_accuracy:.2f} with the CI above 0.5"
    lines = [f"step 2 (reward model): held-out accuracy {acc:.3f}, 95% CI [{low:.3f}, {high:.3f}], on {n} pairs "
             f"(before training {m['eval_accuracy_before']:.3f}); target {rule} "
             f"on >= {t.min_pairs} pairs" + (" of each preference set" if sets else "") + f": {_verdict(ok)}"]
    if "eval_longer_baseline" in m:
        lines.append("  baselines: " + _baselines(m["eval_longer_baseline"], m.get("eval_chosen_shorter_accuracy"),
                                                  m.get("eval_chosen_shorter_pairs")))
    for tag, v in sets.items():
        biased = _length_rule_applies(v, t)
        lines.append(f"  {tag}: accuracy {v['accuracy']:.3f}, 95% CI [{v['accuracy_ci_low']:.3f}, {v['accuracy_ci_high']:.3f}], "
                     f"on {v['pairs']} pairs" + (f" (length-biased: target {_length_rule(t)})" if biased else "")
                     + f": {_verdict(_set_ok(v, t))}; "
                     + _baselines(v.get("longer_baseline", float("nan")), v.get("chosen_shorter_accuracy"),
                                  v.get("chosen_shorter_pairs")))
    return lines


def _length_rule_applies(v: dict, t: Targets) -> bool:
    """Do the targets have a length rule, and is this set length-biased: "prefer the longer answer" right more
    often than not (its 95% Wilson interval above 0.5)?"""
    from rlhfkit.eval_stats import wilson_interval

    longer, n = v.get("longer_baseline"), v.get("pairs", 0)
    return (t.shorter_accuracy is not None and longer is not None and n > 0
            and wilson_interval(round(longer * n), n)[0] > 0.5)


def _length_rule(t: Targets) -> str:
    return f"above the longer-answer baseline and >= {t.shorter_accuracy:.2f} where the chosen answer is the shorter"


def _set_ok(v: dict, t: Targets) -> bool:
    """One preference set's (or the pooled) held-out figures against the targets."""
    if _length_rule_applies(v, t):
        shorter = v.get("chosen_shorter_accuracy")
        return (v["pairs"] >= t.min_pairs and v["accuracy"] > v["longer_baseline"]
                and shorter is not None and shorter >= t.shorter_accuracy)
    return _rm_ok(v["accuracy"], v["accuracy_ci_low"], v["pairs"], t)


def _rm_ok(accuracy: float, ci_low: float, pairs: int, t: Targets) -> bool:
    return accuracy >= t.rm_accuracy and ci_low > 0.5 and pairs >= t.min_pairs


def _baselines(longer: float, shorter_accuracy: Optional[float], shorter_pairs: Optional[int]) -> str:
    shorter = (f"{shorter_accuracy:.3f} on the {shorter_pairs} pairs whose chosen answer is the shorter"
               if shorter_pairs else "no pair has the shorter answer chosen")
    return f"'prefer the longer answer' {longer:.3f}; the model {shorter}"


def judge_lines(judge: dict, proxy: Optional[dict], t: Targets) -> list[str]:
    """The independent judge's held-out accuracy, and whether it is no lower than the training reward model's."""
    acc, (low, high), n = judge["eval_accuracy_after"], judge.get("eval_accuracy_ci") or (float("nan"),) * 2, judge.get("eval_pairs", 0)
    line = f"independent judge (judge/): held-out accuracy {acc:.3f}, 95% CI [{low:.3f}, {high:.3f}], on {n} pairs of its own share"
    if t.judge_no_worse and proxy and "eval_accuracy_after" in proxy:
        line += (f"; target: no lower than the training reward model's {proxy['eval_accuracy_after']:.3f}: "
                 f"{_verdict(acc >= proxy['eval_accuracy_after'])}")
    return [line]


EMPTY_SLACK = 0.01  # the actor may answer nothing this much more often than the baseline (sampling noise)
_EMPTY_RULE = f"empty answers at most {EMPTY_SLACK:.0%} above the baseline's"


def _more_empty(before: float, after: float) -> bool:
    """The actor answers nothing (EOS first) more often than the baseline, beyond :data:`EMPTY_SLACK`. Reward
    models never see an empty answer in training and may score it high, so a gain that comes with more
    empty answers is not a better model (a hh-rlhf PPO run measured 0% -> 49% empty, judged a win)."""
    return after > before + EMPTY_SLACK


def _ci_text(low: Optional[float], high: Optional[float]) -> str:
    """A paired interval as "[low, high]"; one prompt has none (``mean_ci`` gives None below 2 values)."""
    return "none (fewer than 2 prompts)" if low is None or high is None else f"[{low:+.4f}, {high:+.4f}]"


def policy_lines(m: dict, t: Targets, label: str = "step 3") -> list[str]:
    """Step 3's paired held-out reward gain over the step-1 model and its KL, against the targets."""
    if m.get("eval_reward_gain") is None:
        return [f"{label}: no held-out evaluation recorded"]
    low, high = m["eval_reward_gain_ci"]
    n = m.get("eval_prompts", 0)
    empty = (m.get("eval_empty_rate_before", 0.0), m.get("eval_empty_rate_after", 0.0))
    ok = low is not None and low > 0 and n >= t.min_prompts and not _more_empty(*empty)
    kl = m.get("eval_kl_per_token_after")
    return [f"{label}: held-out reward {m['eval_reward_before']:.4f} (step-1 model) -> {m['eval_reward_after']:.4f} (actor), "
            f"gain {m['eval_reward_gain']:+.4f}, paired 95% CI {_ci_text(low, high)} over {n} prompts"
            + (f"; KL {kl:.4f} nats per token" if kl is not None else "")
            + (f"; response length {m['eval_response_len_before']:.1f} -> {m['eval_response_len_after']:.1f} tokens"
               if "eval_response_len_after" in m else "")
            + (f"; empty responses {empty[0]:.1%} -> {empty[1]:.1%}" if any(empty) else "")
            + f"; target: CI above 0 on >= {t.min_prompts} prompts, {_EMPTY_RULE}: {_verdict(ok)}"] + judged_change_lines(m, label)


def judged_change_lines(m: dict, label: str) -> list[str]:
    """Step 3's held-out change under each ``--judge`` (never trained on), paired by prompt."""
    lines = []
    for key in sorted(k for k in m if k.startswith("eval_judge") and k.endswith("_change")):
        name = key[len("eval_"):-len("_change")]
        if m[key] is None:  # no prompt evaluated
            continue
        lines.append(f"  {label} under {name}: held-out {m[f'eval_{name}_before']:.4f} -> {m[f'eval_{name}_after']:.4f}, "
                     f"change {m[key]:+.4f}, paired 95% CI {_ci_text(*m[f'eval_{name}_change_ci'])}")
    return lines


def eval_lines(results: dict, t: Optional[Targets] = None) -> list[str]:
    """``rlhfkit eval``'s win rates of the actor over the baseline, by the training reward model and each judge,
    against the win-rate targets where ``t`` has them."""
    t = t or Targets()
    c = results.get("comparison") or {}
    if "win_rate_ties_half" not in c:
        return []
    prompts = results.get("prompts", {})
    n, samples = prompts.get("count", 0), prompts.get("samples_per_prompt", 1)
    models = results.get("models", {})
    empty = tuple(models.get(k, {}).get("empty_rate", 0.0) for k in ("baseline", "actor"))
    enough = n >= t.min_prompts and samples >= 2 and not _more_empty(*empty)
    lines = [f"rlhfkit eval (training reward model): {_win_text(c)}, over {n} prompts x {samples} samples"
             + (f"; target: win rate >= {t.win_rate:.2f} on >= {t.min_prompts} prompts, several samples each: "
                f"{_verdict(enough and c['win_rate_ties_half'] >= t.win_rate)}" if t.win_rate is not None else "")]
    if any(empty):
        lines.append(f"  empty responses: baseline {empty[0]:.1%}, actor {empty[1]:.1%}"
                     + (f" (the targets also need {_EMPTY_RULE})" if t.win_rate is not None else ""))
    for name, j in (results.get("judges") or {}).items():
        jc = j.get("comparison", j)
        if "win_rate_ties_half" not in jc:
            continue
        line = f"  judge {name}: {_win_text(jc)}"
        if t.win_rate is not None:
            ok = enough and jc["win_rate_ties_half"] >= t.win_rate and jc.get("lc_win_rate", -1.0) >= (t.lc_win_rate or 0.0)
            line += (f"; target: win rate >= {t.win_rate:.2f} and length-controlled >= {t.lc_win_rate or 0.0:.2f}: "
                     f"{_verdict(ok)}")
        lines.append(line)
    return lines


def _win_text(c: dict) -> str:
    lo, hi = c["win_rate_ties_half_ci"]
    lc_lo, lc_hi = c.get("lc_win_rate_ci") or (float("nan"), float("nan"))
    return (f"win rate {c['win_rate_ties_half']:.3f} [{lo:.3f}, {hi:.3f}], "
            f"length-controlled {c.get('lc_win_rate', float('nan')):.3f} [{lc_lo:.3f}, {lc_hi:.3f}]")


def outcome_lines(run_dir: str | Path, targets: Optional[Targets] = None) -> list[str]:
    """The held-out outcome lines of a pipeline run directory (empty when it has none of the stages)."""
    run = Path(run_dir)
    t = targets or run_targets(run)
    lines: list[str] = []
    rm = _metrics(run / "step2")
    if rm and "eval_accuracy_after" in rm:
        lines += reward_model_lines(rm, t)
    judge = _metrics(run / "judge")
    if judge and "eval_accuracy_after" in judge:
        lines += judge_lines(judge, rm, t)
    actor = _metrics(run / "step3" / "actor")
    if actor:
        lines += policy_lines(actor, t)
    try:
        lines += eval_lines(json.loads((run / "eval" / "results.json").read_text(encoding="utf-8")), t)
    except (OSError, ValueError):
        pass
    return lines
