"""Experience: the typed batch step 3 trains on, and the forward passes that fill it.

Alignment (the source of most silent RLHF bugs): a sequence is ``prompt [P, left-padded] ++
response [A]``. The logits at position ``P - 1 + t`` predict response token ``t``; the critic's
value of the state before action ``t`` is read at the same position ``P - 1 + t``; the sequence
score is read at the last real token (the EOS when the response has one). Position ids skip the
left padding, as during generation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import torch

from rlhfkit.algos import entropy_from_logits, logprobs_from_logits
from rlhfkit.models import position_ids, token_values


@dataclass
class Experience:
    sequences: torch.Tensor  # [B, P+A] long: left-padded prompt ++ response (pad after EOS)
    attention_mask: torch.Tensor  # [B, P+A] 0/1
    action_mask: torch.Tensor  # [B, A] float 0/1: the response up to and including EOS
    loss_mask: torch.Tensor  # [B, A] float 0/1: action_mask, minus samples left out of the loss (--mask_truncated)
    old_logprobs: Optional[torch.Tensor]  # [B, A] actor logprobs of the sampled tokens at rollout time (None: filled in
    # by the one training update of the batch, step 3's old_logprobs_from_training)
    ref_logprobs: torch.Tensor  # [B, A] reference logprobs
    values: Optional[torch.Tensor]  # [B, A] critic values V(s_t) at rollout time (None without critic)
    scores: torch.Tensor  # [B] sequence rewards (reward model and/or functions, after shaping)
    raw_scores: torch.Tensor  # [B] reward before truncation / overlong shaping (for metrics)
    rewards: torch.Tensor  # [B, A] per-token rewards
    advantages: torch.Tensor  # [B, A]
    returns: torch.Tensor  # [B, A] value targets
    kl: torch.Tensor  # [B, A] per-token KL(actor || ref) estimate
    truncated: torch.Tensor  # [B] bool: no EOS within --max_answer_seq_len
    prompt_len: int  # P

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def minibatches(self, size: int, generator: Optional[torch.Generator] = None) -> Iterator["Experience"]:
        """Shuffled mini-batches of ``size`` samples (the last one may be smaller)."""
        order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), size):
            yield self.select(order[start:start + size])

    def select(self, idx: torch.Tensor) -> "Experience":
        """The samples ``idx``, with the response trimmed to the longest one among them."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx.to(v.device)] if torch.is_tensor(v) and v.dim() > 0 else v
        a = int(out["action_mask"].sum(-1).max().item()) if len(idx) else 0
        a = max(a, 1)
        for name in ("action_mask", "loss_mask", "old_logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns", "kl"):
            if out[name] is not None:
                out[name] = out[name][:, :a]
        out["sequences"] = out["sequences"][:, :self.prompt_len + a]
        out["attention_mask"] = out["attention_mask"][:, :self.prompt_len + a]
        return Experience(**out)

    @staticmethod
    def concat(items: list["Experience"], pad_id: int) -> "Experience":
        """Stack experiences with possibly different prompt and response lengths (left-pad prompts,
        right-pad responses)."""
        if len(items) == 1:
            return items[0]
        P = max(e.prompt_len for e in items)
        A = max(e.action_mask.shape[1] for e in items)
        out: dict[str, Any] = {"prompt_len": P}
        for f in fields(Experience):
            if f.name == "prompt_len":
                continue
            vals = [getattr(e, f.name) for e in items]
            if vals[0] is None:
                out[f.name] = None
            elif f.name in ("sequences", "attention_mask"):
                padded = []
                for e, v in zip(items, vals):
                    fill = pad_id if f.name == "sequences" else 0
                    left = torch.full((v.shape[0], P - e.prompt_len), fill, dtype=v.dtype, device=v.device)
                    resp_len = v.shape[1] - e.prompt_len
                    right = torch.full((v.shape[0], A - resp_len), fill, dtype=v.dtype, device=v.device)
                    padded.append(torch.cat([left, v, right], dim=1))
                out[f.name] = torch.cat(padded)
            elif vals[0].dim() == 2:
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, A - v.shape[1])) for v in vals])
            else:
                out[f.name] = torch.cat(vals)
        return Experience(**out)


def actor_forward(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs of the response tokens under ``model`` ([B, A]) and optionally their entropy ([B, A]).

    Only the logits that predict response tokens are computed (``logits_to_keep``), divided by the
    sampling temperature so that the logprobs are those of the distribution that was sampled.
    """
    A = sequences.shape[1] - prompt_len
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False, logits_to_keep=A + 1)
    logits = out.logits[:, :-1].float()  # [B, A, V]: position P-1+t predicts response token t
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, sequences[:, prompt_len:])
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


def critic_forward(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Values V(s_t) of the states before each response token, [B, A]."""
    values = token_values(model, sequences, attention_mask)  # [B, P+A]
    return values[:, prompt_len - 1:-1]
