"""``--rollout_backend deepspeed``: DeepSpeed's own Hybrid Engine (CUDA only).

The actor engine must have been created with ``"hybrid_engine": {"enabled": true}`` in its DeepSpeed
config (``--enable_hybrid_engine``); DeepSpeed then swaps its fused inference kernels in on
``engine.eval()`` and gathers ZeRO-3 weights itself inside ``engine.generate``. Only the
architectures DeepSpeed has inference containers for work, and its LoRA fusion knows DeepSpeed-Chat's
own LoRA layers, not peft's, so a peft actor is refused (use ``hf``, which merges peft adapters).

This module imports nothing CUDA-specific at import time; the check for CUDA comes first.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models.gathered import hf_model_of, is_peft_model, model_device
from rlhfkit.rollout.base import GenerationConfig, PromptBatch, RolloutBackend, RolloutBatch, RolloutOptions, postprocess, world_size
from rlhfkit.rollout.sampling import isolated_generation_config

CUDA_MESSAGE = ("--rollout_backend deepspeed / --enable_hybrid_engine needs CUDA (DeepSpeed's Hybrid Engine kernels); "
                "on CPU use --rollout_backend hf")


def _cuda_accelerator() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:  # pragma: no cover - deepspeed is a hard dependency
        return False
    return get_accelerator().device_name() == "cuda"


class DeepSpeedHERolloutEngine(RolloutBackend):
    """``engine.generate`` of a ``DeepSpeedHybridEngine``. Collective: every rank calls it together.

    The actor's training engine must be built with :meth:`training_engine_options` as its
    ``hybrid_engine`` section.
    """

    @classmethod
    def check_environment(cls) -> None:
        if not _cuda_accelerator():
            raise ConfigError(CUDA_MESSAGE)

    @classmethod
    def training_engine_options(cls, options: RolloutOptions) -> dict:
        return {"inference_tp_size": options.inference_tp_size, "release_inference_cache": options.release_inference_cache,
                "pin_parameters": options.pin_parameters, "tp_gather_partition_size": options.tp_gather_partition_size}

    def __init__(self, engine: Any):
        self.check_environment()
        from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

        if not isinstance(engine, DeepSpeedHybridEngine):
            raise ConfigError("--rollout_backend deepspeed needs the actor's DeepSpeed engine created with "
                              "hybrid_engine.enabled (--enable_hybrid_engine); got "
                              f"{type(engine).__name__}. Enable it, or use --rollout_backend hf")
        if is_peft_model(engine.module):
            raise ConfigError("DeepSpeed's Hybrid Engine does not fuse peft LoRA adapters (it would generate "
                              "with the base weights only); use --rollout_backend hf with LoRA")
        if not getattr(engine, "_inference_containers", None):
            raise ConfigError(f"DeepSpeed's Hybrid Engine has no inference kernels for "
                              f"{type(engine.module).__name__}; use --rollout_backend hf")
        self.engine = engine
        self.module = engine.module
        self.device = model_device(engine, self.module)

    def generate(self, prompts: PromptBatch, gen: GenerationConfig) -> RolloutBatch:
        if len(prompts) == 0:
            raise ValueError("the deepspeed rollout backend needs at least one prompt on every rank")
        input_ids = prompts.input_ids.to(self.device)
        attention_mask = prompts.attention_mask.to(self.device)
        P = input_ids.shape[1]
        # Under ZeRO-3 the embeddings and head stay sharded outside the fused layers: keep ranks in step.
        synced = self.engine.zero_optimization_stage() == 3 and world_size() > 1
        modes = [(m, m.training) for m in self.module.modules()]
        self.engine.eval()  # swaps the inference containers in
        try:
            with isolated_generation_config(hf_model_of(self.module)), torch.no_grad():
                out = self.engine.generate(input_ids=input_ids, attention_mask=attention_mask,
                                           generation_config=gen.to_hf(), synced_gpus=synced)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:
            if _raised_in_deepspeed_kernels(e):
                raise ConfigError(_incompatible_message(self.module, e)) from e
            raise
        finally:
            self.engine.train()  # swaps the training forwards back
            for m, training in modes:
                m.training = training
        sequences = out.sequences if hasattr(out, "sequences") else out
        return postprocess(input_ids, attention_mask, sequences[:, P:], gen.eos_ids, gen.pad_token_id)


def _raised_in_deepspeed_kernels(e: BaseException) -> bool:
    """True when ``e`` came out of DeepSpeed's fused inference layers (not out of the model or our code)."""
    import traceback

    return any("deepspeed/model_implementations" in f.filename or "deepspeed/ops/transformer/inference" in f.filename
               for f in traceback.extract_tb(e.__traceback__))


def _incompatible_message(module: torch.nn.Module, e: BaseException) -> str:
    import deepspeed
    import transformers

    return (f"DeepSpeed's Hybrid Engine kernels failed on {type(module).__name__} "
            f"(deepspeed {deepspeed.__version__}, transformers {transformers.__version__}: its fused layers "
            f"predate the transformers 5 decoder-layer interface): {type(e).__name__}: {e}. "
            "Use --rollout_backend hf")
