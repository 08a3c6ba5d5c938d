"""Step 1 (SFT) flags: one typed config made of the shared parts of :mod:`rlhfkit.config`."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config import DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, check_common, require


@dataclass
class SFTConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs):
    """Step 1 flags (DeepSpeed-Chat names where it has them)."""

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)
