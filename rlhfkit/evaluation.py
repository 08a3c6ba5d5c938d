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
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rlhfkit.errors import CheckpointError, ConfigError, DataError, RlhfkitError

ACTOR_STAGES = ("sft", "base", "dpo", "actor")  # causal LMs that can generate
REWARD_STAGES = ("reward", "critic")  # sequence scorers
CI_LEVEL = 0.95
CI_METHOD = "Student t (n - 1 degrees of freedom), 95%, two-sided: mean +- t * s / sqrt(n), s the sample std"
TIE_TOL = 1e-6  # rewards closer than this (or identical responses) are a tie
DEFAULT_MAX_PROMPT_LEN = 512  # when neither --max_prompt_len nor the actor's step-3 config says
EXAMPLE_CHARS = 1200  # longest prompt / response text shown in report.md


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
# statistics (pure Python: no scipy)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`); e.g. t_quantile(0.975, 9) = 2.2622."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile wants 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float], level: float = CI_LEVEL) -> dict:
    """Mean, sample std (n - 1) and the t confidence interval of ``values``; the interval is None when n < 2."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci_half_width": None, "ci_low": None, "ci_high": None}
    mean = math.fsum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "std": None, "ci_half_width": None, "ci_low": None, "ci_high": None}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_half_width": half, "ci_low": mean - half, "ci_high": mean + half}


def outcome(actor_reward: float, baseline_reward: float, same_response: bool) -> str:
    """``win`` / ``tie`` / ``loss`` of the actor on one prompt."""
    if same_response or abs(actor_reward - baseline_reward) <= TIE_TOL:
        return "tie"
    return "win" if actor_reward > baseline_reward else "loss"


def win_stats(outcomes: Sequence[str]) -> dict:
    n = len(outcomes)
    wins, ties, losses = (sum(o == k for o in outcomes) for k in ("win", "tie", "loss"))
    rate = (lambda k: k / n if n else None)
    return {"wins": wins, "ties": ties, "losses": losses, "win_rate": rate(wins), "tie_rate": rate(ties),
            "loss_rate": rate(losses), "win_rate_ties_half": rate(wins + 0.5 * ties),
            "win_rate_decided": wins / (wins + losses) if wins + losses else None}


def kl_stats(seq_kl: Sequence[float], tokens: Sequence[int]) -> dict:
    """KL per sequence (mean of the per-prompt sums) and per token (total / total response tokens)."""
    total_tokens = int(sum(tokens))
    return {"per_sequence": math.fsum(seq_kl) / len(seq_kl) if seq_kl else None,
            "per_token": math.fsum(seq_kl) / total_tokens if total_tokens else None,
            "tokens": total_tokens}


# ----------------------------------------------------------------------------------------------
# checkpoints and prompts


def check_lm_dir(path: str, role: str) -> dict:
    """The manifest of a directory that holds a causal LM (``role`` names the flag), else one clear error."""
    from rlhfkit.checkpoint import check_model_dir

    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        subs = [d for d in ("actor", "actor_ema") if (p / d / "config.json").exists()]
        if subs:
            raise CheckpointError(f"{role} {path}: a step-3 output directory; pass its policy: {role} {p / subs[0]}")
    return check_model_dir(path, ACTOR_STAGES, role)


@dataclass
class PromptSet:
    examples: list  # [N] Example, in evaluation order
    features: list[dict]  # [N] {"prompt_ids", "index"} (index into examples)
    origin: str  # where they come from, in words
    data: list[str]  # one summary line per source
    tokenize: str  # what tokenisation kept / cut / dropped


def _display_prompt(ex: Any) -> str:
    from rlhfkit.data.tokenize import plain_prompt_text

    msgs = [m for m in ex.prompt if m["role"] != "system"]
    if len(msgs) == 1:
        return msgs[0]["content"]
    return plain_prompt_text(ex.prompt)[: -len("Assistant:")].rstrip()


def _take(rows: list, tokenizer: Any, max_len: int, n: int) -> tuple[list, list[dict], str]:
    """The first ``n`` rows that survive tokenisation (chunk by chunk, so a large file is not all tokenised)."""
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


def load_prompts(opts: EvalOptions, tokenizer: Any, actor_manifest: dict) -> PromptSet:
    """The evaluation prompts: ``--prompts`` (seeded shuffle, first n) or the actor's held-out step-3 prompts."""
    from rlhfkit.data import load_phase_data, with_prompt_suffix

    config = (actor_manifest or {}).get("config") or {}
    max_len = opts.max_prompt_len or config.get("max_prompt_seq_len") or DEFAULT_MAX_PROMPT_LEN
    if opts.prompts:
        train, _, sources = load_phase_data(opts.prompts, phase=3, need="prompts", data_split="0,0,1", seed=opts.seed,
                                            eval_fraction=0.0)
        rows = list(train)
        random.Random(opts.seed).shuffle(rows)  # blended sources: shuffle across them too
        origin = f"{', '.join(opts.prompts)} (all prompts, shuffled with seed {opts.seed}, first {opts.n})"
    else:
        if actor_manifest.get("stage") != "actor" or not config.get("data_path"):
            raise ConfigError(
                f"--actor {opts.actor}: a '{actor_manifest.get('stage')}' checkpoint without a step-3 data config, so its "
                "held-out prompts cannot be re-created; pass --prompts DATA")
        data_path = config["data_path"]
        try:
            _, rows, sources = load_phase_data(data_path, phase=3, need="prompts", data_split=config.get("data_split", "2,4,4"),
                                               seed=config.get("seed", 1234), eval_fraction=config.get("eval_fraction", 0.05),
                                               strict=bool(config.get("strict", False)), max_eval=config.get("max_eval_samples"))
        except DataError as e:
            raise DataError(f"the held-out step-3 prompts of --actor {opts.actor} (data {data_path} from its manifest) "
                            f"cannot be re-created: {e} Pass --prompts DATA instead.") from None
        if not rows:
            raise DataError(f"--actor {opts.actor}: step 3 held out no prompts (eval_fraction {config.get('eval_fraction')}, "
                            f"max_eval_samples {config.get('max_eval_samples')}); pass --prompts DATA")
        origin = (f"held-out step-3 prompts of {', '.join(map(str, data_path if isinstance(data_path, list) else [data_path]))} "
                  f"(data_split {config.get('data_split')}, seed {config.get('seed')}, eval_fraction "
                  f"{config.get('eval_fraction')}, max_eval_samples {config.get('max_eval_samples')}; first {opts.n})")
    suffix = config.get("prompt_suffix")
    if suffix:  # the instruction step 3 added to every prompt (--prompt_suffix): the actor was trained with it
        rows = with_prompt_suffix(rows, suffix)
        origin += f"; step 3's --prompt_suffix {suffix!r} appended"
    examples, features, tok_line = _take(rows, tokenizer, max_len, opts.n)
    return PromptSet(examples, features, origin, [s.summary() for s in sources], f"{tok_line} (max {max_len} tokens)")


