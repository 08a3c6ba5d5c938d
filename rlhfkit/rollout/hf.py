"""``--rollout_backend hf``: the project's hybrid engine (CPU and GPU).

Under ZeRO-3 a plain ``generate`` all-gathers every layer for every new token (DESIGN section 5).
This backend instead gathers the actor's weights once per call into an *inference copy*
(:class:`~rlhfkit.models.gathered.GatheredCopy`: a plain model of the same class, no ZeRO hooks,
LoRA adapters merged). Each rank then generates its own prompts with a KV cache and no collectives,
so ranks may finish at different times and produce different lengths. On one CPU host the ranks
share their decode steps instead, each streaming a share of the weights for every rank's rows
(:mod:`~rlhfkit.rollout.shared_decode`: the same tokens). The copy is dropped
afterwards, or kept with ``keep_copy=True`` (its weights are refreshed on every call); it is the
engine's :attr:`~HFRolloutEngine.inference_copy`, which step 3's experience pass reuses.

ZeRO 0-2 actors (and plain modules) hold full weights already: they generate directly, in eval mode.

The training engine does not notice: its weights are only read, and every submodule's train/eval
mode and the model's ``generation_config`` are restored.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models.gathered import (  # noqa: F401 - GatheredCopy and its helpers lived here: re-exported
    DEFAULT_BUCKET_NUMEL,
    GatheredCopy,
    build_inference_copy,
    hf_model_of,
    load_gathered_weights,
    unwrap_engine,
)
from rlhfkit.rollout.base import (
    GenerationConfig,
    PromptBatch,
    RolloutBackend,
    RolloutBatch,
    RolloutOptions,
    empty_rollout,
    eval_mode,
)
from rlhfkit.rollout.sampling import hf_generate
from rlhfkit.rollout.shared_decode import decode_group


class HFRolloutEngine(RolloutBackend):
    """Gather-once hybrid engine: a :class:`GatheredCopy` of the actor generates.

    Args:
        engine: a ``DeepSpeedEngine`` (any ZeRO stage) around a Hugging Face causal LM, possibly a peft
            LoRA model, or such a model itself.
        keep_copy: keep the ZeRO-3 inference copy between calls (more memory, no rebuild);
            ``RolloutOptions.keep_copy``.
        bucket_numel, direct_gather: see :class:`GatheredCopy`.
    """

    @classmethod
    def init_kwargs(cls, options: RolloutOptions) -> dict[str, Any]:
        return {"keep_copy": options.keep_copy}

    def __init__(self, engine: Any, *, keep_copy: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 direct_gather: bool = True):
        self.engine = engine
        self.module = unwrap_engine(engine)
        if not hasattr(self.module, "generate"):
            raise ConfigError(f"the actor {type(self.module).__name__} has no generate(); it must be a causal LM")
        self.copy = GatheredCopy(engine, keep=keep_copy, bucket_numel=bucket_numel, direct_gather=direct_gather)
        self.device = self.copy.device
        self.last_timings: dict[str, float] = {}  # seconds of the last call: gather (copy refresh), generate

    @property
    def inference_copy(self) -> GatheredCopy:
        """The copy this engine generates with (under ZeRO-3; otherwise it hands out the actor itself)."""
        return self.copy

    @property
    def _copy(self) -> torch.nn.Module | None:
        return self.copy._copy

    def generate(self, prompts: PromptBatch, gen: GenerationConfig) -> RolloutBatch:
        """Collective under ZeRO-3 (every rank gathers); the generation itself is rank-local."""
        if not self.copy.partitioned:
            t0 = time.perf_counter()
            with eval_mode(self.module):
                out = (empty_rollout(prompts, self.device) if len(prompts) == 0 else
                       hf_generate(self.module, prompts, gen, self.device, synced_gpus=False))
            self.last_timings = {"gather": 0.0, "generate": time.perf_counter() - t0}
            return out

        t0 = time.perf_counter()
        model = self.copy.model()
        t1 = time.perf_counter()
        try:
            # the ranks share their decode steps where every one of them can (collective)
            group = decode_group(hf_model_of(model), len(prompts), gen.max_new_tokens)
            if len(prompts) == 0:
                return empty_rollout(prompts, self.device)
            return hf_generate(model, prompts, gen, self.device, synced_gpus=False, group=group)
        finally:
            del model
            self.copy.done()
            self.last_timings = {"gather": t1 - t0, "generate": time.perf_counter() - t1}

    def release(self) -> None:
        """Drop the inference copy (and its memory)."""
        self.copy.release()
