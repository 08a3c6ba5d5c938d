"""`rlhfkit eval`: the step-3 actor against a baseline (usually the step-1 model) on held-out prompts.

One process, no DeepSpeed, CPU or one GPU. For every prompt each model generates a response
(greedy by default; ``--temperature``/``--top_p`` sample, seeded per model); the responses are
scored by the reward model (read at the last real token, as in steps 2 and 3) and/or a reward
function (its rows are the prompts' dataset rows), summed when both are given. Reported:

- per model: mean reward with a 95% confidence interval (Student t with n - 1 degrees of freedom:
  mean +- t * s / sqrt(n)), mean response length in tokens (EOS included), truncation rate
  (no EOS within ``--max_new_tokens``);
- actor vs baseline, prompt by prompt: wins / ties / losses by reward (a tie: the same response,
  or rewards within 1e-6 of each other), and the paired reward difference with its t interval;
- KL(actor || baseline) on the actor's own responses: per sequence, the sum over response tokens
  of log p_actor - log p_baseline, averaged over prompts; per token, the total over all prompts
  divided by the total number of response tokens (as step 3's ``kl/per_token``). With greedy
  decoding this is the log-ratio on the actor's greedy responses (what step 3's held-out evaluation
  reports), not an unbiased KL estimate; sample (``--temperature 1``) for a Monte-Carlo estimate.
  When sampling, both log-probabilities are taken at the sampling temperature.

Prompts: ``--prompts`` (any supported data path: all of its prompts, seeded shuffle, first ``--n``),
or by default the held-out step-3 prompts re-created from the actor's manifest (its data_path,
data_split, seed, eval_fraction, max_eval_samples), which neither model trained on.

Output (``--out``): ``report.md``, ``results.json`` (every number and the per-prompt rows; the same
seed gives the same file), ``reward_hist.png``, ``reward_vs_length.png`` (and ``reward_pairs.png``
with a baseline).

The parts: :mod:`rlhfkit.eval_models` (checkpoints, generation, log-probabilities, rewards),
:mod:`rlhfkit.eval_prompts`, :mod:`rlhfkit.eval_stats` (pure statistics), :mod:`rlhfkit.eval_render`
(plots, report.md). This module runs them in order and assembles results.json.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rlhfkit.errors import ConfigError, RlhfkitError

# Some of these names are imported only to stay importable from here, where they lived before the split.
from rlhfkit.eval_models import (  # noqa: F401
    ACTOR_STAGES, REWARD_STAGES, Responses, check_lm_dir, free_memory, generate, load_lm, load_reward_model, response_logprobs,
    reward_fn_scores, reward_model_scores, unpack,
)
from rlhfkit.eval_prompts import PromptSet, display_prompt, given_prompt_rows, held_out_prompt_rows, take_prompts
from rlhfkit.eval_render import (  # noqa: F401
    COLORS, EXAMPLE_CHARS, build_markdown, comparison_lines, headline_rows, headline_text, write_plots,
)
from rlhfkit.eval_stats import (  # noqa: F401
    CI_LEVEL, CI_METHOD, TIE_TOL, kl_stats, mean_ci, outcome, t_cdf, t_quantile, win_stats,
)

DEFAULT_MAX_PROMPT_LEN = 512  # when neither --max_prompt_len nor the actor's step-3 config says


@dataclass
class EvalOptions:
    """What ``rlhfkit eval`` was asked for (one field per flag)."""

    actor: str
    baseline: Optional[str] = None
    reward_model: Optional[str] = None
    reward_fn: Optional[str] = None
    prompts: list[str] = field(default_factory=list)  # empty: the actor's held-out step-3 prompts
    n: int = 64  # at most this many prompts
    out: str = "eval"
    seed: int = 1234  # prompt shuffle (--prompts) and sampling
    max_new_tokens: int = 128
    max_prompt_len: Optional[int] = None  # None: the actor's step-3 max_prompt_seq_len, else 512
    greedy: bool = False  # greedy is the default anyway; the flag only forbids --temperature/--top_p
    temperature: Optional[float] = None  # given (or top_p given): sample
    top_p: Optional[float] = None
    batch_size: int = 8
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda
    examples: int = 4  # example pairs in report.md
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False

    @property
    def do_sample(self) -> bool:
        return self.temperature is not None or self.top_p is not None

    @property
    def sampling_temperature(self) -> float:
        return self.temperature if self.temperature is not None else 1.0

    @property
    def decoding(self) -> str:
        if not self.do_sample:
            return "greedy"
        return f"sampling (temperature {self.sampling_temperature}, top_p {self.top_p if self.top_p is not None else 1.0}, seed {self.seed})"

    def validate(self) -> None:
        if not self.reward_model and not self.reward_fn:
            raise ConfigError("no reward: pass --reward_model DIR (a step-2 reward model) and/or --reward_fn NAME "
                              "(gsm8k or module.path:function); with both, the rewards are summed")
        if self.greedy and self.do_sample:
            raise ConfigError("--greedy contradicts --temperature/--top_p: pass one or the other (greedy is the default)")
        if self.temperature is not None and self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}; leave it out for greedy decoding")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        for name, least in (("n", 1), ("max_new_tokens", 1), ("batch_size", 1), ("examples", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"--{name} must be >= {least}, got {getattr(self, name)}")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ConfigError(f"--max_prompt_len must be >= 1, got {self.max_prompt_len}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--dtype must be auto, fp32 or bf16, got {self.dtype}")


def options_from_args(args: Any) -> EvalOptions:
    return EvalOptions(**{k: getattr(args, k) for k in EvalOptions.__dataclass_fields__})



# ----------------------------------------------------------------------------------------------
# the run


def run_eval(opts: EvalOptions, echo: bool = True) -> Path:
    """Evaluate, write report.md, results.json and the plots into ``opts.out``; returns report.md's path."""
    from rlhfkit.rewards import load_reward_fn
    from rlhfkit.rollout import GenerationConfig

    say = print if echo else _silent
    opts.validate()
    _quiet()

    # 1. Checkpoints: stages, completeness, one tokenizer for all; the reward function; the output dir.
    actor_manifest, tokenizer = check_checkpoints(opts)
    reward_fn = load_reward_fn(opts.reward_fn) if opts.reward_fn else None
    out = Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RlhfkitError(f"eval: cannot create --out {out} ({e.strerror or e})") from None
    device, dtype = _device_and_dtype(opts)

    # 2. Prompts.
    prompts = load_prompts(opts, tokenizer, actor_manifest)
    say(f"prompts: {prompts.origin}\n  " + "\n  ".join(prompts.data + [prompts.tokenize]))
    gen = GenerationConfig(max_new_tokens=opts.max_new_tokens, do_sample=opts.do_sample, temperature=opts.sampling_temperature,
                           top_p=opts.top_p if opts.top_p is not None else 1.0, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)

    # 3. Generate with each model, one model in memory at a time; log-probs of the actor's responses under both.
    batches, logp = generate_all(opts, prompts, gen, tokenizer.pad_token_id, device, dtype, say)
    responses = {name: unpack(b, tokenizer) for name, b in batches.items()}

    # 4. Rewards: reward model and/or reward function, summed.
    parts = score_all(opts, reward_fn, batches, responses, [ex.meta for ex in prompts.examples], tokenizer, device, dtype, say)
    rewards = {name: [math.fsum(vals) for vals in zip(*parts[name].values())] for name in parts}

    # 5. Numbers, files.
    results = build_results(opts, prompts, responses, parts, rewards, logp, device, dtype)
    (out / "results.json").write_text(json.dumps(_finite(results), indent=2, ensure_ascii=False, default=str) + "\n",
                                      encoding="utf-8")
    plots = write_plots(results, out)
    report = out / "report.md"
    report.write_text(build_markdown(results, plots) + "\n", encoding="utf-8")
    if echo:
        print()
        print(headline_text(results))
        print(f"\nreport: {report}\nresults: {out / 'results.json'}\nplots: {', '.join(str(out / p) for _, p in plots)}")
    return report


