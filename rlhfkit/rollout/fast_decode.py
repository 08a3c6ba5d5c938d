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
from rlhfkit.rollout.packing import fused_linear

Step = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def supports(hf_model: torch.nn.Module) -> bool:
    cfg = hf_model.config
    return (getattr(cfg, "model_type", None) == "llama" and getattr(cfg, "_attn_implementation", None) == "sdpa"
            and not hf_model.training and getattr(cfg, "pretraining_tp", 1) in (None, 1)
            and hf_model.lm_head.weight.device.type == "cpu")


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
    body, cfg = hf_model.model, hf_model.config
    rope = sys.modules[type(hf_model).__module__].apply_rotary_pos_emb
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = list(body.layers[: cfg.num_hidden_layers])
    head_dim = layers[0].self_attn.head_dim
    groups = heads // kv_heads
    past = [(layer.keys, layer.values) for layer in cache.layers[: len(layers)]]
    rows, _, length, _ = past[0][0].shape
    # On a CPU without bf16 kernels (rlhfkit.models.cpu_bf16) a bf16 model attends in fp32, from buffers
    # kept in fp32 (the bf16 keys and values converted exactly, once)
    buffer_dtype = torch.float32 if past[0][0].dtype == torch.bfloat16 and cpu_bf16.wanted() else past[0][0].dtype
    keys, values = [], []
    for k, v in past:
        keys.append(k.new_empty(rows, kv_heads, capacity, head_dim, dtype=buffer_dtype))
        values.append(v.new_empty(rows, kv_heads, capacity, head_dim, dtype=buffer_dtype))
        keys[-1][:, :, :length] = k
        values[-1][:, :, :length] = v
    del past
    filled = [length]
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = [fused_linear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], rows) for layer in layers]
    gate_up = [fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj], rows) for layer in layers]

    def step(tokens: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        t = filled[0]
        if t >= capacity:
            raise RuntimeError(f"the decode buffers hold {capacity} positions")
        h = body.embed_tokens(tokens[:, None])
        cos, sin = body.rotary_emb(h, position_ids)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = _project_qkv(attn, x, qkv[i], sizes)
            q = q.view(rows, 1, heads, head_dim).transpose(1, 2)
            k = k.view(rows, 1, kv_heads, head_dim).transpose(1, 2)
            v = v.view(rows, 1, kv_heads, head_dim).transpose(1, 2)
            q, k = rope(q, k, cos, sin)
            keys[i][:, :, t] = k[:, :, 0]
            values[i][:, :, t] = v[:, :, 0]
            o = _attention(q.to(buffer_dtype), keys[i][:, :, : t + 1], values[i][:, :, : t + 1], mask, groups, attn.scaling)
            o = o.to(h.dtype)
            h = h + attn.o_proj(o)
            h = h + _mlp(layer.mlp, layer.post_attention_layernorm(h), gate_up[i])
        filled[0] = t + 1
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
