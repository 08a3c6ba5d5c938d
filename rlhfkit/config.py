"""Typed configs shared by the programs, and the CLI generated from them.

Each program declares ONE dataclass built from the parts below (dataclass inheritance), e.g.
``class SFTConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs)``. Every field
is documented where it is declared (the ``help`` text is what ``--help`` prints); flag names follow
DeepSpeed-Chat where it has one. :func:`parse_config` builds the command line from the dataclass
with transformers' ``HfArgumentParser``; ``--config FILE.json|yaml`` loads the same fields from a
file (command-line flags win). Derived values (world size, global batch) are computed in
:mod:`rlhfkit.distributed` / :mod:`rlhfkit.ds_config`, never by mutating the config in a program.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from rlhfkit.errors import ConfigError

T = TypeVar("T")


def arg(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its ``--help`` text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class LoadArgs:
    trust_remote_code: bool = arg(False, "Allow model code shipped inside model directories to run (off: only built-in architectures load).")
    allow_pickle_weights: bool = arg(False, "Allow loading pickled weights (.bin/.pt). Off: only safetensors load.")


@dataclass
class ModelArgs(LoadArgs):
    model_name_or_path: Optional[str] = arg(
        None, "Model directory: an rlhfkit checkpoint of the previous step, or any Hugging Face model directory (required).")
    dropout: Optional[float] = arg(None, "Override the model's dropout probabilities (None keeps the model's own).")
    gradient_checkpointing: bool = arg(False, "Recompute activations in the backward pass to save memory.")
    attn_implementation: str = arg(
        "auto", "Attention kernel of the trained model, passed to transformers (sdpa, eager, flash_attention_2, ...). "
        "auto: eager on the CPU up to --max_seq_len 512 (its backward is faster there; not in bf16 on a CPU "
        "without bf16 kernels), else the model's default.")


MAX_PER_PROMPT_HELP = ("At most this many rows of each prompt in this step's share, training and held-out alike (a seeded "
                       "draw; None: all). AlpacaEval-style sets hold several pairs per instruction: 1 weighs every "
                       "instruction once and keeps held-out pairs independent.")


@dataclass
class DataArgs:
    data_path: list[str] = arg(
        [], "One or more data files/directories (blended), or hub dataset names when online. Formats are detected by content.")
    data_split: str = arg("2,4,4", "Shares of each data source for steps 1,2,3 (DeepSpeed-Chat style), e.g. 2,4,4 or 10,0,0.")
    eval_fraction: float = arg(0.1, "Fraction of this step's share held out for evaluation.")
    max_eval_samples: Optional[int] = arg(None, "Cap on the held-out evaluation set (None: all of it).")
    max_per_prompt: Optional[int] = arg(None, MAX_PER_PROMPT_HELP)
    max_seq_len: int = arg(512, "Maximum tokens of prompt + response; prompts are left-truncated first, then responses cut.")
    strict: bool = arg(False, "Fail on the first malformed data row instead of skipping and counting it.")
    group_by_length: bool = arg(True, "Batch training rows of similar length together (less padding; same rows per epoch).")


@dataclass
class AdamArgs:
    adam_beta1: float = arg(0.9, "AdamW beta1.")
    adam_beta2: float = arg(0.95, "AdamW beta2.")
    lr_scheduler_type: str = arg("cosine", "Learning-rate schedule: linear, cosine, cosine_with_restarts, polynomial, constant, constant_with_warmup.")
    num_warmup_steps: int = arg(0, "Warm-up optimiser steps of the schedule.")
    gradient_clipping: float = arg(1.0, "Clip the global gradient norm to this value (0 disables).")


@dataclass
class RunLengthArgs:
    num_train_epochs: int = arg(1, "Passes over the training data.")
    max_steps: Optional[int] = arg(None, "Stop after this many optimiser steps (None: run all epochs).")


@dataclass
class OptimArgs(AdamArgs, RunLengthArgs):
    per_device_train_batch_size: int = arg(4, "Micro-batch size per rank for training.")
    per_device_eval_batch_size: int = arg(8, "Batch size per rank for evaluation.")
    gradient_accumulation_steps: int = arg(1, "Micro-batches accumulated per optimiser step.")
    learning_rate: float = arg(1e-5, "Peak learning rate.")
    weight_decay: float = arg(0.0, "AdamW weight decay (not applied to biases and norm weights).")


ZERO3_BLOCK_LEAVES_HELP = ("Under ZeRO-3, gather, release and reduce each transformer block (the model's _no_split_modules) "
                           "as one unit instead of linear layer by linear layer (DeepSpeed leaf modules; fewer hooks and "
                           "collectives, same math).")


@dataclass
class RuntimeArgs:
    offload: bool = arg(False, "Offload optimizer state (and parameters under ZeRO-3) to CPU memory.")
    zero3_block_leaves: bool = arg(True, ZERO3_BLOCK_LEAVES_HELP)
    compile_blocks: bool = arg(False, "torch.compile each transformer block's forward for training passes (dynamic shapes; "
                               "evaluation and generation stay eager). Costs a compile of some seconds at the first step.")
    dtype: str = arg("bf16", "Training dtype: bf16, fp16 or fp32.")
    local_rank: int = arg(-1, "Set by the deepspeed launcher; do not pass by hand.")
    dist_timeout_s: int = arg(600, "Timeout of collective operations in seconds: a dead rank ends the job instead of hanging it.")
    seed: int = arg(1234, "Random seed (data split, shuffling, initialisation, sampling).")


@dataclass
class DeepSpeedArgs(RuntimeArgs):
    zero_stage: int = arg(0, "ZeRO stage 0-3.")


@dataclass
class LoraArgs:
    lora_dim: int = arg(0, "LoRA rank (0 disables LoRA).")
    lora_alpha: Optional[float] = arg(None, "LoRA alpha (default: equal to lora_dim, i.e. scaling 1).")
    lora_module_name: str = arg(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "Comma-separated module-name suffixes that get LoRA adapters (peft target_modules).")
    only_optimize_lora: bool = arg(False, "Train only the LoRA weights (the base stays frozen).")
    lora_learning_rate: Optional[float] = arg(None, "Learning rate of the LoRA weights (default: learning_rate).")


@dataclass
class FreezeArgs:
    train_top_blocks: Optional[int] = arg(None, "Train only the last N transformer blocks, the final norm and the head "
                                                "(0: the head alone); the blocks below stay frozen and need no backward "
                                                "pass. None: every weight.")


@dataclass
class PairArgs:
    pack_pairs: bool = arg(True, "Train on each pair as one row: the shared prompt once, then the chosen and the "
                                 "rejected response, each attending to the prompt and itself (a 4D attention mask; "
                                 "same results and gradients, ~40%% fewer tokens on hh-rlhf). Evaluation always "
                                 "runs the two sequences apart.")


@dataclass
class LogArgs:
    output_dir: Optional[str] = arg(None, "Where the checkpoint directory is written (required).")
    report_to: str = arg("tensorboard,jsonl", "Where metrics go, comma-separated: jsonl (always: logs/metrics.jsonl, read by "
                                              "rlhfkit report), tensorboard (logs/tensorboard), wandb (offline unless WANDB_MODE "
                                              "or WANDB_API_KEY; pip install rlhfkit[wandb]), mlflow ($MLFLOW_TRACKING_URI or "
                                              "logs/mlruns; pip install rlhfkit[mlflow]); none: jsonl only.")
    enable_tensorboard: bool = arg(False, "DeepSpeed-Chat's flag: adds tensorboard to --report_to.")
    tensorboard_path: Optional[str] = arg(None, "TensorBoard directory (default: <output_dir>/logs/tensorboard).")
    eval_interval: int = arg(0, "Evaluate every N optimiser steps (0: only before and after training).")
    log_interval: int = arg(1, "Log training metrics every N optimiser steps.")
    progress_bar: bool = arg(True, "Show a progress bar with ETA on rank 0.")
    save_interval: int = arg(0, "Save a training state every N optimiser steps under <output_dir>/training_state (0: never).")
    keep_last_k: int = arg(2, "Training states kept; older ones are deleted once a newer one is complete.")
    resume: Optional[str] = arg(None, "'auto' (the newest complete state in --output_dir, if any) or a training-state directory.")
    preempt_signals: str = arg("SIGTERM,SIGUSR1", "Signals that preempt the run (comma-separated; none: none): every rank "
                                                   "ends its step, a training state is saved, and the program exits with "
                                                   "status 75 (README, Preemption). A requeued SLURM job "
                                                   "(SLURM_RESTART_COUNT > 0) resumes by itself.")
    resume_allow_config_change: bool = arg(False, "Resume even if settings that change the run differ from the saved run's.")
    resume_allow_world_size_change: bool = arg(
        False, "Resume a training state saved with another number of ranks (steps 1, 2 and DPO): the ZeRO state is "
        "re-partitioned and the global batch kept by changing the per-rank micro-batch or the gradient accumulation; "
        "not bit-identical to an uninterrupted run (README, Training states).")
    max_nonfinite_steps: int = arg(10, "Stop after this many consecutive NaN/Inf losses (each such update is skipped).")


def _load_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text)
        else:
            values = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise ConfigError(f"--config {path}: cannot parse ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    return values


def parse_config(cls: type[T], argv: Optional[list[str]] = None) -> T:
    """Parse ``argv`` (default ``sys.argv[1:]``) into an instance of the dataclass ``cls``.

    ``--config FILE`` (JSON or YAML, keys = field names) supplies defaults; flags on the command line
    override it. Unknown flags and unknown file keys are errors.
    """
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(cls, allow_abbrev=False)  # --learning_rat must not silently mean --learning_rate
    parser.add_argument("--config", default=None, help="JSON or YAML file with any of these flags (command line wins).")
    names = {f.name for f in dataclasses.fields(cls)}
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        ns, _ = parser.parse_known_args(argv)
        values = _load_file(ns.config)
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"--config {ns.config}: unknown field(s) {', '.join(unknown)}")
        parser.set_defaults(**values)
    namespace = parser.parse_args(argv)
    kwargs = {k: v for k, v in vars(namespace).items() if k in names}
    cfg = cls(**kwargs)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def config_dict(cfg: Any) -> dict:
    """The config as a plain JSON-able dict (stored in manifests and training states)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def require(cfg: Any, *names: str) -> None:
    """Raise a ConfigError naming the flags among ``names`` that are unset."""
    missing = [n for n in names if getattr(cfg, n) in (None, "", [])]
    if missing:
        raise ConfigError("missing required flag(s): " + ", ".join("--" + n for n in missing))


def check_common(cfg: Any) -> None:
    """Checks every program shares (called from each config's ``validate``)."""
    if hasattr(cfg, "report_to"):
        from rlhfkit.trackers import parse_report_to

        parse_report_to(cfg.report_to)
    if hasattr(cfg, "zero_stage") and cfg.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero_stage {cfg.zero_stage} is out of range: use 0, 1, 2 or 3")
    if hasattr(cfg, "dtype") and cfg.dtype not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"--dtype {cfg.dtype}: use bf16, fp16 or fp32")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "max_seq_len"):
        if hasattr(cfg, name) and getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1 (got {getattr(cfg, name)})")
    if getattr(cfg, "max_steps", None) is not None and cfg.max_steps < 1:
        raise ConfigError(f"--max_steps must be >= 1 (got {cfg.max_steps})")
    if getattr(cfg, "pack_pairs", False) and cfg.attn_implementation.startswith("flash_attention"):
        raise ConfigError(f"--pack_pairs needs an attention kernel that takes a 4D mask (eager, sdpa); with "
                          f"--attn_implementation {cfg.attn_implementation} pass --pack_pairs false")
