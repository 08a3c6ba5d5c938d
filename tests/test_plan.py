"""``rlhfkit plan``: parameter counts against real models and a published one, model states by hand for each
ZeRO stage, the largest batch, the errors, and the command from a config alone. (Predicted against measured
memory of real runs: bench/plan_check.py; a figure, not a test.)"""

import json

import pytest

from rlhfkit.cli import main
from rlhfkit.errors import ConfigError
from rlhfkit.plan import GIB, Arch, PlanSettings, largest_batch, load_arch, model_states, plan

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False}


PARTS = ("weights", "gradients", "optimizer states", "fp32 gradients")


@pytest.fixture
def llama7b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    return path


def test_parameter_counts_match_the_models(tiny_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    arch = load_arch(str(tiny_dir))
    lm = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    assert arch.params(lm_head=True) == sum(p.numel() for p in lm.parameters())  # tied embeddings counted once
    assert arch.params(lm_head=False) == sum(p.numel() for p in rm.parameters())
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = get_peft_model(lm, LoraConfig(r=8, target_modules=modules))
    assert arch.lora_params(8) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    del torch


def test_llama2_7b_from_its_config_alone(llama7b):
    assert load_arch(str(llama7b)).params(lm_head=True) == 6_738_415_616  # Llama-2-7B's published count


def test_model_states_by_hand_for_each_stage():
    n_params = 1000
    by_part = {}
    for stage in (0, 1, 2, 3):
        lines = model_states("m", n_params, n_params, PlanSettings(world_size=4, zero_stage=stage, dtype="bf16"))
        by_part[stage] = {ln.part.split(" (")[0]: ln.bytes for ln in lines}
    # bf16: weights 2 B, gradients 2 B, fp32 master 4 B + Adam 8 B, fp32 gradients 4 B a parameter
    assert by_part[0] == {"weights": 2000, "gradients": 2000, "optimizer states": 12000, "fp32 gradients": 4000}
    buckets = 2 * 2e7 * 2
    assert by_part[1] == {"weights": 2000, "gradients": 2000, "optimizer states": 3000, "fp32 gradients": 1000, "ZeRO buckets": buckets}
    assert by_part[2] == {**by_part[1], "gradients": 500}
    assert by_part[3] == {**by_part[2], "weights": 500, "gathered for forward/backward": 2000}
    fp32 = {ln.part.split(" (")[0]: ln.bytes for ln in model_states("m", n_params, n_params, PlanSettings(dtype="fp32"))}
    assert fp32 == {"weights": 4000, "gradients": 4000, "optimizer states": 8000}  # no master copy, no second gradient
    offloaded = model_states("m", n_params, n_params, PlanSettings(world_size=4, zero_stage=3, offload=True))
    assert {ln.part.split(" (")[0] for ln in offloaded if ln.host} == {"weights", "optimizer states", "fp32 gradients"}


def test_more_ranks_checkpointing_and_lora_lower_the_peak(llama7b):
    base = PlanSettings(program="step1", world_size=8, zero_stage=3, max_seq_len=2048, per_device_train_batch_size=1)
    peak = plan(str(llama7b), base).device_total_gib
    assert plan(str(llama7b), PlanSettings(**{**base.__dict__, "world_size": 16})).device_total_gib < peak
    assert plan(str(llama7b), PlanSettings(**{**base.__dict__, "gradient_checkpointing": True})).device_total_gib < peak
    assert plan(str(llama7b), PlanSettings(**{**base.__dict__, "lora_dim": 16})).device_total_gib < peak
    # Llama-2-7B's model states under ZeRO-3 on 8 ranks: 2 + 2 + 12 + 4 bytes a parameter / 8
    states = sum(ln.bytes for ln in plan(str(llama7b), base).lines if ln.part.split(" (")[0] in PARTS)
    assert states / GIB == pytest.approx(6_738_415_616 * 20 / 8 / GIB)


def test_largest_batch_is_the_edge(llama7b):
    s = PlanSettings(program="step1", world_size=8, zero_stage=3, max_seq_len=1024, gradient_checkpointing=True)
    best = largest_batch(str(llama7b), s, 80.0)
    assert best > 1
    fits = plan(str(llama7b), PlanSettings(**{**s.__dict__, "per_device_train_batch_size": best})).device_total_gib
    over = plan(str(llama7b), PlanSettings(**{**s.__dict__, "per_device_train_batch_size": best + 1})).device_total_gib
    assert fits <= 80.0 < over


def test_errors(tmp_path, llama7b):
    with pytest.raises(ConfigError, match="no config.json there"):
        load_arch(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="the model config has no 'hidden_size'"):
        Arch.from_config({"vocab_size": 10})
    with pytest.raises(ConfigError, match="--offload needs --zero_stage 1, 2 or 3"):
        plan(str(llama7b), PlanSettings(offload=True))
    with pytest.raises(ConfigError, match="--program step4: use one of step1, step2, dpo, step3"):
        plan(str(llama7b), PlanSettings(program="step4"))


def test_command_step3_from_a_7b_config(llama7b, capsys):
    main(["plan", "--model", str(llama7b), "--program", "step3", "--world_size", "8", "--zero_stage", "3",
          "--max_prompt_seq_len", "512", "--max_answer_seq_len", "512", "--device_memory_gib", "80"])
    out = capsys.readouterr().out
    for part in ("actor            weights", "critic           optimizer states", "reference        weights (frozen)",
                 "reward model     weights (frozen)", "gathered copy for rollout", "KV cache (4 x 1024 tokens)",
                 "peak per rank:", "80 GiB per device:", "the largest --per_device_generation_batch_size that fits"):
        assert part in out, out
    main(["plan", "--model", str(llama7b), "--program", "step1", "--device_memory_gib", "24"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "change first: --zero_stage 3" in out
