"""results.json of ``rlhfkit eval``: the settings, the prompts' origin, per model its reward, length and
truncation; with a baseline, actor against baseline by the reward and by each judge, and the KL; the
example pairs and one row per prompt and sample. Assembled from plain lists with
:mod:`rlhfkit.eval_stats`; nothing here loads a model."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any, Callable, Optional

from rlhfkit.eval_models import Responses
from rlhfkit.eval_prompts import PromptSet, display_prompt
from rlhfkit.eval_stats import (
    BOOTSTRAP_METHOD, CI_METHOD, LC_METHOD, TIE_TOL, compare, group_means, kl_stats, mean_ci,
)

PAIRS = "actor sample j of a prompt against baseline sample j of the same prompt (the same seed for both models)"


def build_results(opts: Any, prompts: PromptSet, responses: dict[str, Responses], parts: dict, rewards: dict,
                  kl: Optional[dict], judges: dict, device: str, dtype: str) -> dict:
    """results.json (see the module docstring). ``kl``: :func:`rlhfkit.eval_models.kl_sums` of the actor's
    responses, None without a baseline; ``judges``: ``{judge: {model: scores}}``."""
    names, n_samples = list(responses), opts.samples
    has_base = "baseline" in responses
    groups = [k // n_samples for k in range(len(responses["actor"].tokens))]
    rows = response_rows(prompts, responses, parts, rewards, judges, n_samples)
    results: dict[str, Any] = {
        "config": {**{k: v for k, v in asdict(opts).items() if k != "out"}, "decoding": opts.decoding,
                   "device": device, "dtype": dtype},
        "prompts": {"count": len(prompts.examples), "samples_per_prompt": n_samples, "responses": len(rows),
                    "origin": prompts.origin, "data": prompts.data, "tokenize": prompts.tokenize},
        "statistics": {"confidence_interval": CI_METHOD, "tie": f"identical responses, or |score difference| <= {TIE_TOL}",
                       "pairs": PAIRS, "win_rate_interval": BOOTSTRAP_METHOD, "length_controlled": LC_METHOD,
                       "kl": "on the actor's own responses, summed over their tokens (EOS included): k3 = exp(d) - d - 1 per "
                             "token with d = log p_baseline - log p_actor (never negative), k1 = -d; per_sequence = mean over "
                             "responses, per_token = total / total response tokens; log-probabilities at temperature 1"
                             + ("; greedy responses: a log-ratio on them, not a KL estimate" if opts.greedy else
                                "; samples at temperature 1, so both are unbiased estimates of KL(actor || baseline)")},
        "models": {name: model_summary(getattr(opts, name), responses[name], parts[name], rewards[name], groups)
                   for name in names},
    }
    if has_base:
        outcomes, results["comparison"] = compare_by(rows, groups, lambda r, name: r[name]["reward"], opts.seed)
        for row, o in zip(rows, outcomes):
            row["outcome"] = o
        for key in ("k1", "k3", "logprob_actor", "logprob_baseline"):
            for row, v in zip(rows, kl[key]):
                row[key if key.startswith("logprob") else f"kl_{key}"] = v
        tokens = responses["actor"].tokens
        results["kl"] = {"estimator": "k3", **kl_stats(kl["k3"], tokens), "per_sequence_ci": mean_ci(group_means(kl["k3"], groups)),
                         "k1": kl_stats(kl["k1"], tokens)}
    if judges:
        results["judges"] = {judge: judge_summary(judge, rows, groups, names, has_base, opts.seed) for judge in judges}
    results["examples"] = pick_examples(rows, opts.examples, has_base)
    results["rows"] = rows
    return results


def response_rows(prompts: PromptSet, responses: dict[str, Responses], parts: dict, rewards: dict, judges: dict,
                  n_samples: int) -> list[dict]:
    """One row per prompt and sample: the prompt, and per model its response, length, truncation, reward
    (and its components) and each judge's score."""
    rows = []
    for k in range(len(responses["actor"].tokens)):
        ex = prompts.examples[k // n_samples]
        row: dict[str, Any] = {"index": k, "prompt_index": k // n_samples, "sample": k % n_samples, "source": ex.meta.get("source"),
                               "row": ex.meta.get("row"), "prompt": display_prompt(ex)}
        for name, r in responses.items():
            row[name] = {"response": r.texts[k], "tokens": r.tokens[k], "truncated": r.truncated[k], "reward": rewards[name][k],
                         **{c: v[k] for c, v in parts[name].items()}}
            if judges:
                row[name]["judges"] = {judge: scores[name][k] for judge, scores in judges.items()}
        if "baseline" in responses:
            row["same_response"] = responses["actor"].ids[k] == responses["baseline"].ids[k]
        rows.append(row)
    return rows


def compare_by(rows: list[dict], groups: list[int], score: Callable[[dict, str], float], seed: int) -> tuple[list[str], dict]:
    """:func:`rlhfkit.eval_stats.compare` of the actor and the baseline by ``score(row, model)``."""
    return compare([score(r, "actor") for r in rows], [score(r, "baseline") for r in rows], [r["same_response"] for r in rows],
                   groups, [r["actor"]["tokens"] - r["baseline"]["tokens"] for r in rows], seed=seed)


def model_summary(path: str, r: Responses, parts: dict, rewards: list[float], groups: list[int]) -> dict:
    """One model's reward (t interval over prompts), component means, mean length, truncation and empty rates."""
    n = len(r.tokens)
    return {"path": os.path.abspath(path), "reward": mean_ci(group_means(rewards, groups)),
            **{f"{k}_mean": math.fsum(v) / n for k, v in parts.items()},
            "response_tokens_mean": sum(r.tokens) / n, "truncated_rate": sum(r.truncated) / n,
            "empty_rate": sum(r.empty) / n}


def judge_summary(judge: str, rows: list[dict], groups: list[int], names: list[str], has_base: bool, seed: int) -> dict:
    """One judge: its path, per model the mean score (t interval over prompts), and with a baseline the
    actor against the baseline by its scores."""
    out: dict[str, Any] = {"path": os.path.abspath(judge),
                           "models": {name: mean_ci(group_means([r[name]["judges"][judge] for r in rows], groups))
                                      for name in names}}
    if has_base:
        outcomes, out["comparison"] = compare_by(rows, groups, lambda r, name: r[name]["judges"][judge], seed)
        for row, o in zip(rows, outcomes):
            row.setdefault("judge_outcomes", {})[judge] = o
    return out


def pick_examples(rows: list[dict], k: int, has_base: bool) -> list[dict]:
    """Up to ``k`` (index, why): the actor's largest win and largest loss, then rows in order."""
    chosen: list[dict] = []
    if k and has_base:
        wins = [r for r in rows if r["outcome"] == "win"]
        losses = [r for r in rows if r["outcome"] == "loss"]
        if wins:
            chosen.append({"index": max(wins, key=_reward_gain)["index"], "why": "largest actor win"})
        if losses and len(chosen) < k:
            chosen.append({"index": min(losses, key=_reward_gain)["index"], "why": "largest actor loss"})
    for r in rows:
        if len(chosen) >= k:
            break
        if r["index"] not in {c["index"] for c in chosen}:
            chosen.append({"index": r["index"], "why": "in order"})
    return chosen


def _reward_gain(row: dict) -> float:
    return row["actor"]["reward"] - row["baseline"]["reward"]


def finite(obj: Any) -> Any:
    """NaN / inf -> None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
