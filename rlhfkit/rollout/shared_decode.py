"""Decode steps shared by the ranks of one CPU host: each streams half the weights for every rank's rows.

A decode step at a few rows is bound by memory bandwidth: every product reads its whole weight matrix
for a handful of rows. Under ZeRO-3 each rank of the ``hf`` backend holds the whole gathered actor and
decodes its own rows, so on one host every rank streams every weight at every token. Here the ranks
decode together, as tensor parallelism would: every product of a layer (query/key/value, output, gate
and up, down, and the language-model head) is split by its output columns, rank r computing its
share of the columns for the rows of *every* rank; the ranks then exchange their columns through the
shared memory of :mod:`rlhfkit.shm_collectives`. Each rank reads 1/world of the weights per token,
for world times the rows.

Each output column is still one product over the whole input (nothing is summed across ranks), and the
norms, the residual stream and the MLP's activation are the same operations per row, so the logits
are those of the rank's own decode (:func:`~rlhfkit.rollout.fast_decode.llama_decoder`) bit for bit on
a CPU whose products do not depend on the number of rows (tested against it; the test reports where
they differ). Attention stays rank-local, each rank's own rows over its own KV buffers, with its own
padding mask; each rank samples its own rows with its own random numbers. Ranks that finish first keep
stepping with padding (drawing nothing) until every rank's rows have ended.

It runs where every rank calls ``generate`` together with the same number of rows, at most
``MAX_ROWS`` in all, for a model whose products' weights exceed a host's caches (``MIN_WEIGHT_BYTES``;
on smaller ones a step is not bound by memory and the exchanges cost more than they save), under
ZeRO-3, with the shared-memory collectives installed (one host) and the fast decode step supported:
the ``hf`` backend's ZeRO-3 path agrees on it at each call (:func:`decode_group`).
Above ``MAX_ROWS`` oneDNN blocks a product's rows differently from a rank's own product (on the Xeon
the bits of a row are the same up to 32 rows in all and differ at 48), so larger batches, such as a
held-out evaluation's, decode each rank's rows on their own; a decode step is less bound by memory
there anyway. ``RLHFKIT_SHARED_DECODE=0`` decodes each rank's rows on its own always.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rlhfkit import shm_collectives
from rlhfkit.errors import ConfigError
from rlhfkit.rollout.fast_decode import KVBuffers, supports
from rlhfkit.rollout.packing import pack_dtype, packable, packed_product

ENV = "RLHFKIT_SHARED_DECODE"
MAX_ROWS = 32  # rows of every rank together: products give each row the bits of the rank's own product up to here
MIN_WEIGHT_BYTES = 16 << 20  # smaller products' weights stay in the caches: a step is not bound by memory there


@dataclass
class DecodeGroup:
    """The ranks decoding together: ``rows`` each, through ``shm``'s exchanges."""

    shm: Any  # rlhfkit.shm_collectives.ShmCollectives
    rank: int
    world: int
    rows: int


def wanted() -> bool:
    """Whether ``RLHFKIT_SHARED_DECODE`` lets the ranks share decode steps (the default: yes)."""
    choice = os.environ.get(ENV, "1").strip().lower()
    if choice not in ("0", "1"):
        raise ConfigError(f"{ENV}={choice!r}: use 1 (ranks on one host share decode steps) or 0")
    return choice == "1"


