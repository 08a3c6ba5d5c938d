"""ds_config: the pure DeepSpeed config builders."""

import pytest

from rlhfkit.ds_config import BatchPlan, eval_config, init_config, train_config, zero_section
from rlhfkit.errors import ConfigError


@pytest.mark.parametrize("micro,accum,world", [(4, 1, 1), (2, 4, 2), (3, 2, 8)])
def test_batch_arithmetic(micro, accum, world):
    plan = BatchPlan(micro_batch=micro, grad_accum=accum, world_size=world)
    cfg = train_config(plan=plan, zero_stage=2, dtype="bf16")
    assert cfg["train_batch_size"] == micro * world * accum == plan.global_batch
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["gradient_accumulation_steps"] == accum


def test_zero_stages_and_offload():
    assert zero_section(0, False) == {"stage": 0}
    z2 = zero_section(2, True)
    assert z2["stage"] == 2 and z2["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z2
    z3 = zero_section(3, True)
    assert z3["offload_param"]["device"] == "cpu" and z3["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero_section(3, True, offload_param=False)
    with pytest.raises(ConfigError, match="out of range"):
        zero_section(4, False)
    with pytest.raises(ConfigError, match="--offload needs"):
        zero_section(0, True)


def test_precision_and_clipping():
    plan = BatchPlan(1, 1, 1)
    assert train_config(plan=plan, zero_stage=0, dtype="bf16")["bf16"] == {"enabled": True}
    fp16 = train_config(plan=plan, zero_stage=0, dtype="fp16")["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0  # dynamic loss scaling
    fp32 = train_config(plan=plan, zero_stage=0, dtype="fp32", gradient_clipping=0)
    assert "bf16" not in fp32 and "fp16" not in fp32 and "gradient_clipping" not in fp32
    assert train_config(plan=plan, zero_stage=0, dtype="fp32", gradient_clipping=0.5)["gradient_clipping"] == 0.5
    with pytest.raises(ConfigError):
        train_config(plan=plan, zero_stage=0, dtype="int8")


def test_optimizer_is_passed_in_never_jit_built():
    plan = BatchPlan(1, 1, 2)
    for on_cuda in (False, True):
        cfg = train_config(plan=plan, zero_stage=3, dtype="bf16", on_cuda=on_cuda, offload=True)
        assert "optimizer" not in cfg and cfg["zero_force_ds_cpu_optimizer"] is False  # torch AdamW (fused on CUDA)


def test_hybrid_engine_needs_cuda():
    with pytest.raises(ConfigError, match="needs CUDA"):
        train_config(plan=BatchPlan(1, 1, 1), zero_stage=3, dtype="bf16", on_cuda=False, hybrid_engine={"inference_tp_size": 1})
    cfg = train_config(plan=BatchPlan(1, 1, 1), zero_stage=3, dtype="bf16", on_cuda=True, hybrid_engine={"inference_tp_size": 2})
    assert cfg["hybrid_engine"] == {"enabled": True, "inference_tp_size": 2}


def test_eval_and_init_configs():
    e = eval_config(micro_batch=2, world_size=2, zero_stage=3, dtype="bf16", offload=True)
    assert e["train_batch_size"] == 4 and e["zero_optimization"]["stage"] == 3
    assert e["zero_optimization"]["offload_param"]["device"] == "cpu" and "optimizer" not in e
    assert eval_config(micro_batch=2, world_size=2, zero_stage=2, dtype="bf16")["zero_optimization"] == {"stage": 0}
    assert init_config(zero_stage=3, dtype="fp32")["zero_optimization"]["stage"] == 3
