"""The contract between the programs: checkpoint directories (DESIGN section 2).

A checkpoint directory is a plain Hugging Face model directory (config.json, model.safetensors,
tokenizer files with chat template, generation_config.json) plus ``rlhfkit.json``, a manifest with
the stage, the parent checkpoint, the tokenizer hash, data sources, the config, final metrics, the
distributed set-up, library versions and a sha256 of every file. Directories are written to a
temporary sibling and renamed into place; a reader verifies the manifest and gives one clear error
naming the path and what was expected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from rlhfkit import distributed as dist
from rlhfkit.errors import CheckpointError

MANIFEST = "rlhfkit.json"
INCOMPLETE = ".incomplete"
FORMAT_VERSION = 1
STAGES = ("base", "sft", "reward", "actor", "critic", "dpo")
# Entries of an output directory that belong to the run, not to the exported model: carried over
# when a newer export replaces the directory.
RUN_ENTRIES = ("training_state", "logs")


# ----------------------------------------------------------------------------------------------
# hashing and manifests


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of the vocabulary (token -> id) and the special tokens: equal hashes = interchangeable ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("rlhfkit", "torch", "deepspeed", "transformers", "peft", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def read_manifest(path: str | os.PathLike) -> Optional[dict]:
    """The manifest of ``path`` or None when it has none (a plain HF directory)."""
    p = Path(path) / MANIFEST
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable ({e}); the directory is half-written or corrupted") from None


def parent_record(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    m = Path(path) / MANIFEST
    return {"path": os.path.abspath(path), "manifest_sha256": sha256_file(m) if m.exists() else None}


def build_manifest(
    *,
    stage: str,
    config: dict,
    tokenizer: Any,
    parent: Optional[str] = None,
    data: Iterable[Any] = (),
    metrics: Optional[dict] = None,
    zero_stage: Optional[int] = None,
    dtype: Optional[str] = None,
    extra: Optional[dict] = None,
) -> dict:
    """Everything a manifest holds except the file hashes (added when the directory is written)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    return {
        "format_version": FORMAT_VERSION,
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parent": parent_record(parent),
        "tokenizer_sha256": tokenizer_hash(tokenizer),
        "data": [d.__dict__ if hasattr(d, "__dict__") else d for d in data],
        "config": config,
        "metrics": metrics or {},
        "world_size": dist.world_size(),
        "zero_stage": zero_stage,
        "dtype": dtype,
        "versions": library_versions(),
        **(extra or {}),
    }


