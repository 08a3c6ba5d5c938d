"""The checkpoint contract: atomic export, manifest, validation errors, LoRA merge."""

import json
import os
import shutil

import pytest
import torch

from rlhfkit.checkpoint import (
    INCOMPLETE, MANIFEST, atomic_dir, build_manifest, check_model_dir, check_output_dir, check_same_tokenizer,
    export_model, read_manifest, tokenizer_hash,
)
from rlhfkit.errors import CheckpointError
from rlhfkit.models import apply_lora, check_weights_policy, load_model


@pytest.fixture()
def exported(tiny_dir, tokenizer, tmp_path):
    model = load_model(str(tiny_dir), dtype="fp32")
    out = tmp_path / "sft"
    manifest = build_manifest(stage="sft", config={"x": 1}, tokenizer=tokenizer, parent=str(tiny_dir), metrics={"m": 1.0})
    export_model(model, tokenizer, out, manifest, generation={"eos_token_id": tokenizer.eos_token_id})
    return out, model


def test_export_is_plain_hf_and_manifest_complete(exported, tokenizer):
    out, model = exported
    m = read_manifest(out)
    assert m["stage"] == "sft" and m["format_version"] == 1 and m["parent"]["path"].endswith("tiny-llama")
    assert m["tokenizer_sha256"] == tokenizer_hash(tokenizer) and m["metrics"] == {"m": 1.0}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(m["files"])
    assert "torch" in m["versions"] and m["world_size"] == 1
    assert not (out / INCOMPLETE).exists() and not list(out.parent.glob(".sft.tmp-*"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 9, 13]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert check_model_dir(str(out), ("sft",), "--model_name_or_path")["stage"] == "sft"


def test_validation_errors(exported, tmp_path, tiny_dir):
    out, _ = exported
    with pytest.raises(CheckpointError, match="no such directory"):
        check_model_dir(str(tmp_path / "nope"), ("sft",), "--model_name_or_path")
    with pytest.raises(CheckpointError, match=r"is a 'sft' checkpoint, but --critic_model_name_or_path expects 'reward'"):
        check_model_dir(str(out), ("reward",), "--critic_model_name_or_path")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a model directory, no config.json"):
        check_model_dir(str(empty), ("sft",), "--model_name_or_path")
    (empty / "training_state").mkdir()
    with pytest.raises(CheckpointError, match="has not finished"):
        check_model_dir(str(empty), ("sft",), "--model_name_or_path")
    # a truncated weights file is caught by its hash
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="half-written or corrupted, model.safetensors"):
        check_model_dir(str(broken), ("sft",), "--model_name_or_path")
    # an interrupted save keeps its marker
    half = tmp_path / "half"
    shutil.copytree(out, half)
    (half / INCOMPLETE).write_text("")
    with pytest.raises(CheckpointError, match="half-written"):
        check_model_dir(str(half), ("sft",), "--model_name_or_path")
    # a plain HF directory (no manifest) is a base model
    assert check_model_dir(str(tiny_dir), ("base",), "--model_name_or_path")["stage"] == "base"


def test_atomic_dir_keeps_old_on_failure_and_carries_run_entries(tmp_path):
    final = tmp_path / "ck"
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("1")
    (final / "training_state").mkdir()
    (final / "training_state" / "s").write_text("state")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a.txt").write_text("2")
            raise RuntimeError("crash while writing")
    assert (final / "a.txt").read_text() == "1" and not list(tmp_path.glob(".ck.tmp-*"))
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("3")
    assert (final / "a.txt").read_text() == "3" and (final / "training_state" / "s").read_text() == "state"


def test_tokenizer_mismatch_message(tokenizer):
    a = {"tokenizer_sha256": "aaa"}
    b = {"tokenizer_sha256": "bbb"}
    with pytest.raises(CheckpointError, match="tokenizer mismatch: /actor and /rm"):
        check_same_tokenizer("/actor", a, "/rm", b)
    check_same_tokenizer("/actor", a, "/rm", {"tokenizer_sha256": "aaa"})


def test_pickle_and_remote_code_refused(tmp_path, tiny_dir):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow_pickle_weights"):
        check_weights_policy(str(d))
    check_weights_policy(str(d), allow_pickle=True)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    r = tmp_path / "remote"
    shutil.copytree(tiny_dir, r)
    (r / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="--trust_remote_code"):
        check_weights_policy(str(r))


