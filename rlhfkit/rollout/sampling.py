"""Generation on a Hugging Face causal LM for the ``hf`` and ``hf-synced`` rollout backends.

:func:`hf_generate` turns prompts into a :class:`~rlhfkit.rollout.base.RolloutBatch`. Rank-local, it
runs :func:`decode`, the sampling loop: KV-cached decoding with exactly the semantics of
``generate(do_sample, temperature, top_k, top_p, min_new_tokens, eos_token_id, pad_token_id)``,
minus costs that matter on small models:

- ``torch.multinomial`` draws one exponential variate per vocabulary entry (49k for SmolLM2), a
  visible share of a small model's decode step. :func:`sample_from_probs` inverts the cumulative
  distribution with one uniform per row instead: the same distribution.
- Rows with the same prompt (a group of ``--n_samples_per_prompt``) are prefilled once and their KV
  cache is copied to the other rows of the group.
- On the CPU, bf16 linear layers run from weights reordered once per call into oneDNN's blocked
  layout (:func:`~rlhfkit.rollout.packing.packed_linears`): the same results, bit for bit, without
  oneDNN reordering every weight matrix at every token (fp32 copies on CPUs without bf16 kernels).
- The loop runs in ``torch.inference_mode`` (less bookkeeping per operation than ``no_grad``) unless
  the model is ZeRO-3 partitioned, whose hooks gather weights inside the forward: tensors made in
  inference mode must not become parameters the training step updates.
- Llama-architecture models on the CPU decode through :func:`~rlhfkit.rollout.fast_decode.llama_decoder`
  after the prefill: the model's own layers and the same logits, without transformers' per-call
  machinery around them. Given a ``group`` of ranks on one host (the ``hf`` backend under ZeRO-3),
  they share those steps (:mod:`~rlhfkit.rollout.shared_decode`): each rank streams a share of the
  weights for every rank's rows, and keeps stepping after its own rows end until the group's have.

Greedy decoding returns exactly the tokens of ``generate(do_sample=False)`` (tested against it); the
processors are transformers' own (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``), in ``generate``'s order, after EOS suppression for ``min_new_tokens``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional, Union

import torch

from rlhfkit.models.gathered import hf_model_of, is_zero3_partitioned
from rlhfkit.models.attention import position_ids  # generate's positions: the real tokens of a left-padded row count from 0
from rlhfkit.rollout.base import GenerationConfig, PromptBatch, RolloutBatch, postprocess
from rlhfkit.rollout.fast_decode import Step, llama_decoder
from rlhfkit.rollout.packing import packed_linears
from rlhfkit.rollout.shared_decode import DecodeGroup, SharedDecoder


def hf_generate(module: torch.nn.Module, prompts: PromptBatch, gen: GenerationConfig, device: torch.device,
                synced_gpus: bool, group: Optional[DecodeGroup] = None) -> RolloutBatch:
    """Sample ``prompts`` with exactly ``gen`` on a Hugging Face causal LM, then :func:`~rlhfkit.rollout.base.postprocess`.

    Rank-local generation runs :func:`decode` (``generate``'s semantics, faster sampling, one
    prefill per distinct prompt). ``synced_gpus=True`` (every rank keeps stepping until all are
    done: ZeRO-3 forwards are collective) runs ``module.generate``; ``synced_gpus`` is always passed
    to it explicitly: transformers would otherwise turn it on by itself whenever an
    ``HfDeepSpeedConfig`` with ZeRO-3 is alive and world size > 1. ``group``: the ranks that share
    their decode steps (:mod:`~rlhfkit.rollout.shared_decode`; every rank of it calls this together).
    """
    input_ids = prompts.input_ids.to(device)
    attention_mask = prompts.attention_mask.to(device)
    P = input_ids.shape[1]
    if not synced_gpus:
        new = decode(module, hf_model_of(module), input_ids, attention_mask, gen, group)
        return postprocess(input_ids, attention_mask, new, gen.eos_ids, gen.pad_token_id)
    with isolated_generation_config(hf_model_of(module)), torch.no_grad():
        out = module.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen.to_hf(),
                              synced_gpus=synced_gpus)
    sequences = out.sequences if hasattr(out, "sequences") else out
    return postprocess(input_ids, attention_mask, sequences[:, P:], gen.eos_ids, gen.pad_token_id)


@contextlib.contextmanager
def isolated_generation_config(hf_model: torch.nn.Module) -> Iterator[None]:
    """Hide the model's own ``generation_config`` while it generates.

    transformers fills every field our config leaves unset from ``model.generation_config`` (a saved
    ``temperature=0.2``, ``top_k=50``, ``repetition_penalty`` ...); an empty one leaves only
    transformers' neutral global defaults.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    saved = getattr(hf_model, "generation_config", None)
    hf_model.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = saved