# ----------------------------------------------------------------------------------------------
# generation, log-probabilities, rewards


def _free(model: Any, device: str) -> None:
    del model
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _load_lm(path: str, opts: EvalOptions, dtype: str, device: str, pad_id: int):
    from rlhfkit.models import check_weights_policy, load_model

    check_weights_policy(path, opts.allow_pickle_weights, opts.trust_remote_code)
    model = load_model(path, "causal_lm", dtype=dtype, trust_remote_code=opts.trust_remote_code,
                       allow_pickle=opts.allow_pickle_weights, pad_token_id=pad_id)
    return model.to(device).eval()


def generate(model: Any, features: list[dict], gen: Any, batch_size: int, pad_id: int, seed: int) -> list:
    """RolloutBatches (on CPU) for ``features`` in order, ``batch_size`` prompts each."""
    import torch

    from rlhfkit.data import collate_prompts
    from rlhfkit.rollout import PromptBatch, make_rollout_engine

    engine = make_rollout_engine("hf", model)
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(features), batch_size):
        b = collate_prompts(features[start:start + batch_size], pad_id)
        rb = engine.generate(PromptBatch(b["input_ids"], b["attention_mask"]), gen)
        for name in ("prompt_ids", "prompt_mask", "response_ids", "action_mask", "truncated"):
            setattr(rb, name, getattr(rb, name).cpu())
        out.append(rb)
    return out


