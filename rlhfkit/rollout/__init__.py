"""Rollout engines: one interface, backends chosen by ``--rollout_backend`` (DESIGN section 5).

A program treats every backend alike::

    options = RolloutOptions(keep_copy=..., inference_tp_size=..., ...)   # from its flags
    check_backend(name)                                  # before loading models: e.g. deepspeed without CUDA
    hybrid_engine = training_engine_options(name, options)   # the actor's DeepSpeed config section, or None
    rollout = make_rollout_engine(name, actor_engine, options)
    batch = rollout.generate(PromptBatch(input_ids, attention_mask), GenerationConfig(max_new_tokens=..., ...))
    rollout.inference_copy   # the gathered actor it generated with (for the experience pass), or None

Backends are imported lazily (as in verl's rollout registry), so a CPU machine never imports
CUDA-only code.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.base import (
    GenerationConfig,
    PromptBatch,
    RolloutBackend,
    RolloutBatch,
    RolloutEngine,
    RolloutOptions,
    empty_responses,
    postprocess,
)

# name -> "module:class"; each class is a RolloutBackend taking (engine, **options)
_BACKENDS: dict[str, str] = {
    "hf": "rlhfkit.rollout.hf:HFRolloutEngine",
    "hf-synced": "rlhfkit.rollout.hf_synced:HFSyncedRolloutEngine",
    "deepspeed": "rlhfkit.rollout.deepspeed_he:DeepSpeedHERolloutEngine",
}
ROLLOUT_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)  # choices for --rollout_backend
DEFAULT_ROLLOUT_BACKEND = "hf"


def _backend_class(name: str) -> type[RolloutBackend]:
    if name not in _BACKENDS:
        raise ConfigError(f"unknown rollout backend '{name}'; choose one of {', '.join(ROLLOUT_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def check_backend(name: str) -> None:
    """Raise the backend's ConfigError if this machine cannot run it (``deepspeed`` without CUDA), or if
    ``name`` is no backend; call it before loading any model."""
    _backend_class(name).check_environment()


def training_engine_options(name: str, options: RolloutOptions) -> dict | None:
    """The ``hybrid_engine`` section the actor's DeepSpeed training engine needs for backend ``name``
    (``deepspeed``: DeepSpeed's Hybrid Engine settings from ``options``), or None."""
    return _backend_class(name).training_engine_options(options)


def make_rollout_engine(name: str, engine: Any, options: RolloutOptions | None = None, **kwargs: Any) -> RolloutEngine:
    """The rollout backend ``name`` around ``engine`` (a DeepSpeedEngine or an nn.Module).

    ``options`` are the program's; the backend takes the fields it uses. ``kwargs`` go to the
    backend's constructor as they are (``hf``: ``keep_copy``, ``bucket_numel``, ``direct_gather``);
    an option the backend does not take, or one given both ways, is a ConfigError.
    """
    cls = _backend_class(name)
    if options is not None:
        from_options = cls.init_kwargs(options)
        if twice := sorted(set(from_options) & set(kwargs)):
            raise ConfigError(f"rollout backend '{name}': option(s) {twice} given both in RolloutOptions and as keywords")
        kwargs = {**from_options, **kwargs}
    try:
        inspect.signature(cls).bind(engine, **kwargs)
    except TypeError as e:
        raise ConfigError(f"rollout backend '{name}' does not take option(s) {sorted(kwargs)}: {e}") from e
    return cls(engine, **kwargs)


__all__ = [
    "GenerationConfig",
    "PromptBatch",
    "RolloutBackend",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutOptions",
    "empty_responses",
    "postprocess",
    "check_backend",
    "training_engine_options",
    "make_rollout_engine",
    "ROLLOUT_BACKENDS",
    "DEFAULT_ROLLOUT_BACKEND",
]