def check_checkpoints(opts: EvalOptions) -> tuple[dict, Any]:
    """(the actor's manifest, its tokenizer) once every checkpoint has the right stage and is complete,
    and the token ids mean the same to every model (a tokenizer is loaded only without a hash)."""
    from rlhfkit.checkpoint import check_model_dir, check_same_tokenizer
    from rlhfkit.models import load_tokenizer

    actor_manifest = check_lm_dir(opts.actor, "--actor")
    tokenizer = load_tokenizer(opts.actor, opts.trust_remote_code, padding_side="left")
    others = []
    if opts.baseline:
        others.append((opts.baseline, check_lm_dir(opts.baseline, "--baseline")))
    if opts.reward_model:
        others.append((opts.reward_model, check_model_dir(opts.reward_model, REWARD_STAGES, "--reward_model")))
    for path, manifest in others:
        other_tok = None if manifest.get("tokenizer_sha256") else load_tokenizer(path, opts.trust_remote_code)
        check_same_tokenizer(opts.actor, actor_manifest, path, manifest, tokenizer, other_tok)
    return actor_manifest, tokenizer


def load_prompts(opts: EvalOptions, tokenizer: Any, actor_manifest: dict) -> PromptSet:
    """The evaluation prompts: ``--prompts`` (seeded shuffle, first n) or the actor's held-out step-3 prompts."""
    from rlhfkit.data import with_prompt_suffix

    config = (actor_manifest or {}).get("config") or {}
    max_len = opts.max_prompt_len or config.get("max_prompt_seq_len") or DEFAULT_MAX_PROMPT_LEN
    if opts.prompts:
        rows, sources, origin = given_prompt_rows(opts.prompts, opts.seed, opts.n)
    else:
        rows, sources, origin = held_out_prompt_rows(opts.actor, actor_manifest, opts.n)
    suffix = config.get("prompt_suffix")
    if suffix:  # the instruction step 3 added to every prompt (--prompt_suffix): the actor was trained with it
        rows = with_prompt_suffix(rows, suffix)
        origin += f"; step 3's --prompt_suffix {suffix!r} appended"
    examples, features, tok_line = take_prompts(rows, tokenizer, max_len, opts.n)
    return PromptSet(examples, features, origin, [s.summary() for s in sources], f"{tok_line} (max {max_len} tokens)")


