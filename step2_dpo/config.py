"""DPO flags: one typed config, step 1's shared parts of :mod:`rlhfkit.config` plus the DPO loss and
the reference model, and the values derived from it."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config import (
    DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, PairArgs, arg, check_common, require,
)
from rlhfkit.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOArgs:
    beta: float = arg(0.1, "DPO temperature beta: strength of the implicit KL to the reference (larger: stay closer).")
    label_smoothing: float = arg(
        0.0, "Conservative DPO (Mitchell 2023): assumed probability that a preference label is flipped, in [0, 0.5). "
             "sigmoid loss only.")
    loss_type: str = arg("sigmoid", "sigmoid (DPO) or ipo (IPO, Azar et al. 2023; on summed response log-probs).")
    offload_reference_model: bool = arg(
        False, "Keep the frozen reference's parameters in CPU memory (ZeRO-3 parameter offload; the reference runs "
               "ZeRO-3 even when --zero_stage is lower).")
    reference_on_copy: bool = arg(
        True, "Under ZeRO-3 the reference's forward passes run on a gathered, hook-free full-weight copy (one all-gather "
              "a forward instead of DeepSpeed's per-layer gathers and hooks); an offloaded reference keeps the engine path.")
    keep_reference_copy: bool = arg(
        False, "Keep that copy for the whole run (the reference is frozen: gathered once): faster, one full model more "
               "in memory per rank between the reference's forward passes.")


@dataclass
class DPOConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs, PairArgs, DPOArgs):
    """DPO flags: step 1's shared flags plus the DPO loss and the reference model."""

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"--loss_type {self.loss_type}: use {' or '.join(LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0 (got {self.beta})")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError("--label_smoothing applies to --loss_type sigmoid only")
        if self.keep_reference_copy and not self.reference_on_copy:
            raise ConfigError("--keep_reference_copy keeps the copy of --reference_on_copy: set that too (or drop it)")

    @property
    def reference_zero_stage(self) -> int:
        """The frozen reference is sharded (ZeRO-3) with the policy, or whenever it is offloaded."""
        return 3 if self.zero_stage == 3 or self.offload_reference_model else 0

    @property
    def reference_on_gathered_copy(self) -> bool:
        """Whether the reference's forward passes run on a gathered copy: asked for, and the reference
        is sharded (ZeRO-3) but not offloaded (an offloaded reference keeps the engine path)."""
        return self.reference_on_copy and self.reference_zero_stage == 3 and not self.offload_reference_model