def write_manifest(directory: str | os.PathLike, manifest: dict) -> None:
    """Hash every file of ``directory`` (except run entries) into the manifest and write it last."""
    directory = Path(directory)
    files = {}
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory).as_posix()
        if f.is_file() and rel.split("/")[0] not in RUN_ENTRIES and rel not in (MANIFEST, INCOMPLETE):
            files[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    manifest = {**manifest, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# atomic directories


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, carry: Iterable[str] = RUN_ENTRIES) -> Iterator[Path]:
    """Write a directory under a temporary sibling name and rename it into place at the end.

    Entries named in ``carry`` (training states, logs) of an existing ``final`` move into the new
    directory. A crash leaves ``final`` as it was plus a ``.NAME.tmp-PID`` sibling holding
    ``.incomplete``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / INCOMPLETE).write_text("being written\n")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        for name in carry:
            if (final / name).exists() and not (tmp / name).exists():
                os.rename(final / name, tmp / name)
    (tmp / INCOMPLETE).unlink()
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def check_output_dir(path: Optional[str]) -> None:
    """Fail before any training if ``path`` cannot be written."""
    if not path:
        raise CheckpointError("--output_dir is required")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--output_dir {path} is not writable ({e.strerror or e}); choose another directory") from None


def check_free_space(path: str | os.PathLike, needed_bytes: int) -> None:
    p = Path(path)
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < needed_bytes:
        raise CheckpointError(
            f"not enough disk space to save a checkpoint under {path}: about {needed_bytes / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free; the previous checkpoint is kept")


# ----------------------------------------------------------------------------------------------
# reading and validating


def check_model_dir(path: Optional[str], expect: Iterable[str], role: str, verify_files: bool = True) -> dict:
    """Validate a checkpoint directory given as ``role`` (a flag name) and return its manifest.

    A plain Hugging Face directory without a manifest is accepted as a base model (``{"stage": "base"}``).
    """
    expect = tuple(expect)
    if not path:
        raise CheckpointError(f"{role} is required")
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{role} {path}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"{role} {path}: not a directory")
    if (p / INCOMPLETE).exists():
        raise CheckpointError(f"{role} {path}: the directory is half-written (a save was interrupted); use the last complete checkpoint")
    if not (p / "config.json").exists():
        extra = " (it holds training_state/ only: the run that writes it has not finished)" if (p / "training_state").exists() else ""
        raise CheckpointError(f"{role} {path}: not a model directory, no config.json{extra}")
    manifest = read_manifest(p)
    if manifest is None:
        return {"stage": "base", "plain_hf": True}
    stage = manifest.get("stage")
    if stage not in expect:
        raise CheckpointError(
            f"{role} {path}: is a '{stage}' checkpoint, but {role} expects {' or '.join(repr(s) for s in expect)}")
    if verify_files:
        for rel, info in manifest.get("files", {}).items():
            f = p / rel
            if not f.exists():
                raise CheckpointError(f"{role} {path}: half-written or corrupted, {rel} is missing")
            if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
                raise CheckpointError(f"{role} {path}: half-written or corrupted, {rel} does not match its hash in {MANIFEST}")
    return manifest


def check_same_tokenizer(a_path: str, a_manifest: dict, b_path: str, b_manifest: dict, a_tok: Any = None, b_tok: Any = None) -> None:
    ha = a_manifest.get("tokenizer_sha256") or (tokenizer_hash(a_tok) if a_tok is not None else None)
    hb = b_manifest.get("tokenizer_sha256") or (tokenizer_hash(b_tok) if b_tok is not None else None)
    if ha and hb and ha != hb:
        raise CheckpointError(
            f"tokenizer mismatch: {a_path} and {b_path} use different tokenizers, so token ids mean different things; "
            "train the reward model from the same base as the actor")


# ----------------------------------------------------------------------------------------------
# export (all ranks call; rank 0 writes)


def gather_state_dict(module: torch.nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """Full state dict on rank 0 (None elsewhere); under ZeRO-3 each parameter is gathered in turn."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if dist.is_main():
                    out[name] = p.data.detach().cpu().clone()
        elif dist.is_main():
            out[name] = p.data.detach().cpu().clone()
    if dist.is_main():  # persistent buffers only (rotary caches and the like are rebuilt on load)
        for mod_name, mod in module.named_modules():
            for b_name, b in mod._buffers.items():
                if b is not None and b_name not in mod._non_persistent_buffers_set:
                    out.setdefault(f"{mod_name}.{b_name}" if mod_name else b_name, b.detach().cpu().clone())
    return out if dist.is_main() else None


def plain_model_from_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh unpartitioned Hugging Face model holding ``state`` (LoRA merged into the base weights)."""
    from rlhfkit.models import is_peft, plain_init

    base = module.get_base_model() if is_peft(module) else module
    config = base.config
    with plain_init(), torch.device("meta"):
        fresh = type(base)._from_config(config)
        if is_peft(module):
            from peft import get_peft_model

            fresh = get_peft_model(fresh, module.peft_config["default"])
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"export: unexpected keys {unexpected[:5]}")
    (fresh.get_base_model() if is_peft(fresh) else fresh).tie_weights()  # re-point tied heads at the loaded tensors
    if is_peft(fresh):
        fresh = fresh.merge_and_unload()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"export: parameters without values {still_meta[:5]} (missing {missing[:5]})")
    return fresh


def estimate_bytes(module: torch.nn.Module) -> int:
    n = 0
    for p in module.parameters():
        numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        n += numel * p.element_size()
    return int(n * 1.1) + (50 << 20)


def export_model(model: Any, tokenizer: Any, out_dir: str | os.PathLike, manifest: dict,
                 generation: Optional[dict] = None) -> None:
    """Write ``model`` (a DeepSpeed engine, a HF model or a peft model, ZeRO-3 partitioned or not) as
    a checkpoint directory.

    Collective: every rank must call it. Rank 0 writes atomically; the others wait at a barrier.
    """
    if hasattr(model, "empty_partition_cache"):  # a ZeRO-3 engine: release params an eval pass left in flight
        model.empty_partition_cache()
    module = getattr(model, "module", model)
    if dist.is_main():
        check_free_space(Path(out_dir).parent if not Path(out_dir).exists() else out_dir, estimate_bytes(module))
    state = gather_state_dict(module)
    if dist.is_main():
        model = plain_model_from_state(module, state)
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if generation is not None:
                from transformers import GenerationConfig

                GenerationConfig(**generation).save_pretrained(tmp)
            write_manifest(tmp, manifest)
        del model, state
    dist.barrier()
