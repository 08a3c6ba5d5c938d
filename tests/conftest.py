"""Shared fixtures: the real tokenizer, a tiny random Llama checkpoint, the prepared default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testutils import SHARED_DATA, require_data


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data folder ../shared/data; absent, the test skips, or fails under CI (testutils.require_data)."""
    return require_data(SHARED_DATA)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A directory kept across test sessions when RLHFKIT_TEST_CACHE is set (CI sets it)."""
    path = os.environ.get("RLHFKIT_TEST_CACHE")
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (from the embedded GGUF) with a pad token distinct from EOS."""
    from transformers import AutoTokenizer

    from rlhfkit.models import ensure_distinct_pad
    from rlhfkit.models.base import default_gguf

    directory, name = os.path.split(default_gguf())
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ensure_distinct_pad(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    return tok


@pytest.fixture(scope="session")
def base_dir(cache_dir) -> Path:
    """The embedded default model prepared by `rlhfkit prepare-base` (once per cache)."""
    from rlhfkit.checkpoint import MANIFEST
    from rlhfkit.models.base import prepare_base

    out = cache_dir / "smollm2-base"
    if not (out / MANIFEST).exists():
        prepare_base(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_dir(cache_dir, tokenizer) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with the real tokenizer, saved as a plain HF directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = cache_dir / "tiny-llama"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def reward_dir(tiny_dir, tmp_path_factory, tokenizer) -> Path:
    """A tiny reward model (stage 'reward') with a random non-zero score head."""
    import torch

    from rlhfkit.checkpoint import build_manifest, export_model
    from rlhfkit.models import load_model

    torch.manual_seed(3)
    model = load_model(str(tiny_dir), "reward", dtype="fp32", pad_token_id=tokenizer.pad_token_id)
    model.score.weight.data.normal_(0, 1.0)
    out = tmp_path_factory.mktemp("rm") / "reward"
    export_model(model, tokenizer, out, build_manifest(stage="reward", config={}, tokenizer=tokenizer))
    return out