@dataclass
class Responses:
    """One model's responses, per prompt."""

    ids: list[list[int]]  # response tokens up to and including EOS
    texts: list[str]  # decoded, special tokens skipped
    tokens: list[int]
    truncated: list[bool]


def unpack(batches: list, tokenizer: Any) -> Responses:
    ids, tokens, truncated = [], [], []
    for rb in batches:
        for row, mask, trunc in zip(rb.response_ids.tolist(), rb.action_mask.tolist(), rb.truncated.tolist()):
            n = int(sum(mask))
            ids.append(row[:n])
            tokens.append(n)
            truncated.append(bool(trunc))
    return Responses(ids, tokenizer.batch_decode(ids, skip_special_tokens=True), tokens, truncated)


def response_logprobs(model: Any, batches: list, device: str, temperature: float) -> list[float]:
    """Sum over response tokens of log p_model(token), per sequence (fp64 sums of fp32 log-probs)."""
    import torch

    from rlhfkit.experience import actor_forward

    out: list[float] = []
    with torch.no_grad():
        for rb in batches:
            lp, _ = actor_forward(model, rb.sequences.to(device), rb.attention_mask.to(device), rb.prompt_ids.shape[1], temperature)
            out += (lp.double() * rb.action_mask.to(lp.device).double()).sum(-1).tolist()
    return out


def reward_model_scores(model: Any, batches: list, device: str) -> list[float]:
    import torch

    from rlhfkit.models import sequence_scores

    out: list[float] = []
    with torch.no_grad():
        for rb in batches:
            out += sequence_scores(model, rb.sequences.to(device), rb.attention_mask.to(device)).float().cpu().tolist()
    return out


def reward_fn_scores(name: str, fn: Any, batches: list, responses: Responses, rows: list[dict], tokenizer: Any,
                     batch_size: int) -> list[float]:
    """The reward function on (decoded prompt, decoded response, dataset row), as step 3 calls it."""
    from rlhfkit.rewards import call_reward_fn

    prompts = [t for rb in batches for t in tokenizer.batch_decode(rb.prompt_ids, skip_special_tokens=True)]
    out: list[float] = []
    for s in range(0, len(prompts), batch_size):
        out += call_reward_fn(name, fn, prompts[s:s + batch_size], responses.texts[s:s + batch_size], rows[s:s + batch_size])
    return out


# ----------------------------------------------------------------------------------------------
# the run


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


