"""Per-sequence readouts of one forward pass: scores from a one-label head, summed response
log-probs from a causal LM; each for padded rows and for packed pairs.

Scores come from an ``AutoModelForSequenceClassification`` with one label. The score of a sequence
is read at its last real token (``rlhfkit.algos.last_real_token_index``: the EOS that ends the
response when there is one, else the last token before padding) — the one rule shared by step 2
(reward model), step 3 (reward and critic) and the scoring command; it is the token Hugging Face's
own pooling reads when pads are exactly the masked positions, so an exported reward model scores
the same in plain transformers.

Log-probs are DPO's: log pi(y|x), the sum of the response tokens' log-probs under a causal LM.

Pair batches come from ``rlhfkit.data``: ``collate_pairs`` (chosen rows, then rejected rows,
right-padded, [2B, T]) and ``collate_packed_pairs`` (one row per pair: the prompt once, then the
chosen and the rejected response, each attending to the prompt and itself through ``pair_mask``).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.algos import IGNORE_INDEX, gather_last_real, last_real_token_index, logprobs_from_logits
from rlhfkit.models.attention import additive_mask, position_ids, unwrap_model


def score_head(model: Any) -> torch.nn.Module:
    base = unwrap_model(model)
    for name in ("score", "classifier", "v_head"):
        head = getattr(base, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise TypeError(f"{type(base).__name__} has no score head (expected a one-label AutoModelForSequenceClassification)")


def _score_head_io(model: Any, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass through ``model`` (a DeepSpeed engine or a plain/peft module; gradients flow
    when enabled) -> what the score head reads at every position (the final hidden states), [B, T, H],
    and its output there, [B, T, 1]."""
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = score_head(model).register_forward_hook(lambda _m, i, out: captured.append((i[0], out)))
    try:
        model(**inputs, use_cache=False)
    finally:
        hook.remove()
    return captured[-1]


def _at_score_head(model: Any, read_input: bool = False, **inputs: torch.Tensor) -> torch.Tensor:
    """The score head's output at every position, [B, T, 1], or with ``read_input`` its input, [B, T, H]."""
    head_input, head_output = _score_head_io(model, **inputs)
    return head_input if read_input else head_output


def _head_outputs(model: Any, **inputs: torch.Tensor) -> torch.Tensor:
    """The score head's output at every position, [B, T] fp32 (see :func:`_at_score_head`)."""
    return _at_score_head(model, **inputs).squeeze(-1).float()


