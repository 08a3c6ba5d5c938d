"""Rollout engines: one interface, backends chosen by ``--rollout_backend`` (DESIGN section 5).

    rollout = make_rollout_engine("hf", actor_engine, keep_copy=False)
    batch = rollout.generate(PromptBatch(input_ids, attention_mask), GenerationConfig(max_new_tokens=..., ...))

Backends are imported lazily (as in verl's rollout registry), so a CPU machine never imports
CUDA-only code.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.base import GenerationConfig, PromptBatch, RolloutBatch, RolloutEngine, postprocess

# name -> "module:class"; each class takes (engine, **options)
_BACKENDS: dict[str, str] = {
    "hf": "rlhfkit.rollout.hf:HFRolloutEngine",
    "hf-synced": "rlhfkit.rollout.hf_synced:HFSyncedRolloutEngine",
    "deepspeed": "rlhfkit.rollout.deepspeed_he:DeepSpeedHERolloutEngine",
}
ROLLOUT_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)  # choices for --rollout_backend
DEFAULT_ROLLOUT_BACKEND = "hf"


def make_rollout_engine(name: str, engine: Any, **options: Any) -> RolloutEngine:
    """The rollout backend ``name`` around ``engine`` (a DeepSpeedEngine or an nn.Module).

    Options go to the backend (``hf``: ``keep_copy``, ``bucket_numel``); an option the backend does
    not take is a ConfigError.
    """
    if name not in _BACKENDS:
        raise ConfigError(f"unknown rollout backend '{name}'; choose one of {', '.join(ROLLOUT_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    try:
        inspect.signature(cls).bind(engine, **options)
    except TypeError as e:
        raise ConfigError(f"rollout backend '{name}' does not take option(s) {sorted(options)}: {e}") from e
    return cls(engine, **options)


__all__ = [
    "GenerationConfig",
    "PromptBatch",
    "RolloutBatch",
    "RolloutEngine",
    "postprocess",
    "make_rollout_engine",
    "ROLLOUT_BACKENDS",
    "DEFAULT_ROLLOUT_BACKEND",
]
