"""`rlhfkit eval`: the step-3 actor against a baseline (usually the step-1 model) on held-out prompts.

One process, no DeepSpeed, CPU or one GPU. For every prompt each model samples
``--n_samples_per_prompt`` responses at temperature 1, top_p 1, top_k 0 (the policy's own
distribution; seeded, the same seed for both models) or, with ``--greedy``, one greedy response. The
responses are scored by the reward model (read at the last real token, as in steps 2 and 3) and/or a
reward function (its rows are the prompts' dataset rows), summed when both are given: the *reward*.
Each ``--judge`` (another reward model) scores every response too, on its own. Reported:

- per model: mean reward with a 95% confidence interval over prompts (Student t with n - 1 degrees of
  freedom, each prompt's value the mean over its samples), mean response length in tokens (EOS
  included), truncation rate (no EOS within ``--max_new_tokens``); per judge, its mean score the same way;
- actor vs baseline, pair by pair (actor sample j of a prompt against baseline sample j), by the reward
  and by each judge: wins / ties / losses (a tie: the same response, or scores within 1e-6), the win
  rate with ties as half and its percentile bootstrap interval over prompts (a prompt resampled with all
  its samples, 2000 resamples), the length-controlled win rate (logistic regression of the win on the
  length difference, predicted at equal lengths) with its bootstrap interval, and the paired reward
  difference with its t interval;
- KL(actor || baseline) on the actor's own samples: k3 = exp(d) - d - 1 per token, d = log p_baseline -
  log p_actor (never negative; unbiased on samples at temperature 1), summed over a response's tokens:
  per sequence the mean over responses, per token the total over the total number of response tokens
  (as step 3's ``eval/kl_per_token``); k1 (the log-ratio) likewise. With ``--greedy`` neither is a KL
  estimate, only a log-ratio on the greedy path.

Prompts: ``--prompts`` (any supported data path: all of its prompts, seeded shuffle, first ``--n``),
or by default the held-out step-3 prompts re-created from the actor's manifest (its data_path,
data_split, seed, eval_fraction, max_eval_samples, max_per_prompt), which neither model trained on.

Output (``--out``): ``report.md``, ``results.json`` (every number and one row per prompt and sample;
the same seed gives the same file), ``reward_hist.png``, ``reward_vs_length.png`` (and
``reward_pairs.png`` with a baseline).

The parts: :mod:`rlhfkit.eval_models` (checkpoints, generation, log-probabilities, rewards),
:mod:`rlhfkit.eval_prompts`, :mod:`rlhfkit.eval_stats` (pure statistics), :mod:`rlhfkit.eval_results`
(results.json), :mod:`rlhfkit.eval_render` (plots, report.md). This module runs them in order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rlhfkit.errors import ConfigError, RlhfkitError
from rlhfkit.program import silence_libraries

# Some of these names are imported only to stay importable from here, where they lived before the split.
from rlhfkit.eval_models import (  # noqa: F401
    ACTOR_STAGES, REWARD_STAGES, Responses, check_lm_dir, free_memory, generate, kl_sums, load_lm, load_reward_model,
    reward_fn_scores, reward_model_scores, token_logprobs, unpack,
)
from rlhfkit.eval_prompts import PromptSet, display_prompt, given_prompt_rows, held_out_prompt_rows, take_prompts  # noqa: F401
from rlhfkit.eval_render import (  # noqa: F401
    COLORS, EXAMPLE_CHARS, build_markdown, comparison_lines, headline_rows, headline_text, write_plots,
)
from rlhfkit.eval_results import build_results, finite, pick_examples  # noqa: F401
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
    judges: list[str] = field(default_factory=list)  # --judge DIR, repeatable: more reward models, each reported on its own
    prompts: list[str] = field(default_factory=list)  # empty: the actor's held-out step-3 prompts
    n: int = 64  # at most this many prompts
    out: str = "eval"
    seed: int = 1234  # prompt shuffle (--prompts), sampling and the bootstrap
    n_samples_per_prompt: int = 4  # sampled responses per prompt and model (temperature 1)
    greedy: bool = False  # one greedy response per prompt instead
    max_new_tokens: int = 128
    max_prompt_len: Optional[int] = None  # None: the actor's step-3 max_prompt_seq_len, else 512
    batch_size: int = 8  # sequences per generation / forward batch
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda
    examples: int = 4  # example pairs in report.md
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False

    @property
    def samples(self) -> int:
        """Responses per prompt and model: greedy responses would all be the same, so one."""
        return 1 if self.greedy else self.n_samples_per_prompt

    @property
    def decoding(self) -> str:
        if self.greedy:
            return "greedy, one response per prompt"
        return (f"sampling at temperature 1, top_p 1, top_k 0 (the policy's own distribution), "
                f"{self.n_samples_per_prompt} per prompt, seed {self.seed}")

    def validate(self) -> None:
        if not self.reward_model and not self.reward_fn:
            raise ConfigError("no reward: pass --reward_model DIR (a step-2 reward model) and/or --reward_fn NAME "
                              "(gsm8k or module.path:function); with both, the rewards are summed")
        for name, least in (("n", 1), ("n_samples_per_prompt", 1), ("max_new_tokens", 1), ("batch_size", 1), ("examples", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"--{name} must be >= {least}, got {getattr(self, name)}")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ConfigError(f"--max_prompt_len must be >= 1, got {self.max_prompt_len}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--dtype must be auto, fp32 or bf16, got {self.dtype}")
        twice = sorted({j for j in self.judges if self.judges.count(j) > 1})
        if twice:
            raise ConfigError(f"--judge {twice[0]} is given twice; each judge once")


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
    silence_libraries()

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
    gen = GenerationConfig(max_new_tokens=opts.max_new_tokens, do_sample=not opts.greedy, temperature=1.0, top_p=1.0, top_k=0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    # 3. Generate with each model, one model in memory at a time; the KL on the actor's responses.
    batches, kl = generate_all(opts, prompts, gen, tokenizer.pad_token_id, device, dtype, say)
    responses = {name: unpack(b, tokenizer) for name, b in batches.items()}

    # 4. Rewards (reward model and/or reward function, summed), then each judge on its own.
    rows = [ex.meta for ex in prompts.examples for _ in range(opts.samples)]
    parts = score_all(opts, reward_fn, batches, responses, rows, tokenizer, device, dtype, say)
    rewards = {name: [math.fsum(vals) for vals in zip(*parts[name].values())] for name in parts}
    judges = score_judges(opts, batches, tokenizer.pad_token_id, device, dtype, say)

    # 5. Numbers, files.
    results = build_results(opts, prompts, responses, parts, rewards, kl, judges, device, dtype)
    (out / "results.json").write_text(json.dumps(finite(results), indent=2, ensure_ascii=False, default=str) + "\n",
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
    others += [(judge, check_model_dir(judge, REWARD_STAGES, "--judge")) for judge in opts.judges]
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
                 say: Callable) -> tuple[dict[str, list], Optional[dict[str, list[float]]]]:
    """Each model's RolloutBatches (``opts.samples`` responses per prompt, a prompt's samples in a row;
    the same seed for both models), loading one model at a time; with a baseline, the KL sums of the
    actor's responses (:func:`rlhfkit.eval_models.kl_sums`, log-probabilities at temperature 1), else None."""
    models = {"actor": opts.actor, **({"baseline": opts.baseline} if opts.baseline else {})}
    features = [f for f in prompts.features for _ in range(opts.samples)]
    batches: dict[str, list] = {}
    logp: dict[str, list] = {}
    for name, path in models.items():
        say(f"{name}: generating {len(features)} responses to {len(prompts.features)} prompts on {device} ({dtype}, "
            f"{opts.decoding}, up to {opts.max_new_tokens} tokens) ...")
        model = load_lm(path, dtype, device, pad_id, trust_remote_code=opts.trust_remote_code,
                        allow_pickle=opts.allow_pickle_weights)
        batches[name] = generate(model, features, gen, opts.batch_size, pad_id, opts.seed)
        if opts.baseline:
            logp[name] = token_logprobs(model, batches["actor"], device)
        del model
        free_memory(device)
    return batches, (kl_sums(logp["actor"], logp["baseline"], batches["actor"]) if opts.baseline else None)


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


def score_judges(opts: EvalOptions, batches: dict[str, list], pad_id: int, device: str, dtype: str,
                 say: Callable) -> dict[str, dict[str, list[float]]]:
    """``{judge: {model: scores}}``: each ``--judge`` reward model on every response of every model, one judge
    in memory at a time."""
    out: dict[str, dict[str, list[float]]] = {}
    for judge in opts.judges:
        say(f"scoring with the judge {judge} ...")
        rm = load_reward_model(judge, dtype, device, pad_id, trust_remote_code=opts.trust_remote_code,
                               allow_pickle=opts.allow_pickle_weights)
        out[judge] = {name: reward_model_scores(rm, b, device) for name, b in batches.items()}
        del rm
        free_memory(device)
    return out


def _silent(*args: Any, **kwargs: Any) -> None:
    pass


def _device_and_dtype(opts: EvalOptions) -> tuple[str, str]:
    from rlhfkit.chat import pick_device

    device = pick_device(opts.device)
    return device, opts.dtype if opts.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")



__all__ = ["EvalOptions", "mean_ci", "outcome", "run_eval", "t_quantile", "win_stats", "kl_stats"]
