"""A full-weight, hook-free inference copy of a (possibly ZeRO-3 partitioned, possibly LoRA) model.

Under ZeRO-3 every forward through the engine all-gathers each layer's shards and runs DeepSpeed's
fetch/release hooks around every submodule. :class:`GatheredCopy` instead gathers the weights once
into a plain model of the same class, built outside ``zero.Init``, with no ZeRO hooks: a bucket of
modules at a time, straight from the ZeRO-3 shards into the copy's storage, so peak memory is about
one full model plus one bucket. Forward passes that need no gradient then run on the copy, rank-local
(the ``hf`` rollout backend generates on it; step 3's experience passes and DPO's reference scores
read it).

A peft LoRA model becomes a plain copy with merged weights ``W + scaling * B @ A`` (peft's own
``get_delta_weight``, so the copy equals ``merge_and_unload()``).

The engine does not notice: its weights are only read (shards directly, or
``GatheredParameters(modifier_rank=None)`` for LoRA layers), and its ZeRO status is never changed.

Nothing here imports a rollout backend: the rollout, DPO and step 3 all build on it.
"""

from __future__ import annotations

import contextlib
import copy as copylib
import itertools
from typing import Any, Callable, Iterator, TypeVar

import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models.cpu_bf16 import fp32_products
from rlhfkit.models.loading import plain_init

DEFAULT_BUCKET_NUMEL = 2**25  # parameters gathered at once (~64 MiB in bf16): few collectives, small peak


T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# What is inside an engine.


def unwrap_engine(engine: Any) -> torch.nn.Module:
    """The model inside a ``DeepSpeedEngine`` (or the module itself)."""
    if hasattr(engine, "zero_optimization_stage") and hasattr(engine, "module"):
        return engine.module
    if isinstance(engine, torch.nn.Module):
        return engine
    raise TypeError(f"a rollout engine wants a DeepSpeedEngine or an nn.Module, got {type(engine).__name__}")