def scores_and_head_inputs(model: Any, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_scores` [B] and :func:`head_inputs_at_last_token` [B, H] (both fp32) from one forward
    pass: the model's own scores and what any other linear head would read."""
    head_input, head_output = _score_head_io(model, input_ids=input_ids, attention_mask=attention_mask,
                                             position_ids=position_ids(attention_mask))
    rows, last = torch.arange(input_ids.shape[0], device=input_ids.device), last_real_token_index(attention_mask)
    return head_output[rows, last].squeeze(-1).float(), head_input[rows, last].float()


def head_inputs_at_last_token(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """What the score head reads for each sequence: its input (the final hidden state) at the last real
    token, [B, H] fp32; the same forward as :func:`sequence_scores`."""
    return scores_and_head_inputs(model, input_ids, attention_mask)[1]


def token_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head's output at every position, [B, T] fp32."""
    return _head_outputs(model, input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask))


def sequence_scores(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence, [B], read at the last real token."""
    return gather_last_real(token_values(model, input_ids, attention_mask), attention_mask)


def _at_pair_ends(model: Any, batch: dict[str, torch.Tensor], read_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over a ``collate_packed_pairs`` batch (its ``pair_mask`` passed to the model as a 4D
    additive mask: kernels that take one, eager and SDPA) -> the score head's output (or, with ``read_input``,
    its input) at each pair's chosen and rejected end, fp32."""
    out = _at_score_head(model, read_input, input_ids=batch["input_ids"],
                         attention_mask=additive_mask(model, batch["pair_mask"]), position_ids=batch["position_ids"])
    rows = torch.arange(out.shape[0], device=out.device)
    return out[rows, batch["chosen_end"]].float(), out[rows, batch["rejected_end"]].float()


def packed_pair_scores(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) scores of a ``collate_packed_pairs`` batch: one row per pair."""
    chosen, rejected = _at_pair_ends(model, batch, read_input=False)
    return chosen.squeeze(-1), rejected.squeeze(-1)


def packed_pair_head_inputs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B, H], rejected [B, H]): what the score head reads for each side of a ``collate_packed_pairs``
    batch (equal to :func:`head_inputs_at_last_token` on the two rows, up to the order of the sums)."""
    return _at_pair_ends(model, batch, read_input=True)


def at_predicting_column(x: torch.Tensor, fill: Any) -> torch.Tensor:
    """``x`` [N, T] moved one column left (the logits at column t predict the token at t+1), ``fill`` at the end."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)


def response_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels [N, T] aligned with the logits of a right-padded batch: position t holds token t+1 when
    that token is a real response token (index >= prompt_len, not padding), else IGNORE_INDEX."""
    ids = batch["input_ids"]
    position = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    scored = (batch["attention_mask"] == 1) & (position >= batch["prompt_len"].unsqueeze(1))
    return at_predicting_column(torch.where(scored, ids, torch.full_like(ids, IGNORE_INDEX)), IGNORE_INDEX)


def sequence_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) summed response log-probs of a ``collate_pairs`` batch (rows [2B]:
    chosen, then rejected); prompt and padding tokens count nothing."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logps = logprobs_from_logits(logits, response_labels(batch)).sum(-1)  # ignored labels give 0
    return logps.chunk(2)


def packed_sequence_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) summed response log-probs of a ``collate_packed_pairs`` batch (one
    row per pair: prompt, chosen, rejected), equal to :func:`sequence_logprobs` on the two rows.

    A token is predicted at the column before it, except the rejected response's first token: the
    prompt's last column predicts it (as in the rejected row on its own), besides the chosen one's.
    """
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=additive_mask(model, batch["pair_mask"]), position_ids=batch["position_ids"],
                   use_cache=False).logits
    rows, col = torch.arange(ids.shape[0], device=ids.device), torch.arange(ids.shape[1], device=ids.device)
    p, c_end = batch["prompt_len"], batch["chosen_end"] + 1  # the chosen response is [p, c_end)
    n = batch["attention_mask"].sum(-1)  # the rejected response is [c_end, n)
    chosen = (col >= p[:, None]) & (col < c_end[:, None])
    rejected_rest = (col > c_end[:, None]) & (col < n[:, None])
    targets = torch.where(chosen | rejected_rest, ids, torch.full_like(ids, IGNORE_INDEX))
    lp = logprobs_from_logits(logits, at_predicting_column(targets, IGNORE_INDEX))  # [B, T]
    first = torch.where(c_end < n, ids[rows, c_end.clamp(max=ids.shape[1] - 1)], IGNORE_INDEX)
    first_lp = logprobs_from_logits(logits[rows, p - 1], first)  # [B], 0 where the rejected side is empty
    return ((lp * at_predicting_column(chosen, False)).sum(-1),
            (lp * at_predicting_column(rejected_rest, False)).sum(-1) + first_lp)


def pair_response_lengths(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) response token counts of either pair batch: the tokens whose log-probs
    :func:`pair_logprobs` sums."""
    if "pair_mask" in batch:
        c_end = batch["chosen_end"] + 1
        return c_end - batch["prompt_len"], batch["attention_mask"].sum(-1) - c_end
    return (response_labels(batch) != IGNORE_INDEX).sum(-1).chunk(2)


def pair_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) summed response log-probs of either pair batch: packed when it has a ``pair_mask``."""
    return (packed_sequence_logprobs if "pair_mask" in batch else sequence_logprobs)(model, batch)
