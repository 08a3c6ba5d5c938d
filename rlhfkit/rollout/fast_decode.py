"""A decode step for Llama-architecture models on the CPU that skips transformers' per-call machinery.

A decode step of SmolLM2-135M at 4 rows on two CPU threads spends about a fifth of its time outside
the kernels, in what ``LlamaForCausalLM.forward`` does around them for every token: a causal mask
built per call, argument-deprecation and output-capturing wrappers around each of the 30 layers and
their attention, the KV cache grown with ``torch.cat`` in every layer, the attention function looked
up per call. :func:`llama_decoder` runs the same submodules (norms, projections, MLP, rotary
embedding: the model's own, so LoRA layers and :func:`~rlhfkit.rollout.packing.packed_linears` work
as usual) and transformers' own ``apply_rotary_pos_emb``, with the same attention call as
transformers' SDPA path for one query token, on a KV cache allocated once at its full length. The
logits are those of ``model(...)`` bit for bit (tested: greedy tokens equal ``generate``'s, with and
without left padding). On a CPU without bf16 kernels a bf16 model attends in fp32 from fp32 KV
buffers, as its linear layers multiply in fp32 there (:mod:`rlhfkit.models.cpu_bf16`); the sums
then differ from ``model(...)``'s in order and rounding only (tested: the same greedy tokens).

Used only where that has been checked: a ``llama`` model on the CPU running SDPA attention, in eval
mode. Everything else (other architectures, eager attention, CUDA) keeps the model's own forward.

Where a layer's query, key and value projections are plain bf16 linear layers (no LoRA), the step
computes them in one packed product, and the MLP's gate and up projections in another
(:func:`~rlhfkit.rollout.packing.fused_linear`): the same bits, fewer passes over the weights.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from rlhfkit.models import cpu_bf16
from rlhfkit.models.gathered import is_zero3_partitioned
from rlhfkit.rollout.packing import fused_linear

Step = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def supports(hf_model: torch.nn.Module) -> bool:
    """A ZeRO-3 partitioned model (``hf-synced`` on one rank) keeps its own forward: ZeRO-3 gathers a
    layer's weights in hooks on the modules it calls, and the step calls the layers' parts directly."""
    cfg = hf_model.config
    return (getattr(cfg, "model_type", None) == "llama" and getattr(cfg, "_attn_implementation", None) == "sdpa"
            and not hf_model.training and getattr(cfg, "pretraining_tp", 1) in (None, 1)
            and hf_model.lm_head.weight.device.type == "cpu" and not is_zero3_partitioned(hf_model))


class KVBuffers:
    """The prefilled transformers ``cache`` of a Llama model's layers copied into buffers of ``capacity``
    positions, and attention for one new token per row over them."""

    def __init__(self, hf_model: torch.nn.Module, cache: Any, capacity: int):
        cfg = hf_model.config
        self.layers = list(hf_model.model.layers[: cfg.num_hidden_layers])
        self.rope = sys.modules[type(hf_model).__module__].apply_rotary_pos_emb
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.capacity = capacity
        past = [(layer.keys, layer.values) for layer in cache.layers[: len(self.layers)]]
        self.rows, _, self.filled, _ = past[0][0].shape
        # On a CPU without bf16 kernels (rlhfkit.models.cpu_bf16) a bf16 model attends in fp32, from buffers
        # kept in fp32 (the bf16 keys and values converted exactly, once)
        bf16 = past[0][0].dtype == torch.bfloat16
        self.dtype = torch.float32 if bf16 and cpu_bf16.wanted() else past[0][0].dtype
        self.keys, self.values = [], []
        for k, v in past:
            shape = (self.rows, self.kv_heads, capacity, self.head_dim)
            self.keys.append(k.new_empty(shape, dtype=self.dtype))
            self.values.append(v.new_empty(shape, dtype=self.dtype))
            self.keys[-1][:, :, :self.filled] = k
            self.values[-1][:, :, :self.filled] = v

    @property
    def qkv_sizes(self) -> list[int]:
        """The widths of the query, key and value projections, as one fused product's output splits."""
        return [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]

    def check_room(self) -> None:
        if self.filled >= self.capacity:
            raise RuntimeError(f"the decode buffers hold {self.capacity} positions")

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Layer ``i``'s attention output [rows, 1, heads * head_dim] (in ``q``'s dtype) for the projected
        query, key and value of the new token ([rows, 1, *]), whose key and value it appends."""
        rows, t, dim = self.rows, self.filled, self.head_dim
        q = q.view(rows, 1, self.heads, dim).transpose(1, 2)
        k = k.view(rows, 1, self.kv_heads, dim).transpose(1, 2)
        v = v.view(rows, 1, self.kv_heads, dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        self.keys[i][:, :, t] = k[:, :, 0]
        self.values[i][:, :, t] = v[:, :, 0]
        o = _attention(q.to(self.dtype), self.keys[i][:, :, : t + 1], self.values[i][:, :, : t + 1], mask,
                       self.heads // self.kv_heads, self.layers[i].self_attn.scaling)
        return o.to(q.dtype)

    def advance(self) -> None:
        """The new token of every layer is in: the next step writes the next position."""
        self.filled += 1


def llama_decoder(hf_model: torch.nn.Module, cache: Any, capacity: int) -> Optional[Step]:
    """A step function continuing from the prefilled transformers ``cache`` (whose KV it copies into
    buffers of ``capacity`` positions), or None where the model is not one this module handles.

    ``step(tokens [B], position_ids [B, 1], mask)`` appends one token per row and returns the next
    logits [B, V] in float32; ``mask`` is None without padding, else the bool [B, 1, 1, T] of the
    positions each row attends to (T = the tokens so far, this one included), as transformers builds
    it for SDPA.
    """
    if not supports(hf_model):
        return None
    body = hf_model.model
    kv = KVBuffers(hf_model, cache, capacity)
    attns = [layer.self_attn for layer in kv.layers]
    sizes = kv.qkv_sizes
    qkv = [fused_linear([a.q_proj, a.k_proj, a.v_proj], kv.rows) for a in attns]
    gate_up = [fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj], kv.rows) for layer in kv.layers]

    def step(tokens: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        kv.check_room()
        h = body.embed_tokens(tokens[:, None])
        cos, sin = body.rotary_emb(h, position_ids)
        for i, layer in enumerate(kv.layers):
            q, k, v = _project_qkv(attns[i], layer.input_layernorm(h), qkv[i], sizes)
            h = h + attns[i].o_proj(kv.attend(i, q, k, v, cos, sin, mask))
            h = h + _mlp(layer.mlp, layer.post_attention_layernorm(h), gate_up[i])
        kv.advance()
        return hf_model.lm_head(body.norm(h))[:, -1].float()

    return step


def _project_qkv(attn: torch.nn.Module, x: torch.Tensor, fused: Optional[Callable], sizes: list[int]) -> tuple:
    """The query, key and value projections of ``x``: one fused product where there is one."""
    if fused is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return fused(x).split(sizes, dim=-1)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor, fused: Optional[Callable]) -> torch.Tensor:
    """``LlamaMLP``: down(act(gate(x)) * up(x)), gate and up in one fused product where there is one."""
    if fused is None:
        return mlp(x)
    gate, up = fused(x).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], groups: int,
               scale: float) -> torch.Tensor:
    """transformers' ``sdpa_attention_forward`` for one query token, with its choices and so its sums ->
    [B, 1, heads * head_dim]: without a mask grouped-query attention by ``enable_gqa``; with one the query
    heads folded onto their key/value head (``pack_gqa``). (Folded heads without a mask, too, parted from
    ``generate``'s greedy tokens in bf16 on an AVX-512 CPU, and were no faster there.)"""
    rows, heads, _, dim = q.shape
    if groups > 1 and mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    else:
        if groups > 1:
            q = q.reshape(rows, heads // groups, groups, dim)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).reshape(rows, 1, heads * dim)
