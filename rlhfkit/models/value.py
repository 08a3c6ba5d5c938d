"""Per-token values and sequence scores from a one-label ``AutoModelForSequenceClassification``.

The score of a sequence is read at its last real token (``rlhfkit.algos.last_real_token_index``:
the EOS that ends the response when there is one, else the last token before padding) — the one
rule shared by step 2 (reward model), step 3 (reward and critic) and the scoring command; it is
the token Hugging Face's own pooling reads when pads are exactly the masked positions, so an
exported reward model scores the same in plain transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.algos import gather_last_real


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding ([B, T]): the same positions ``generate`` uses, so a forward
    pass over a left-padded prompt + response sees what the sampler saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _unwrap(model: Any) -> Any:
    model = getattr(model, "module", model)  # DeepSpeed engine
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def score_head(model: Any) -> torch.nn.Module:
    base = _unwrap(model)
    for name in ("score", "classifier", "v_head"):
        head = getattr(base, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise TypeError(f"{type(base).__name__} has no score head (expected a one-label AutoModelForSequenceClassification)")


def _head_outputs(model: Any, **inputs: torch.Tensor) -> torch.Tensor:
    """One forward pass through ``model`` (a DeepSpeed engine or a plain/peft module; gradients flow
    when enabled) -> the score head's output at every position, [B, T] fp32."""
    head = score_head(model)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(**inputs, use_cache=False)
    finally:
        hook.remove()
    return captured[-1].squeeze(-1).float()


def token_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head's output at every position, [B, T] fp32."""
    return _head_outputs(model, input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask))


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence, [B], read at the last real token."""
    return gather_last_real(token_values(model, input_ids, attention_mask), attention_mask)


def attention_kernel_of(model: Any) -> str | None:
    """The attention kernel ``model`` (possibly in a DeepSpeed engine or peft wrapper) runs: eager, sdpa, ..."""
    return getattr(_unwrap(model).config, "_attn_implementation", None)


def takes_4d_mask(model: Any) -> bool:
    """Whether ``model``'s attention kernel takes an arbitrary 4D mask (eager and SDPA do; the flash
    kernels take only padding)."""
    return attention_kernel_of(model) in ("eager", "sdpa")


def attention_span(model: Any) -> float | None:
    """The number of attended keys at which a query's attention costs as much as its token's pass
    through the weights: ``n_params / (2 * hidden * layers)`` (per layer, QK^T and AV take 4 * hidden
    FLOPs per key; the weights 2 FLOPs per parameter). None when the config does not say."""
    base = _unwrap(model)
    hidden, layers = getattr(base.config, "hidden_size", None), getattr(base.config, "num_hidden_layers", None)
    if not hidden or not layers:
        return None
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters())
    return n_params / (2 * hidden * layers)


def additive_mask(model: Any, allowed: torch.Tensor) -> torch.Tensor:
    """A bool [B, T, T] mask (query row may attend to key column) as the [B, 1, T, T] additive mask
    transformers takes, in ``model``'s dtype."""
    dtype = _unwrap(model).get_input_embeddings().weight.dtype
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    blocked.masked_fill_(~allowed, torch.finfo(dtype).min)
    return blocked.unsqueeze(1)


def packed_pair_scores(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) scores of a ``collate_packed_pairs`` batch: one row per pair, its
    ``pair_mask`` passed to the model as a 4D additive mask (kernels that take one: eager, SDPA)."""
    values = _head_outputs(model, input_ids=batch["input_ids"], attention_mask=additive_mask(model, batch["pair_mask"]),
                           position_ids=batch["position_ids"])
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, batch["chosen_end"]], values[rows, batch["rejected_end"]]