def sample_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows need not be normalised) -> [B] long.

    Inverse-CDF sampling: the first index whose cumulative mass exceeds ``u * total``, u uniform in
    [0, 1), kept strictly below the total so that an entry of zero probability is never returned
    (its cumulative mass equals its left neighbour's).
    """
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def warpers(temperature: float, top_k: int, top_p: float) -> list:
    """transformers' sampling warpers for these settings, in ``generate``'s order (none when neutral)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: list = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def _forward_kwargs(hf_model: torch.nn.Module) -> tuple[str, bool]:
    """(the forward's name for the KV cache, whether it takes logits_to_keep): transformers 5 calls
    the cache ``cache``, 4.x ``past_key_values``."""
    params = inspect.signature(hf_model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _new_cache(hf_model: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=hf_model.config)  # sliding-window layers where the config has them
    except TypeError:
        return DynamicCache()


def decode(module: torch.nn.Module, hf_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           gen: GenerationConfig, group: Optional[DecodeGroup] = None) -> torch.Tensor:
    """Generate with ``gen`` after left-padded prompts ``input_ids`` [B, P] -> the new tokens [B, G],
    G <= gen.max_new_tokens (``gen.pad_token_id`` after a row's first EOS; the loop stops when every
    row has one).

    ``module`` is called (a plain or peft model); ``hf_model`` is the transformers model under it.
    Positions skip the left padding as in ``generate``. bf16 CPU layers run packed (:func:`packed_linears`).
    In inference mode unless ``module`` is ZeRO-3 partitioned; the tokens returned are ordinary tensors.
    """
    grad_off = torch.no_grad() if is_zero3_partitioned(module) else torch.inference_mode()
    with grad_off, packed_linears(module, input_ids.shape[0]):
        new = _decode(module, hf_model, input_ids, attention_mask, gen, group)
    return new.clone()


def _decode(module: torch.nn.Module, hf_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            gen: GenerationConfig, group: Optional[DecodeGroup]) -> torch.Tensor:
    B = input_ids.shape[0]
    dev = input_ids.device
    cache_kw, has_keep = _forward_kwargs(hf_model)
    keep = {"logits_to_keep": 1} if has_keep else {}
    eos = torch.tensor(gen.eos_ids, dtype=torch.long, device=dev)
    steps = warpers(gen.temperature, gen.top_k, gen.top_p) if gen.do_sample else []
    cache = _new_cache(hf_model)

    # prefill: each distinct prompt once, then its KV cache and logits copied to its rows
    P = input_ids.shape[1]
    distinct, inverse = torch.unique_consecutive(torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1), dim=0,
                                                 return_inverse=True)
    prompt_mask = distinct[:, P:].to(attention_mask.dtype)
    padded = not bool(attention_mask.all())  # without padding no mask at all, as generate does (no 4D mask built per step)
    out = module(input_ids=distinct[:, :P], attention_mask=prompt_mask if padded else None, position_ids=position_ids(prompt_mask),
                 use_cache=True, **{cache_kw: cache}, **keep)
    logits = out.logits[:, -1].float()
    if len(distinct) < B:
        cache.reorder_cache(inverse)
        logits = logits[inverse]
    del out

    mask, pos = attention_mask, position_ids(attention_mask)[:, -1:]
    fast = _fast_step(hf_model, cache, P + gen.max_new_tokens, group) if gen.max_new_tokens > 1 else None
    if fast is not None:
        del cache  # its KV now lives in the decoder's buffers
    unfinished = torch.ones(B, dtype=torch.bool, device=dev)
    tokens, done = [], False
    for t in range(gen.max_new_tokens):
        if done:  # this rank's rows have all ended while the group's others decode on: padding, nothing drawn
            nxt = torch.full((B,), gen.pad_token_id, dtype=torch.long, device=dev)
        else:
            nxt = _next_tokens(logits, t, eos, gen, steps)
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, gen.pad_token_id))
            tokens.append(nxt)
            unfinished &= ~torch.isin(nxt, eos)
            done = not bool(unfinished.any())
        going_on = fast.running(nxt, done) if isinstance(fast, SharedDecoder) else not done
        if t + 1 == gen.max_new_tokens or not going_on:
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1) if padded else None
        pos = pos + 1
        if fast is not None:
            logits = fast(nxt, pos, None if mask is None else mask[:, None, None, :].bool())
            continue
        out = module(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache}, **keep)
        logits = out.logits[:, -1].float()
        del out
    return torch.stack(tokens, dim=1) if tokens else input_ids.new_zeros((B, 0))


def _next_tokens(logits: torch.Tensor, t: int, eos: torch.Tensor, gen: GenerationConfig, steps: list) -> torch.Tensor:
    """The token each row takes at new position ``t`` from its ``logits`` [B, V]: EOS suppressed below
    ``min_new_tokens``, then sampled through the warpers ``steps``, or greedy."""
    if t < gen.min_new_tokens:
        logits[:, eos] = float("-inf")
    if not gen.do_sample:
        return logits.argmax(dim=-1)
    for warp in steps:
        logits = warp(None, logits)
    return sample_from_probs(torch.softmax(logits, dim=-1))


def _fast_step(hf_model: torch.nn.Module, cache: Any, capacity: int,
               group: Optional[DecodeGroup]) -> Union[Step, SharedDecoder, None]:
    """The decode step after the prefill: shared by the ``group`` of ranks, or this rank's own fast step
    (None where the model is not one the fast step handles: its own forward then)."""
    if group is not None:
        return SharedDecoder(hf_model, cache, capacity, group)
    return llama_decoder(hf_model, cache, capacity)
