"""Step 2 (reward model) flags: one typed config, step 1's shared parts of :mod:`rlhfkit.config`
plus the pair options, with the reward model's own defaults."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.errors import ConfigError

from rlhfkit.config import (
    DataArgs, DeepSpeedArgs, FreezeArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, PairArgs, arg, check_common, require,
)


@dataclass
class RewardConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs, PairArgs, FreezeArgs):
    """Step 2 flags: those of step 1 (DeepSpeed-Chat names). No --num_padding_at_beginning: the
    score is read at the last real token, whatever the padding."""

    learning_rate: float = arg(5e-6, "Peak learning rate.")
    per_device_train_batch_size: int = arg(2, "Pairs per rank per micro-batch (each pair = 2 sequences in one forward).")

    fit_head_only: bool = arg(False, "Keep the whole body frozen and fit only the score head, exactly: every training pair "
                                     "is scored once and the head is the L2-regularised Bradley-Terry (logistic) fit on "
                                     "what it reads, the L2 strength chosen by 5-fold cross-validation on the training "
                                     "pairs. One forward pass over the pairs, no backward; the learning-rate, step and "
                                     "epoch flags are unused.")

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)
        if self.train_top_blocks is not None and self.train_top_blocks < 0:
            raise ConfigError(f"--train_top_blocks {self.train_top_blocks}: use 0 (the head alone) or more blocks")
        if self.train_top_blocks is not None and self.lora_dim:
            raise ConfigError("--train_top_blocks and --lora_dim both choose what trains: pass one of them")
        if self.fit_head_only:
            if self.lora_dim or self.train_top_blocks:
                raise ConfigError("--fit_head_only trains the score head alone: drop --lora_dim / --train_top_blocks")
            self.train_top_blocks = 0  # the body frozen: no backward pass, no optimizer state for it