def run_eval(opts: EvalOptions, echo: bool = True) -> Path:
    """Evaluate, write report.md, results.json and the plots into ``opts.out``; returns report.md's path."""
    from rlhfkit.checkpoint import check_model_dir, check_same_tokenizer
    from rlhfkit.models import load_model, load_tokenizer
    from rlhfkit.rewards import load_reward_fn
    from rlhfkit.rollout import GenerationConfig

    say = print if echo else (lambda *a, **k: None)
    opts.validate()
    _quiet()

    # 1. Checkpoints: stages, completeness, one tokenizer for all; the reward function; the output dir.
    actor_manifest = check_lm_dir(opts.actor, "--actor")
    tokenizer = load_tokenizer(opts.actor, opts.trust_remote_code, padding_side="left")
    others = []
    if opts.baseline:
        others.append((opts.baseline, check_lm_dir(opts.baseline, "--baseline")))
    if opts.reward_model:
        others.append((opts.reward_model, check_model_dir(opts.reward_model, REWARD_STAGES, "--reward_model")))
    for path, manifest in others:  # token ids must mean the same to every model (a tokenizer is loaded only without a hash)
        other_tok = None if manifest.get("tokenizer_sha256") else load_tokenizer(path, opts.trust_remote_code)
        check_same_tokenizer(opts.actor, actor_manifest, path, manifest, tokenizer, other_tok)
    reward_fn = load_reward_fn(opts.reward_fn) if opts.reward_fn else None
    out = Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RlhfkitError(f"eval: cannot create --out {out} ({e.strerror or e})") from None
    device, dtype = _device_and_dtype(opts)

    # 2. Prompts.
    prompts = load_prompts(opts, tokenizer, actor_manifest)
    rows = [ex.meta for ex in prompts.examples]
    say(f"prompts: {prompts.origin}\n  " + "\n  ".join(prompts.data + [prompts.tokenize]))
    pad = tokenizer.pad_token_id
    gen = GenerationConfig(max_new_tokens=opts.max_new_tokens, do_sample=opts.do_sample, temperature=opts.sampling_temperature,
                           top_p=opts.top_p if opts.top_p is not None else 1.0, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=pad)
    temp = opts.sampling_temperature if opts.do_sample else 1.0

    # 3. Generate with each model, one model in memory at a time; log-probs of the actor's responses under both.
    models = {"actor": opts.actor, **({"baseline": opts.baseline} if opts.baseline else {})}
    batches: dict[str, list] = {}
    logp: dict[str, list[float]] = {}
    for name, path in models.items():
        say(f"{name}: generating {len(prompts.features)} responses on {device} ({dtype}, {opts.decoding}, "
            f"up to {opts.max_new_tokens} tokens) ...")
        model = _load_lm(path, opts, dtype, device, pad)
        batches[name] = generate(model, prompts.features, gen, opts.batch_size, pad, opts.seed)
        if opts.baseline:
            logp[name] = response_logprobs(model, batches["actor"], device, temp)
        _free(model, device)
    responses = {name: unpack(b, tokenizer) for name, b in batches.items()}

    # 4. Rewards: reward model and/or reward function, summed.
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    if opts.reward_model:
        say("scoring with the reward model ...")
        rm = load_model(opts.reward_model, "reward", dtype=dtype, trust_remote_code=opts.trust_remote_code,
                        allow_pickle=opts.allow_pickle_weights, pad_token_id=pad).to(device).eval()
        for name in models:
            parts[name]["reward_model"] = reward_model_scores(rm, batches[name], device)
        _free(rm, device)
    if reward_fn is not None:
        for name in models:
            parts[name]["reward_fn"] = reward_fn_scores(opts.reward_fn, reward_fn, batches[name], responses[name], rows, tokenizer,
                                                        opts.batch_size)
    rewards = {name: [math.fsum(vals) for vals in zip(*parts[name].values())] for name in models}

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


def build_results(opts: EvalOptions, prompts: PromptSet, responses: dict[str, Responses], parts: dict, rewards: dict,
                  logp: dict, device: str, dtype: str) -> dict:
    names = list(responses)
    has_base = "baseline" in responses
    rows = []
    for i, ex in enumerate(prompts.examples):
        row: dict[str, Any] = {"index": i, "source": ex.meta.get("source"), "row": ex.meta.get("row"), "prompt": _display_prompt(ex)}
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
        diff = lambda r: r["actor"]["reward"] - r["baseline"]["reward"]  # noqa: E731
        wins = [r for r in rows if r["outcome"] == "win"]
        losses = [r for r in rows if r["outcome"] == "loss"]
        if wins:
            chosen.append({"index": max(wins, key=diff)["index"], "why": "largest actor win"})
        if losses and len(chosen) < k:
            chosen.append({"index": min(losses, key=diff)["index"], "why": "largest actor loss"})
    for r in rows:
        if len(chosen) >= k:
            break
        if r["index"] not in {c["index"] for c in chosen}:
            chosen.append({"index": r["index"], "why": "in prompt order"})
    return chosen


