"""Experience: the typed batch step 3 trains on, and the forward passes that fill it.

Alignment (the source of most silent RLHF bugs): a sequence is ``prompt [P, left-padded] ++
response [A]``. The logits at position ``P - 1 + t`` predict response token ``t``; the critic's
value of the state before action ``t`` is read at the same position ``P - 1 + t``; the sequence
score is read at the last real token (the EOS when the response has one). Position ids skip the
left padding, as during generation.

Group packing (GRPO and the other group algorithms): the G samples of a prompt share their prompt
tokens, so :func:`actor_forward` can run each group as one row, the prompt once and then the G
responses, each response attending to the prompt and to itself only (a 4D mask) with the positions
it had when it was sampled. The logprobs are those of the G rows run apart; the prompt's tokens are
computed once instead of G times (GSM8K at 64 new tokens, G = 4: 40% fewer tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import torch

from rlhfkit.algos import entropy_from_logits, logprobs_from_logits
from rlhfkit.models import additive_mask, attention_span, position_ids, takes_4d_mask, token_values


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

    def minibatches(self, size: int, generator: Optional[torch.Generator] = None, group_size: int = 1) -> Iterator["Experience"]:
        """Shuffled mini-batches of ``size`` samples (the last one may be smaller), each trimmed to its
        longest response. With ``group_size`` G > 1 dividing ``size`` and the batch, whole groups are
        shuffled (the G contiguous samples of a prompt stay together) so that each mini-batch can run
        packed, and nothing is trimmed: a packed row's layout is then its layout in the whole batch
        (trimming moves responses 2..G within the row, and bf16 rounds their logprobs differently;
        trimming the right padding of rows run apart changes nothing)."""
        G = group_size
        whole_groups = G > 1 and size % G == 0 and len(self) % G == 0
        if whole_groups:
            order = (torch.randperm(len(self) // G, generator=generator)[:, None] * G + torch.arange(G)).flatten()
        else:
            order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), size):
            yield self.select(order[start:start + size], trim=not whole_groups)

    def select(self, idx: torch.Tensor, trim: bool = True) -> "Experience":
        """The samples ``idx``, with the response trimmed to the longest one among them (``trim``)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx.to(v.device)] if torch.is_tensor(v) and v.dim() > 0 else v
        if not trim:
            return Experience(**out)
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


@dataclass
class PackedGroups:
    """Groups of G rows with one prompt, each as one row: ``prompt [P] ++ response_1 [A] ++ ... ++
    response_G [A]`` (N = B / G rows of L = P + G * A tokens)."""

    input_ids: torch.Tensor  # [N, L]
    allowed: torch.Tensor  # [N, L, L] bool: query row may attend to key column
    position_ids: torch.Tensor  # [N, L]: a response's tokens continue from its prompt's last position
    logit_index: torch.Tensor  # [G * A] which of the last G * A + 1 positions predicts each response token


def pack_groups(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group_size: int) -> Optional[PackedGroups]:
    """The packed layout of ``sequences`` [B, P+A] when its rows come in contiguous groups of
    ``group_size`` with one prompt each (ids and mask); None otherwise (the rows are run as they are).

    The mask is causal; a response sees the prompt's real tokens and its own earlier tokens, never
    another response; padding is seen by nobody and sees only itself. Response token t of sample g is
    predicted at the prompt's last position when t = 0 and at its own token t - 1 after that.
    """
    B, T = sequences.shape
    P, G = prompt_len, group_size
    A = T - P
    if G < 2 or B == 0 or B % G or A < 1:
        return None
    N = B // G
    prompts, prompt_mask = sequences[:, :P].view(N, G, P), attention_mask[:, :P].view(N, G, P)
    if not (torch.equal(prompts, prompts[:, :1].expand_as(prompts)) and
            torch.equal(prompt_mask, prompt_mask[:, :1].expand_as(prompt_mask))):
        return None
    L = P + G * A
    dev = sequences.device
    input_ids = torch.cat([prompts[:, 0], sequences[:, P:].reshape(N, G * A)], dim=1)
    real = torch.cat([prompt_mask[:, 0], attention_mask[:, P:].reshape(N, G * A)], dim=1).bool()  # [N, L]
    block = torch.cat([torch.zeros(P, dtype=torch.long, device=dev),
                       torch.arange(1, G + 1, device=dev).repeat_interleave(A)])  # 0 = prompt, g = response g
    visible = (block[None, :] == 0) | (block[:, None] == block[None, :])  # [L, L] prompt, or the same response
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    allowed = (causal & visible)[None] & real[:, None, :] & real[:, :, None]
    allowed |= torch.eye(L, dtype=torch.bool, device=dev)[None]
    n_prompt = prompt_mask[:, 0].sum(-1, keepdim=True)  # [N, 1]
    pos = torch.cat([position_ids(prompt_mask[:, 0]), n_prompt + torch.arange(A, device=dev).repeat(G)[None]], dim=1)
    t = torch.arange(A, device=dev).repeat(G)
    g = torch.arange(G, device=dev).repeat_interleave(A)
    logit_index = torch.where(t == 0, torch.zeros_like(t), g * A + t)  # into the last G*A+1 positions (from P-1)
    return PackedGroups(input_ids, allowed, pos, logit_index)