def generate_all(opts: EvalOptions, prompts: PromptSet, gen: Any, pad_id: int, device: str, dtype: str,
                 say: Callable) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Each model's RolloutBatches, loading one model at a time; with a baseline, the log-probs of the
    actor's responses under both models (at the sampling temperature when sampling)."""
    models = {"actor": opts.actor, **({"baseline": opts.baseline} if opts.baseline else {})}
    temp = opts.sampling_temperature if opts.do_sample else 1.0
    batches: dict[str, list] = {}
    logp: dict[str, list[float]] = {}
    for name, path in models.items():
        say(f"{name}: generating {len(prompts.features)} responses on {device} ({dtype}, {opts.decoding}, "
            f"up to {opts.max_new_tokens} tokens) ...")
        model = load_lm(path, dtype, device, pad_id, trust_remote_code=opts.trust_remote_code,
                        allow_pickle=opts.allow_pickle_weights)
        batches[name] = generate(model, prompts.features, gen, opts.batch_size, pad_id, opts.seed)
        if opts.baseline:
            logp[name] = response_logprobs(model, batches["actor"], device, temp)
        del model
        free_memory(device)
    return batches, logp


def score_all(opts: EvalOptions, reward_fn: Any, batches: dict[str, list], responses: dict[str, Responses], rows: list[dict],
              tokenizer: Any, device: str, dtype: str, say: Callable) -> dict[str, dict[str, list[float]]]:
    """Per model, the reward model's scores (``reward_model``) and/or the reward function's (``reward_fn``)."""
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in batches}
    if opts.reward_model:
        say("scoring with the reward model ...")
        rm = load_reward_model(opts.reward_model, dtype, device, tokenizer.pad_token_id,
                               trust_remote_code=opts.trust_remote_code, allow_pickle=opts.allow_pickle_weights)
        for name in batches:
            parts[name]["reward_model"] = reward_model_scores(rm, batches[name], device)
        del rm
        free_memory(device)
    if reward_fn is not None:
        for name in batches:
            parts[name]["reward_fn"] = reward_fn_scores(opts.reward_fn, reward_fn, batches[name], responses[name], rows, tokenizer,
                                                        opts.batch_size)
    return parts


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def _device_and_dtype(opts: EvalOptions) -> tuple[str, str]:
    from rlhfkit.chat import pick_device

    device = pick_device(opts.device)
    return device, opts.dtype if opts.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")