def _finite(obj: Any) -> Any:
    """NaN / inf -> None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# plots and report


COLORS = {"actor": "#1f77b4", "baseline": "#ff7f0e"}


def write_plots(results: dict, out: Path) -> list[tuple[str, str]]:
    """(title, file) of each PNG written into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, names = results["rows"], list(results["models"])
    rewards = {n: np.array([r[n]["reward"] for r in rows], dtype=float) for n in names}
    plots = []

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        both = np.concatenate(list(rewards.values()))
        lo, hi = float(both.min()), float(both.max())
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, min(30, max(6, int(math.sqrt(len(both))) + 1)) + 1)
        for n in names:
            ax.hist(rewards[n], bins=edges, alpha=0.5, color=COLORS[n], edgecolor=COLORS[n], label=f"{n} (mean {rewards[n].mean():.4g})")
            ax.axvline(rewards[n].mean(), color=COLORS[n], linestyle="--", linewidth=1.5)
        ax.set_title(f"Reward distribution ({len(rows)} prompts)")
        ax.set_xlabel("reward")
        ax.set_ylabel("prompts")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "reward_hist.png")
        plots.append(("Reward distribution", "reward_hist.png"))
    finally:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        for n in names:
            tokens = [r[n]["tokens"] for r in rows]
            ax.scatter(tokens, rewards[n], s=18, alpha=0.7, color=COLORS[n], label=n,
                       marker="o" if n == "actor" else "^")
        ax.set_title("Reward vs response length")
        ax.set_xlabel("response tokens")
        ax.set_ylabel("reward")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "reward_vs_length.png")
        plots.append(("Reward vs response length", "reward_vs_length.png"))
    finally:
        plt.close(fig)

    if "baseline" in names:
        fig, ax = plt.subplots(figsize=(5, 5), dpi=110)
        try:
            colors = {"win": "#2ca02c", "tie": "#7f7f7f", "loss": "#d62728"}
            for kind, color in colors.items():
                pts = [(r["baseline"]["reward"], r["actor"]["reward"]) for r in rows if r["outcome"] == kind]
                if pts:
                    xs, ys = zip(*pts)
                    ax.scatter(xs, ys, s=18, alpha=0.8, color=color, label=f"{kind} ({len(pts)})")
            both = np.concatenate([rewards["actor"], rewards["baseline"]])
            lo, hi = float(both.min()), float(both.max())
            pad = max(hi - lo, 1.0) * 0.05
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="black", linewidth=0.8, linestyle=":")
            ax.set_title("Reward per prompt: actor vs baseline")
            ax.set_xlabel("baseline reward")
            ax.set_ylabel("actor reward")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best", fontsize=8)
            fig.tight_layout()
            fig.savefig(out / "reward_pairs.png")
            plots.append(("Reward per prompt: actor vs baseline", "reward_pairs.png"))
        finally:
            plt.close(fig)
    return plots


def _fmt(v: Optional[float]) -> str:
    from rlhfkit.report import fmt

    return fmt(v)


def _reward_cell(stats: dict) -> str:
    if stats["ci_half_width"] is None:
        return f"{_fmt(stats['mean'])} (n = {stats['n']}, no interval)"
    return f"{_fmt(stats['mean'])} ± {_fmt(stats['ci_half_width'])} [{_fmt(stats['ci_low'])}, {_fmt(stats['ci_high'])}]"


def headline_rows(results: dict) -> list[tuple[str, str, str, str]]:
    return [(name, _reward_cell(m["reward"]), _fmt(m["response_tokens_mean"]), f"{100 * m['truncated_rate']:.1f}%")
            for name, m in results["models"].items()]


def comparison_lines(results: dict) -> list[str]:
    if "comparison" not in results:
        return []
    c, kl, n = results["comparison"], results["kl"], results["prompts"]["count"]
    d = c["reward_difference"]
    return [
        f"win rate (actor over baseline): {_fmt(c['win_rate'])} — wins {c['wins']}, ties {c['ties']}, losses {c['losses']} "
        f"of {n} (ties as half: {_fmt(c['win_rate_ties_half'])})",
        f"reward difference (actor - baseline, paired): {_reward_cell(d)}",
        f"KL(actor || baseline): {_fmt(kl['per_token'])} per token, {_fmt(kl['per_sequence'])} per sequence "
        f"({kl['tokens']} actor response tokens)",
    ]