def group_packing_pays(prompt_len: int, response_len: int, group_size: int, span: Optional[float]) -> bool:
    """Whether one packed row per group costs less than its G rows: a row of L tokens costs about
    L (the weights) + L^2 / span (attention, computed densely; ``span`` from
    :func:`rlhfkit.models.attention_span`). Long responses in large groups do not pay: the packed
    row's attention grows with (G * A)^2. The difference works out to (G - 1) * (P + (P^2 - G * A^2) / span),
    so it pays exactly when G * A^2 < P * span + P^2: for every shorter response too."""
    if span is None or group_size < 2:
        return False
    S, L = prompt_len + response_len, prompt_len + group_size * response_len
    return L + L * L / span < group_size * (S + S * S / span)


def packs_groups(model: Any, prompt_len: int, response_len: int, group_size: int) -> bool:
    """Whether :func:`actor_forward` runs rows of this shape packed, groups of ``group_size`` allowing:
    the attention kernel takes a 4D mask and packing costs less (:func:`group_packing_pays`)."""
    return group_size > 1 and takes_4d_mask(model) and group_packing_pays(prompt_len, response_len, group_size, attention_span(model))


def actor_forward(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  temperature: float = 1.0, with_entropy: bool = False,
                  group_size: int = 1, entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs of the response tokens under ``model`` ([B, A]) and optionally their entropy ([B, A]),
    differentiable only with ``entropy_grad`` (an entropy term in the loss): otherwise its softmax over the
    vocabulary is not kept for the backward pass.

    Only the logits that predict response tokens are computed (``logits_to_keep``), divided by the
    sampling temperature so that the logprobs are those of the distribution that was sampled; they stay
    in the model's dtype (no fp32 copy of [B, A, V]): the log-softmax casts them chunk by chunk. With
    ``group_size`` G > 1, rows that come in groups of G with one prompt run packed
    (:func:`pack_groups`) when the attention kernel takes a 4D mask and packing costs less.
    """
    B, A = sequences.shape[0], sequences.shape[1] - prompt_len
    packed = None
    if packs_groups(model, prompt_len, A, group_size):
        packed = pack_groups(sequences, attention_mask, prompt_len, group_size)
    if packed is None:
        out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                    use_cache=False, logits_to_keep=A + 1)
        logits = out.logits[:, :-1]  # [B, A, V]: position P-1+t predicts response token t
    else:
        out = model(input_ids=packed.input_ids, attention_mask=additive_mask(model, packed.allowed),
                    position_ids=packed.position_ids, use_cache=False, logits_to_keep=group_size * A + 1)
        logits = out.logits[:, packed.logit_index].reshape(B, A, -1)  # [N, G*A, V] -> [B, A, V]
    if with_entropy and entropy_grad:
        logits = logits.float()  # two terms' gradients meet here: summed in fp32, then rounded once, as before
    # else in the model's dtype: each chunk is cast to fp32 and divided by the temperature where it is used
    logprobs = logprobs_from_logits(logits, sequences[:, prompt_len:], temperature)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature)
    return logprobs, entropy


def critic_forward(model: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Values V(s_t) of the states before each response token, [B, A]."""
    values = token_values(model, sequences, attention_mask)  # [B, P+A]
    return values[:, prompt_len - 1:-1]