def is_peft_model(module: Any) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def hf_model_of(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face ``PreTrainedModel`` that owns ``generate`` (the base model under peft)."""
    return module.get_base_model() if is_peft_model(module) else module


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """True when ``module``'s parameters are ZeRO-3 partitioned (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def model_device(engine: Any, module: torch.nn.Module) -> torch.device:
    if hasattr(engine, "zero_optimization_stage") and hasattr(engine, "device"):
        return torch.device(engine.device)
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class GatheredCopy:
    """A hook-free, full-weight, eval-mode copy of a ZeRO-3 partitioned model, for forward passes that
    need no gradient (generation, the experience passes of step 3, DPO's reference scores).

    Under ZeRO-3 every forward through the engine all-gathers each layer's shards and runs
    DeepSpeed's fetch/release hooks around every submodule; gathering the whole model once into a
    plain copy and running a plain forward costs one gather per parameter and no hooks, which pays
    when several forwards follow, and on the CPU even for one.
    :meth:`model` is collective (every rank gathers); what runs on the copy afterwards is rank-local.
    Models that are not partitioned are returned as they are. The copy is dropped by
    :meth:`done` (end of a use) unless ``keep=True``; a kept copy is refreshed on every :meth:`model`
    call, except for a ``frozen`` model, whose weights never change: it is gathered once.

    Args:
        engine: a ``DeepSpeedEngine`` (any ZeRO stage) around a Hugging Face model (causal LM or
            sequence classifier), possibly a peft LoRA model, or such a model itself.
        bucket_numel: how many parameters to gather at a time while filling the copy (peak memory
            is about the copy plus one bucket).
        direct_gather: all-gather ZeRO-3 shards straight into the copy's storage; False always uses
            ``deepspeed.zero.GatheredParameters`` and copies (the fallback for NVMe / quantised weights,
            taken automatically when needed).
    """

    def __init__(self, engine: Any, *, keep: bool = False, frozen: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 direct_gather: bool = True):
        self.engine = engine
        self.module = unwrap_engine(engine)
        self.keep = keep
        self.frozen = frozen
        self.bucket_numel = int(bucket_numel)
        self.direct_gather = direct_gather
        self.device = model_device(engine, self.module)
        self._copy: torch.nn.Module | None = None
        self._fresh = False
        self._held = False

    @property
    def partitioned(self) -> bool:
        return is_zero3_partitioned(self.module)

    def model(self) -> torch.nn.Module:
        """The copy with the model's current weights (collective under ZeRO-3), or the model itself
        when it is not partitioned."""
        if not self.partitioned:
            return self.engine
        if self._held and self._fresh:
            return self._copy
        if self._copy is None:
            self._copy = build_inference_copy(self.module, self.device)
            self._fresh = False
        if not (self.frozen and self._fresh):
            load_gathered_weights(self._copy, self.module, self.bucket_numel, direct=self.direct_gather)
            self._fresh = True
        return self._copy

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """One use: ``fn(copy, *args)`` with the copy of :meth:`model` (collective), then :meth:`done`."""
        try:
            return fn(self.model(), *args)
        finally:
            self.done()

    def done(self) -> None:
        """End of a use: drop the copy unless it is kept (or held)."""
        if not self.keep and not self._held:
            self.release()

    @contextlib.contextmanager
    def held(self) -> Iterator["GatheredCopy"]:
        """Within the block the copy is gathered at most once and outlives the uses' ``done()``; it is
        dropped at the end (unless kept). For several uses in a row with the same weights (the actor
        generates, then scores what it generated): no optimiser step may run inside."""
        self._held = True
        try:
            yield self
        finally:
            self._held = False
            self.done()

    def release(self) -> None:
        """Drop the copy (and its memory)."""
        if self._copy is None:
            return
        copy, self._copy, self._fresh = self._copy, None, False
        # Free the weights now, whatever still refers to the module (a reference cycle would keep them
        # until the next garbage collection). Not gc.collect(): with transformers and DeepSpeed loaded
        # a full collection is slow, and a PPO step releases several copies.
        for t in itertools.chain(copy.parameters(), copy.buffers()):
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Building the copy.

@contextlib.contextmanager
def _plain_init(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Construct a model unpartitioned, uninitialised (its weights are overwritten), in ``dtype`` on ``device``.

    transformers partitions models inside ``zero.Init`` while an ``HfDeepSpeedConfig`` is alive; the
    flag is hidden here (:func:`~rlhfkit.models.loading.plain_init`). (A plain ``cls(config)`` ignores
    it today, but ``post_init`` may consult it.)
    """
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover - transformers 4
        from transformers.modeling_utils import no_init_weights

    saved_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with plain_init(), no_init_weights(), torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved_dtype)


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype holding most of the weights (a bf16 model with fp32 LoRA adapters is bf16)."""
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.dtype.is_floating_point:
            counts[p.dtype] = counts.get(p.dtype, 0) + int(getattr(p, "ds_numel", p.numel()))
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def build_inference_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A plain (unpartitioned, hook-free, eval-mode) model of the actor's class and config.

    Its parameters hold garbage until :func:`load_gathered_weights` fills them.
    """
    hf = hf_model_of(module)
    config = copylib.deepcopy(hf.config)
    with _plain_init(_param_dtype(hf), device):
        model = type(hf)(config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # skipped with the weight init; the copy shares tied tensors like the actor
    if is_zero3_partitioned(model):
        raise RuntimeError(
            "the inference copy came out ZeRO-3 partitioned: rollout.generate() was called inside a "
            "deepspeed.zero.Init context; call it outside")
    # Parameters keep requires_grad=True: generate() runs under no_grad anyway, and on CPU torch's bf16
    # linear is measurably slower (~30% here) with weights that do not require grad.
    fp32_products(model)
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# Filling the copy from the (possibly partitioned, possibly LoRA) actor.


def _active_module(mod: torch.nn.Module) -> torch.nn.Module:
    """Look through peft's ``ModulesToSaveWrapper`` to the module that runs in forward."""
    if type(mod).__name__ == "ModulesToSaveWrapper":
        adapters = mod.active_adapters
        if not mod.disable_adapters and adapters and adapters[0] in mod.modules_to_save:
            return mod.modules_to_save[adapters[0]]
        return mod.original_module
    return mod


def _is_lora_layer(mod: torch.nn.Module) -> bool:
    return hasattr(mod, "lora_A") and hasattr(mod, "get_base_layer") and hasattr(mod, "get_delta_weight")


def _is_other_peft_layer(mod: torch.nn.Module) -> bool:
    return hasattr(mod, "get_base_layer") and hasattr(mod, "active_adapters") and not _is_lora_layer(mod)


def _resolve(root: torch.nn.Module, name: str) -> torch.nn.Module:
    mod = root
    for part in name.split(".") if name else []:
        mod = _active_module(mod)
        try:
            mod = getattr(mod, part)
        except AttributeError as e:
            raise RuntimeError(f"cannot map the inference copy's module '{name}' onto the actor "
                               f"({type(root).__name__}): no '{part}'") from e
    return _active_module(mod)


def _source_params(src: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The actor parameters needed to produce one copy module's own tensors."""
    if _is_lora_layer(src):
        return list(src.parameters())  # base layer + lora_A/B (+ DoRA magnitude) of every adapter
    return [p for p in src._parameters.values() if p is not None]


def _merged_lora(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base layer's tensors with the active, not-yet-merged adapters folded in, as peft's
    ``merge_and_unload`` computes them."""
    base = layer.get_base_layer()
    tensors = {n: p.detach().clone() for n, p in base._parameters.items() if p is not None}
    if getattr(layer, "disable_adapters", False):
        return tensors
    merged = set(getattr(layer, "merged_adapters", []))
    variants = getattr(layer, "lora_variant", {}) or {}
    lora_keys = set(layer.lora_A.keys()) | set(getattr(layer, "lora_embedding_A", {}).keys())
    for adapter in layer.active_adapters:
        if adapter in merged or adapter not in lora_keys:
            continue
        weight = tensors["weight"]
        if adapter in variants:  # DoRA and friends know how to merge themselves
            tensors["weight"] = variants[adapter].merge_safe(layer, adapter, weight)
        else:
            tensors["weight"] = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        if getattr(layer, "lora_bias", {}).get(adapter):
            if "bias" not in tensors:
                raise ConfigError("a LoRA adapter with lora_bias=True targets a layer without bias; it cannot be merged")
            bias = tensors["bias"]
            tensors["bias"] = bias + (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(bias.dtype)
    return tensors


def _fill_module(name: str, dst: torch.nn.Module, src: torch.nn.Module, todo: list[str],
                 owned: dict[int, torch.Tensor]) -> None:
    """Fill ``dst``'s parameters named in ``todo`` (and its buffers) from ``src``.

    ``owned`` maps ``id(actor parameter)`` to a full tensor this module gathered itself: the copy
    adopts it as its storage (no copy). Anything else is read from the (GatheredParameters-
    materialised or never partitioned) actor parameter and copied.
    """
    if _is_lora_layer(src):
        tensors = _merged_lora(src)
        buffers_from = src.get_base_layer()
    elif _is_other_peft_layer(src):
        raise ConfigError(f"the hf rollout backend can merge LoRA adapters only; '{name}' is a "
                          f"{type(src).__name__}. Merge the adapter first or use LoRA")
    else:
        tensors = {n: p for n, p in src._parameters.items() if p is not None}
        buffers_from = src
    with torch.no_grad():
        for pname in todo:
            target = dst._parameters[pname]
            source = tensors.get(pname)
            adopt = source is not None and id(source) in owned
            if adopt:
                source = owned[id(source)]
            if source is None or source.shape != target.shape:
                got = "nothing" if source is None else f"shape {tuple(source.shape)}"
                raise RuntimeError(f"inference copy: '{name}.{pname}' wants shape {tuple(target.shape)}, "
                                   f"the actor gave {got}")
            if adopt:
                target.data = source  # the gathered buffer becomes the copy's storage (actor's dtype)
            else:
                target.copy_(source)
        for bname, buf in dst._buffers.items():
            source = buffers_from._buffers.get(bname)
            if buf is not None and source is not None:
                dst._buffers[bname] = source.detach().to(buf.device, copy=True)


def _direct_gather_ok(params: list[torch.nn.Parameter]) -> bool:
    """Whether every partitioned parameter's local shard is at hand (no NVMe swap, no quantised
    weights), so :func:`_gather_direct` can all-gather the shards itself."""
    for p in params:
        if not hasattr(p, "ds_id"):
            continue
        shard = getattr(p, "ds_tensor", None)
        group = getattr(p, "ds_process_group", None)
        if shard is None or group is None or hasattr(shard, "ds_quant_scale"):
            return False
        if shard.numel() * torch.distributed.get_world_size(group) < p.ds_numel:
            return False
    return True


def _gather_direct(params: list[torch.nn.Parameter], device: torch.device) -> dict[int, torch.Tensor]:
    """Full copies of ZeRO-3 ``params``, gathered from their shards into new tensors.

    ZeRO-3 flattens a parameter, pads it to a multiple of the group size and gives rank r the r-th
    equal slice (``ds_tensor``); an all-gather of the slices, cut to ``ds_numel``, is the parameter.
    The actor's parameters are only read: their ZeRO status is never changed.
    """
    from deepspeed import comm  # ZeRO's own all-gather: shared memory on one CPU host (rlhfkit.shm_collectives)

    unique = sorted({id(p): p for p in params if hasattr(p, "ds_id")}.values(), key=lambda p: p.ds_id)
    pending = []
    for p in unique:
        shard = p.ds_tensor.data.to(device).view(-1)
        out = torch.empty(shard.numel() * comm.get_world_size(p.ds_process_group), dtype=shard.dtype, device=device)
        pending.append((p, out, comm.all_gather_into_tensor(out, shard, group=p.ds_process_group, async_op=True)))
    full = {}
    for p, out, work in pending:
        work.wait()  # gloo handles are independent: wait on each
        full[id(p)] = out[:p.ds_numel].view(p.ds_shape)
    return full


def load_gathered_weights(copy_model: torch.nn.Module, module: torch.nn.Module, bucket_numel: int,
                          direct: bool = True) -> None:
    """Load the actor's full weights into ``copy_model``; collective under ZeRO-3.

    Every rank walks the modules in the same order and gathers the same buckets (sorted by
    ``ds_id``), so the collectives line up. Tied parameters are filled once. Plain layers are
    gathered straight from their shards into tensors the copy adopts (``direct``; one all-gather per
    parameter, no copy, the actor untouched); LoRA layers, and every layer when a shard is not at
    hand on some rank, go through ``deepspeed.zero.GatheredParameters`` (peft's merge reads the
    module's own parameters).
    """
    import deepspeed

    device = next(iter(copy_model.parameters())).device
    src_root = hf_model_of(module)
    plan: list[tuple[str, torch.nn.Module, torch.nn.Module, list[str]]] = []
    seen: set[int] = set()
    for name, dst in copy_model.named_modules():
        todo = []
        for pname, p in dst._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                todo.append(pname)
        if todo or any(b is not None for b in dst._buffers.values()):
            plan.append((name, dst, _resolve(src_root, name), todo))

    if direct and is_zero3_partitioned(module):
        ok = torch.tensor([int(_direct_gather_ok([p for _, _, src, todo in plan if todo for p in _source_params(src)]))],
                          device=device)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)  # every rank takes the same path
        direct = bool(ok.item())

    def numel(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    bucket: list[tuple[str, torch.nn.Module, torch.nn.Module, list[str]]] = []
    size = 0
    for i, item in enumerate(plan):
        bucket.append(item)
        size += sum(numel(p) for p in _source_params(item[2])) if item[3] else 0
        if size < bucket_numel and i < len(plan) - 1:
            continue
        via_direct = [p for _, _, src, todo in bucket if todo and direct and not _is_lora_layer(src)
                      for p in _source_params(src)]
        via_context = [p for _, _, src, todo in bucket if todo and not (direct and not _is_lora_layer(src))
                       for p in _source_params(src)]
        owned = _gather_direct(via_direct, device) if via_direct else {}
        with deepspeed.zero.GatheredParameters(via_context, modifier_rank=None):
            for name, dst, src, todo in bucket:
                _fill_module(name, dst, src, todo, owned)
        bucket, size = [], 0