def headline_text(results: dict) -> str:
    header = ("model", f"mean reward ± {int(CI_LEVEL * 100)}% CI", "length (tokens)", "truncated")
    table = [header] + headline_rows(results)
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + comparison_lines(results))


def _fence(text: str) -> str:
    longest = max((len(run) for run in text.split("\n") for run in _backtick_runs(run)), default=0)
    ticks = "`" * max(3, longest + 1)
    shown = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + " [...]"
    return f"{ticks}text\n{shown}\n{ticks}"


def _backtick_runs(line: str) -> list[str]:
    import re

    return re.findall(r"`+", line)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def build_markdown(results: dict, plots: list[tuple[str, str]]) -> str:
    cfg, names = results["config"], list(results["models"])
    lines = ["# rlhfkit evaluation", ""]
    lines += [f"- actor: `{results['models']['actor']['path']}`"]
    if "baseline" in results["models"]:
        lines += [f"- baseline: `{results['models']['baseline']['path']}`"]
    reward = " + ".join(x for x in (f"reward model `{cfg['reward_model']}`" if cfg["reward_model"] else "",
                                    f"reward function `{cfg['reward_fn']}`" if cfg["reward_fn"] else "") if x)
    lines += [f"- reward: {reward}",
              f"- prompts: {results['prompts']['count']}, {_md(results['prompts']['origin'])}",
              f"- decoding: {cfg['decoding']}, up to {cfg['max_new_tokens']} new tokens; {cfg['device']}, {cfg['dtype']}",
              "", "| Model | Mean reward ± 95% CI | Response length (tokens) | Truncated |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in headline_rows(results)]
    lines.append("")
    for name in names:
        extra = [f"{k} {_fmt(v)}" for k, v in results["models"][name].items() if k in ("reward_model_mean", "reward_fn_mean")]
        if len(extra) == 2:
            lines.append(f"- {name} reward components (means): {', '.join(extra)}")
    if "comparison" in results:
        c, kl = results["comparison"], results["kl"]
        lines += ["", "## Actor vs baseline", "", "| Wins | Ties | Losses | Win rate | Win rate (ties as half) |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {c['wins']} | {c['ties']} | {c['losses']} | {_fmt(c['win_rate'])} | {_fmt(c['win_rate_ties_half'])} |", "",
                  f"- reward difference (actor - baseline, paired): {_reward_cell(c['reward_difference'])}",
                  f"- KL(actor ‖ baseline) per token: {_fmt(kl['per_token'])}",
                  f"- KL(actor ‖ baseline) per sequence: {_fmt(kl['per_sequence'])} ({kl['tokens']} actor response tokens)"]
    st = results["statistics"]
    lines += ["", f"Confidence intervals: {st['confidence_interval']}. Ties: {st['tie']}."]
    if "comparison" in results:
        lines += [f"KL: {st['kl']}."]
    lines += ["", "## Plots", ""] + [f"![{t}]({f})\n" for t, f in plots]
    lines += ["## Examples", ""]
    by_index = {r["index"]: r for r in results["rows"]}
    for ex in results["examples"]:
        r = by_index[ex["index"]]
        lines += [f"### Prompt {r['index']} ({ex['why']})", "", _fence(r["prompt"]), ""]
        for name in names:
            m = r[name]
            comps = [f"{k} {_fmt(m[k])}" for k in ("reward_model", "reward_fn") if k in m]
            lines += [f"**{name}** — reward {_fmt(m['reward'])}" + (f" ({', '.join(comps)})" if len(comps) == 2 else "")
                      + f", {m['tokens']} tokens{', truncated' if m['truncated'] else ''}", "", _fence(m["response"]), ""]
        if "outcome" in r:
            lines += [f"Outcome: actor {r['outcome']}; log p_actor - log p_baseline = {_fmt(r['kl'])}", ""]
    lines += ["", "Per-prompt rows, every number and the settings: `results.json`."]
    return "\n".join(lines)


__all__ = ["EvalOptions", "mean_ci", "outcome", "run_eval", "t_quantile", "win_stats", "kl_stats"]
