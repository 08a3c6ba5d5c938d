"""``--rollout_backend hf-synced``: the naive DeepSpeed-Chat way, kept as the benchmark baseline.

``module.generate(..., synced_gpus=True)`` on the ZeRO-3 module itself: every forward of every new
token all-gathers each layer's weights, and every rank keeps stepping (on a dummy input once its
own sequences are done) until the slowest rank finishes, so the collectives line up.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.models.gathered import is_zero3_partitioned, model_device, unwrap_engine
from rlhfkit.rollout.base import GenerationConfig, PromptBatch, RolloutBackend, RolloutBatch, empty_rollout, eval_mode, world_size
from rlhfkit.rollout.sampling import hf_generate


class HFSyncedRolloutEngine(RolloutBackend):
    """``generate(synced_gpus=True)`` on the sharded actor. Collective: every rank calls it together."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.module = unwrap_engine(engine)
        self.device = model_device(engine, self.module)

    def generate(self, prompts: PromptBatch, gen: GenerationConfig) -> RolloutBatch:
        synced = is_zero3_partitioned(self.module) and world_size() > 1
        with eval_mode(self.module):
            if len(prompts) == 0:
                if synced:  # the other ranks' forwards still need this rank's shards: step along on a dummy prompt
                    dummy = torch.full((1, 1), gen.pad_token_id, dtype=prompts.input_ids.dtype)
                    hf_generate(self.module, PromptBatch(dummy, torch.ones_like(dummy)), gen, self.device, synced_gpus=True)
                return empty_rollout(prompts, self.device)
            return hf_generate(self.module, prompts, gen, self.device, synced_gpus=synced)
