"""Loading tokenizers and models from checkpoint directories.

- Only safetensors weights load unless ``allow_pickle`` (pickled ``.bin``/``.pt`` can run code).
- Model code shipped inside a directory runs only with ``trust_remote_code``.
- Under ZeRO-3 a model is built inside ``zero.Init`` (partitioned as it loads) when the caller passes
  the DeepSpeed config; :func:`plain_init` builds a full, unpartitioned model even while such a
  config is alive (inference copies, exports).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Optional

import torch

from rlhfkit.errors import CheckpointError
from rlhfkit.models import cpu_bf16

DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def check_weights_policy(path: str, allow_pickle: bool = False, trust_remote_code: bool = False) -> None:
    """Refuse pickled weights and remote code unless asked for, with a message naming the flag."""
    if not os.path.isdir(path):
        raise CheckpointError(f"model directory {path} does not exist")
    files = os.listdir(path)
    if "config.json" not in files:
        hint = " (it holds training_state/: a run that has not finished; pass its final output or --resume it)" if "training_state" in files else ""
        raise CheckpointError(f"{path} is not a model directory: no config.json{hint}")
    has_st = any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in files)
    has_pickle = any(f.endswith(PICKLE_SUFFIXES) for f in files)
    if not has_st and has_pickle and not allow_pickle:
        raise CheckpointError(
            f"{path} holds only pickled weights ({', '.join(f for f in files if f.endswith(PICKLE_SUFFIXES))}); "
            "loading them can run arbitrary code. Convert them to safetensors, or pass --allow_pickle_weights if you trust the file.")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if config.get("auto_map") and not trust_remote_code:
        raise CheckpointError(
            f"{path} needs its own model code (config.json has auto_map); it does not run unless you pass --trust_remote_code")


def load_tokenizer(path: str, trust_remote_code: bool = False, padding_side: str = "right"):
    """The tokenizer of a model directory, with a pad token distinct from EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    ensure_distinct_pad(tok)
    tok.padding_side = padding_side
    return tok


def ensure_distinct_pad(tok) -> None:
    """Give ``tok`` a pad token that is not EOS (pad == EOS silently masks the EOS out of losses).

    Prefers an existing special token (unk, then ``<|endoftext|>``, then ``<pad>``) so the vocabulary
    and embeddings keep their size; raises if none exists rather than resizing behind the user's back.
    """
    if tok.eos_token_id is None:
        raise CheckpointError("the tokenizer has no EOS token; responses could never end")
    if tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id:
        return
    vocab = tok.get_vocab()
    for cand in (tok.unk_token, "<|endoftext|>", "<pad>", "<|pad|>", "<unk>"):
        if cand and cand in vocab and vocab[cand] != tok.eos_token_id:
            tok.pad_token = cand
            return
    raise CheckpointError("the tokenizer's pad token equals EOS and it has no other special token to pad with")


@contextlib.contextmanager
def plain_init() -> Iterator[None]:
    """Build models unpartitioned even while an ``HfDeepSpeedConfig`` with ZeRO-3 is alive."""
    from transformers.integrations import deepspeed as hf_ds

    saved = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def _apply_dropout(config: Any, dropout: Optional[float]) -> None:
    if dropout is None:
        return
    for key in DROPOUT_KEYS:
        if hasattr(config, key):
            setattr(config, key, dropout)


def load_model(
    path: str,
    kind: str = "causal_lm",
    *,
    dtype: str = "fp32",
    zero3_ds_config: Optional[dict] = None,
    dropout: Optional[float] = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    pad_token_id: Optional[int] = None,
    attn_implementation: Optional[str] = None,
):
    """Load ``path`` as a causal LM (``kind="causal_lm"``) or a one-label reward/value model
    (``kind="reward"``; ``AutoModelForSequenceClassification``, score head freshly initialised when
    the directory is a causal LM).

    With ``zero3_ds_config`` the model is partitioned while it loads (DeepSpeed ``zero.Init``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    check_weights_policy(path, allow_pickle, trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _apply_dropout(config, dropout)
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    cls = AutoModelForCausalLM
    if kind == "reward":
        cls = AutoModelForSequenceClassification
        config.num_labels = 1
        config.problem_type = "regression"
    keep_alive = None
    if zero3_ds_config is not None and zero3_ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(zero3_ds_config)  # noqa: F841 - must live while the model loads
    model = cls.from_pretrained(
        path, config=config, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_pickle else True, attn_implementation=attn_implementation,
    )
    del keep_alive
    cpu_bf16.fp32_products(model)  # an AVX2-only CPU has no bf16 GEMM worth the name
    if kind == "causal_lm" and hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.pad_token_id = pad_token_id if pad_token_id is not None else model.generation_config.pad_token_id
    return model


def train_attention(choice: str, max_seq_len: int, on_cuda: bool, dtype: str = "fp32") -> Optional[str]:
    """The attention kernel of a model trained with sequences of up to ``max_seq_len`` tokens.

    ``auto``: on the CPU, up to 512 tokens, the plain matmul ("eager") attention; its backward pass
    is faster than torch's CPU flash-attention backward at these lengths (at 1024 SDPA wins). Not in
    bf16 on a CPU without bf16 kernels (:mod:`rlhfkit.models.cpu_bf16`): there eager's bf16 matmuls
    take the slow path. Elsewhere the model's default
    (SDPA). Any other value is passed to transformers as it is.
    """
    if choice != "auto":
        return choice
    slow_bf16 = dtype == "bf16" and cpu_bf16.wanted()
    return "eager" if not on_cuda and max_seq_len <= 512 and not slow_bf16 else None


def enable_gradient_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "config"):
        model.config.use_cache = False
