"""DPO flags: one typed config, step 1's shared parts of :mod:`rlhfkit.config` plus the DPO loss and
the reference model, and the values derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhfkit.config import (
    DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, PairArgs, arg, check_common, require,
)
from rlhfkit.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "cdpo", "simpo", "kto")
REFERENCE_FREE = ("simpo",)  # loss types that load no reference model


@dataclass
class DPOArgs:
    beta: Optional[float] = arg(None, "Temperature beta. DPO/IPO/cDPO: strength of the implicit KL to the reference (larger: "
                                      "stay closer), default 0.1; SimPO: scale of its length-normalised reward, default 2.0 "
                                      "(the paper's range is 2-2.5).")
    label_smoothing: float = arg(
        0.0, "Conservative DPO (Mitchell 2023): assumed probability that a preference label is flipped, in [0, 0.5). "
             "sigmoid loss only; --loss_type cdpo is the same, with 0.1 when this is 0.")
    loss_type: str = arg("sigmoid", "sigmoid (DPO, Rafailov et al. 2023), ipo (IPO, Azar et al. 2023; on summed response "
                                    "log-probs), cdpo (conservative DPO: sigmoid with --label_smoothing, default 0.1), simpo "
                                    "(SimPO, Meng et al. 2024: reference-free, length-normalised; no reference model is loaded), kto "
                                    "(KTO, Ethayarajh et al. 2024: unpaired completions labelled desirable or undesirable; "
                                    "a pair gives one of each, {prompt, completion, label} rows are read too).")
    kto_lambda_d: float = arg(1.0, "KTO's weight lambda_D of the desirable completions' loss (TRL: desirable_weight).")
    kto_lambda_u: float = arg(1.0, "KTO's weight lambda_U of the undesirable completions' loss (TRL: undesirable_weight). "
                                   "The paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3].")
    simpo_gamma: float = arg(1.0, "SimPO's target reward margin gamma (the paper: gamma / beta about 0.5, so 1.0 with beta 2).")
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
            raise ConfigError(f"--loss_type {self.loss_type}: use {', '.join(LOSS_TYPES)}")
        if self.beta is None:
            self.beta = 2.0 if self.loss_type == "simpo" else 0.1
        if self.loss_type == "cdpo":  # conservative DPO is the sigmoid loss with label smoothing
            self.loss_type, self.label_smoothing = "sigmoid", self.label_smoothing or 0.1
        if self.loss_type == "kto" and self.per_device_train_batch_size < 2:
            raise ConfigError("--loss_type kto estimates its reference point from mismatched pairs (x_i, y_j), j != i, within "
                              f"a rank's micro-batch: set --per_device_train_batch_size >= 2 (got {self.per_device_train_batch_size})")
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0 (got {self.beta})")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError("--label_smoothing applies to --loss_type sigmoid only")
        if self.keep_reference_copy and not self.reference_on_copy:
            raise ConfigError("--keep_reference_copy keeps the copy of --reference_on_copy: set that too (or drop it)")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss needs the frozen reference model (SimPO does not)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def reference_zero_stage(self) -> int:
        """The frozen reference is sharded (ZeRO-3) with the policy, or whenever it is offloaded."""
        return 3 if self.zero_stage == 3 or self.offload_reference_model else 0

    @property
    def reference_on_gathered_copy(self) -> bool:
        """Whether the reference's forward passes run on a gathered copy: asked for, and the reference
        is sharded (ZeRO-3) but not offloaded (an offloaded reference keeps the engine path)."""
        return self.reference_on_copy and self.reference_zero_stage == 3 and not self.offload_reference_model