def test_output_dir_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(CheckpointError, match="not writable"):
            check_output_dir(str(ro / "out"))
    finally:
        os.chmod(ro, 0o700)


def test_output_dir_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not writable"):
        check_output_dir(str(f / "out"))


def test_lora_is_merged_on_export(tiny_dir, tokenizer, tmp_path):
    model = load_model(str(tiny_dir), dtype="fp32")
    model = apply_lora(model, 4, 8, "q_proj,v_proj", only_optimize_lora=True)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    out = tmp_path / "lora"
    export_model(model, tokenizer, out, build_manifest(stage="sft", config={}, tokenizer=tokenizer))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in loaded.state_dict())
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_resume_refuses_another_world_size_even_with_allow_config_change(tmp_path, monkeypatch):
    """A state saved by 2 ranks is refused by 1 rank, with or without --resume_allow_config_change (which used to
    waive it); a changed flag is still waived by it."""
    from rlhfkit import distributed as dist
    from rlhfkit.errors import CheckpointError
    from rlhfkit.resume import RunState

    saved = {"world_size": 2, "config": {"learning_rate": 0.1}}
    monkeypatch.setattr(dist, "world_size", lambda: 1)
    for allow in (False, True):
        state = RunState(str(tmp_path), {}, {"learning_rate": 0.1}, resume="auto", allow_config_change=allow)
        with pytest.raises(CheckpointError, match="saved with 2 ranks and this one has 1.*start 2 ranks"):
            state._check_config(saved, tmp_path)
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    RunState(str(tmp_path), {}, {"learning_rate": 0.2}, allow_config_change=True)._check_config(saved, tmp_path)
    with pytest.raises(CheckpointError, match="--learning_rate 0.1 -> 0.2"):
        RunState(str(tmp_path), {}, {"learning_rate": 0.2})._check_config(saved, tmp_path)


def test_resume_refuses_a_layout_change_even_with_allow_config_change(tmp_path):
    """The ZeRO stage across 0, 1-2 and 3, the dtype and the LoRA adapters change the files DeepSpeed saved (each
    crashed in DeepSpeed's loader with --resume_allow_config_change): refused by name; ZeRO 1 <-> 2 and the
    learning rate are waived."""
    from rlhfkit.errors import CheckpointError
    from rlhfkit.resume import RunState

    saved_cfg = {"zero_stage": 3, "dtype": "bf16", "lora_dim": 0, "lora_module_name": "q_proj,v_proj", "learning_rate": 0.1,
                 "actor_zero_stage": 2}
    saved = {"world_size": 1, "config": saved_cfg}
    refused = [({"zero_stage": 2}, "saved with --zero_stage 3 and cannot be loaded with --zero_stage 2"),
               ({"dtype": "fp32"}, "--dtype bf16 and cannot be loaded with --dtype fp32"),
               ({"lora_dim": 4}, "--lora_dim 0 and cannot be loaded with --lora_dim 4"),
               ({"actor_zero_stage": 0}, "--actor_zero_stage 2 and cannot be loaded with --actor_zero_stage 0"),
               ({"zero_stage": 0, "learning_rate": 0.2}, "with --zero_stage 3 and cannot be loaded with --zero_stage 0")]
    for change, message in refused:
        state = RunState(str(tmp_path), {}, {**saved_cfg, **change}, allow_config_change=True)
        with pytest.raises(CheckpointError, match=message):
            state._check_config(saved, tmp_path)
    RunState(str(tmp_path), {}, {**saved_cfg, "actor_zero_stage": 1, "learning_rate": 0.2, "lora_module_name": "q_proj"},
             allow_config_change=True)._check_config(saved, tmp_path)  # no LoRA either side: its modules do not matter
    with_lora = {"world_size": 1, "config": {**saved_cfg, "lora_dim": 4, "lora_module_name": "q_proj,v_proj"}}
    with pytest.raises(CheckpointError, match="--lora_module_name q_proj,v_proj and cannot be loaded with --lora_module_name q_proj"):
        RunState(str(tmp_path), {}, {**with_lora["config"], "lora_module_name": "q_proj"},
                 allow_config_change=True)._check_config(with_lora, tmp_path)