def _quiet() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic
        pass


# ----------------------------------------------------------------------------------------------
# results.json


def build_results(opts: EvalOptions, prompts: PromptSet, responses: dict[str, Responses], parts: dict, rewards: dict,
                  logp: dict, device: str, dtype: str) -> dict:
    """results.json: the settings, the prompts' origin, per model the reward with its interval, length
    and truncation rate; with a baseline, wins / ties / losses, the paired difference and the KL; the
    example pairs and every per-prompt row."""
    names = list(responses)
    has_base = "baseline" in responses
    rows = []
    for i, ex in enumerate(prompts.examples):
        row: dict[str, Any] = {"index": i, "source": ex.meta.get("source"), "row": ex.meta.get("row"), "prompt": display_prompt(ex)}
        for name in names:
            r = responses[name]
            row[name] = {"response": r.texts[i], "tokens": r.tokens[i], "truncated": r.truncated[i], "reward": rewards[name][i],
                         **{k: v[i] for k, v in parts[name].items()}}
        if has_base:
            same = responses["actor"].ids[i] == responses["baseline"].ids[i]
            row["same_response"] = same
            row["outcome"] = outcome(rewards["actor"][i], rewards["baseline"][i], same)
            row["logprob_actor"] = logp["actor"][i]  # of the actor's response, summed over its tokens
            row["logprob_baseline"] = logp["baseline"][i]
            row["kl"] = logp["actor"][i] - logp["baseline"][i]
        rows.append(row)

    per_model = {}
    for name in names:
        r = responses[name]
        n = len(r.tokens)
        per_model[name] = {"path": os.path.abspath(getattr(opts, name)),
                           "reward": mean_ci(rewards[name]),
                           **{f"{k}_mean": math.fsum(v) / n for k, v in parts[name].items()},
                           "response_tokens_mean": sum(r.tokens) / n, "truncated_rate": sum(r.truncated) / n}
    results: dict[str, Any] = {
        "config": {**{k: v for k, v in asdict(opts).items() if k not in ("out",)}, "decoding": opts.decoding,
                   "device": device, "dtype": dtype},
        "prompts": {"count": len(rows), "origin": prompts.origin, "data": prompts.data, "tokenize": prompts.tokenize},
        "statistics": {"confidence_interval": CI_METHOD, "tie": f"identical responses, or |reward difference| <= {TIE_TOL}",
                       "kl": "log p_actor - log p_baseline summed over the actor's response tokens (EOS included); "
                             "per_sequence = mean over prompts, per_token = total / total response tokens"
                             + ("; log-probs at the sampling temperature" if opts.do_sample else
                                "; greedy responses: the log-ratio on them, not an unbiased KL estimate")},
        "models": per_model,
    }
    if has_base:
        diffs = [a - b for a, b in zip(rewards["actor"], rewards["baseline"])]
        results["comparison"] = {**win_stats([r["outcome"] for r in rows]), "reward_difference": mean_ci(diffs)}
        results["kl"] = kl_stats([r["kl"] for r in rows], responses["actor"].tokens)
    results["examples"] = pick_examples(rows, opts.examples, has_base)
    results["rows"] = rows
    return results


def pick_examples(rows: list[dict], k: int, has_base: bool) -> list[dict]:
    """Up to ``k`` (index, why): the actor's largest win and largest loss, then prompts in order."""
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
            chosen.append({"index": r["index"], "why": "in prompt order"})
    return chosen


def _reward_gain(row: dict) -> float:
    return row["actor"]["reward"] - row["baseline"]["reward"]


def _finite(obj: Any) -> Any:
    """NaN / inf -> None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


__all__ = ["EvalOptions", "mean_ci", "outcome", "run_eval", "t_quantile", "win_stats", "kl_stats"]