def shareable(hf_model: torch.nn.Module, world: int) -> bool:
    """The fast decode step runs for ``hf_model``, every product it splits is a plain packable linear layer
    without bias, their output columns divide evenly among ``world`` ranks, and their weights together
    hold at least ``MIN_WEIGHT_BYTES`` (more than a host's caches)."""
    if not supports(hf_model) or pack_dtype() is None:
        return False
    layers = hf_model.model.layers[: hf_model.config.num_hidden_layers]
    attns, mlps = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
    linears = [hf_model.lm_head] + [m for a, mlp in zip(attns, mlps) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                                                 mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    widths = [hf_model.lm_head.out_features] + [n for a, mlp in zip(attns, mlps) for n in (
        a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features, a.o_proj.out_features,
        mlp.gate_proj.out_features, mlp.down_proj.out_features)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return (weight_bytes >= MIN_WEIGHT_BYTES and all(packable(m) and m.bias is None for m in linears)
            and all(n % world == 0 for n in widths))


def decode_group(hf_model: torch.nn.Module, rows: int, max_new_tokens: int) -> Optional[DecodeGroup]:
    """The group of every rank when all of them can share decode steps, with ``rows`` rows and at most
    ``max_new_tokens`` new tokens each, else None. Collective: every rank calls it when it generates
    (under ZeRO-3 they all do, together)."""
    shm = shm_collectives.installed()
    if shm is None:
        return None
    ok = wanted() and 0 < rows * shm.world <= MAX_ROWS and max_new_tokens > 1 and shareable(hf_model, shm.world)
    answers = shm.exchange(torch.tensor([[float(ok), float(rows), float(max_new_tokens)]]))
    agreed = bool(answers[:, 0].all()) and bool((answers[:, 1:] == answers[:1, 1:]).all())
    return DecodeGroup(shm, shm.rank, shm.world, rows) if agreed else None


class SharedDecoder:
    """The decode step of :func:`~rlhfkit.rollout.fast_decode.llama_decoder` with its products shared by
    the ``group``: ``running(tokens, done)`` hands this rank's new tokens to the group and tells whether
    any rank still decodes; the step ``(tokens, position_ids, mask)`` then returns this rank's next logits."""

    def __init__(self, hf_model: torch.nn.Module, cache: Any, capacity: int, group: DecodeGroup):
        self.model, self.group = hf_model, group
        self.kv = KVBuffers(hf_model, cache, capacity)
        g, rows, dtype = group, group.rows * group.world, pack_dtype()
        self.own = slice(g.rank * g.rows, (g.rank + 1) * g.rows)
        kv = self.kv
        self.sizes = kv.qkv_sizes
        pack = functools.partial(packed_product, rows=rows, dtype=dtype)
        cols = functools.partial(_columns, group=g)
        with torch.no_grad():
            self.qkv, self.o, self.gate_up, self.down = [], [], [], []
            for layer in kv.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.qkv.append(pack(cols(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))))
                self.o.append(pack(cols(a.o_proj.weight)))
                self.gate_up.append(pack(torch.cat([cols(mlp.gate_proj.weight), cols(mlp.up_proj.weight)])))
                self.down.append(pack(cols(mlp.down_proj.weight)))
            self.head = pack(cols(hf_model.lm_head.weight))
        self.tokens: Optional[torch.Tensor] = None

    def running(self, tokens: torch.Tensor, done: bool) -> bool:
        """Exchange this rank's new ``tokens`` [rows] and whether its rows have all ended -> whether any
        rank's have not (then every rank takes the next step)."""
        sent = torch.cat([tokens.to(torch.long), torch.tensor([int(done)], dtype=torch.long)])
        got = self.group.shm.exchange(sent).view(self.group.world, self.group.rows + 1)
        self.tokens = got[:, :-1].reshape(-1)
        return not bool(got[:, -1].all())

    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        body, kv, own, cols = self.model.model, self.kv, self.own, self._columns_of
        kv.check_room()
        h = body.embed_tokens(self.tokens[:, None])  # every rank's rows
        cos, sin = body.rotary_emb(h[own], position_ids)
        for i, layer in enumerate(kv.layers):
            q, k, v = cols(self.qkv[i], layer.input_layernorm(h)).split(self.sizes, dim=-1)
            o = self.group.shm.exchange(kv.attend(i, q[own], k[own], v[own], cos, sin, mask))
            h = h + cols(self.o[i], o)
            gate, up = self.gate_up[i](layer.post_attention_layernorm(h)).chunk(2, dim=-1)
            h = h + cols(self.down[i], self.group.shm.exchange(layer.mlp.act_fn(gate) * up, dim=-1))
        kv.advance()
        return cols(self.head, body.norm(h))[own, -1].float()

    def _columns_of(self, product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``product``'s columns of every rank for ``x``, side by side in rank order."""
        return self.group.shm.exchange(product(x), dim=-1)


def _columns(weight: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """This rank's share of a linear layer's output columns (rows of its ``weight``)."""
    n = weight.shape[0] // group.world
    return weight[group.rank * n:(group.rank + 1) * n]
