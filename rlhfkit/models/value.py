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


def token_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head's output at every position, [B, T] fp32 (one forward pass through ``model``,
    a DeepSpeed engine or a plain/peft module; gradients flow when enabled)."""
    head = score_head(model)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=False)
    finally:
        hook.remove()
    return captured[-1].squeeze(-1).float()


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence, [B], read at the last real token."""
    return gather_last_real(token_values(model, input_ids, attention_mask), attention_mask)
