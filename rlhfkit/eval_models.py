"""The model side of ``rlhfkit eval``: check and load the checkpoints, generate, take the
log-probabilities of responses, score them with a reward model or a reward function. One process, no
DeepSpeed; one model in memory at a time."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.errors import CheckpointError

ACTOR_STAGES = ("sft", "base", "dpo", "actor")  # causal LMs that can generate
REWARD_STAGES = ("reward", "critic")  # sequence scorers


def check_lm_dir(path: str, role: str) -> dict:
    """The manifest of a directory that holds a causal LM (``role`` names the flag), else one clear error."""
    from rlhfkit.checkpoint import check_model_dir

    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        subs = [d for d in ("actor", "actor_ema") if (p / d / "config.json").exists()]
        if subs:
            raise CheckpointError(f"{role} {path}: a step-3 output directory; pass its policy: {role} {p / subs[0]}")
    return check_model_dir(path, ACTOR_STAGES, role)


def load_lm(path: str, dtype: str, device: str, pad_id: int, *, trust_remote_code: bool, allow_pickle: bool):
    """A causal LM in eval mode on ``device``, after the weights-format policy check."""
    from rlhfkit.models import check_weights_policy, load_model

    check_weights_policy(path, allow_pickle, trust_remote_code)
    model = load_model(path, "causal_lm", dtype=dtype, trust_remote_code=trust_remote_code,
                       allow_pickle=allow_pickle, pad_token_id=pad_id)
    return model.to(device).eval()


def load_reward_model(path: str, dtype: str, device: str, pad_id: int, *, trust_remote_code: bool, allow_pickle: bool):
    from rlhfkit.models import load_model

    return load_model(path, "reward", dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                      pad_token_id=pad_id).to(device).eval()


def free_memory(device: str) -> None:
    """Give back the memory of a model the caller has just dropped (``del model``) before the next loads."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


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
    empty: list[bool]  # EOS came first: nothing said


def unpack(batches: list, tokenizer: Any) -> Responses:
    from rlhfkit.rollout import empty_responses

    ids, tokens, truncated, empty = [], [], [], []
    for rb in batches:
        for row, mask, trunc in zip(rb.response_ids.tolist(), rb.action_mask.tolist(), rb.truncated.tolist()):
            n = int(sum(mask))
            ids.append(row[:n])
            tokens.append(n)
            truncated.append(bool(trunc))
        empty += empty_responses(rb.action_mask, rb.truncated).tolist()
    return Responses(ids, tokenizer.batch_decode(ids, skip_special_tokens=True), tokens, truncated, empty)


def token_logprobs(model: Any, batches: list, device: str) -> list:
    """Per batch, [B, A] fp64 log p_model(token) of each response token at temperature 1 (0 after EOS), on CPU."""
    import torch

    from rlhfkit.experience import actor_forward

    out = []
    with torch.no_grad():
        for rb in batches:
            lp, _ = actor_forward(model, rb.sequences.to(device), rb.attention_mask.to(device), rb.prompt_ids.shape[1], 1.0)
            out.append(lp.double().cpu() * rb.action_mask.double())
    return out


def kl_sums(actor_lp: list, baseline_lp: list, batches: list) -> dict[str, list[float]]:
    """Per response (the actor's own), summed over its tokens: ``k1`` = log p_actor - log p_baseline and ``k3``
    = exp(d) - d - 1 with d = log p_baseline - log p_actor (:func:`rlhfkit.algos.kl_estimate`), and the two
    log-probabilities ``logprob_actor`` / ``logprob_baseline``. On samples of the actor at temperature 1 both
    k1 and k3 are unbiased estimates of KL(actor || baseline); k3 is never negative."""
    from rlhfkit.algos import kl_estimate

    out: dict[str, list[float]] = {"k1": [], "k3": [], "logprob_actor": [], "logprob_baseline": []}
    for a, b, rb in zip(actor_lp, baseline_lp, batches):
        mask = rb.action_mask.double()
        out["k1"] += (kl_estimate(a, b, "k1") * mask).sum(-1).tolist()
        out["k3"] += (kl_estimate(a, b, "k3") * mask).sum(-1).tolist()
        out["logprob_actor"] += a.sum(-1).tolist()
        out["logprob_baseline"] += b.sum(-1).tolist()
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
