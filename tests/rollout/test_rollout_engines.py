"""Rollout backends in one process on CPU (no DeepSpeed launch): the registry, plain modules,
sampling settings, mode restoring, and the inference copy (LoRA merging, no partitioning)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rlhfkit.rollout.hf as hf_backend
from rlhfkit.errors import ConfigError
from rlhfkit.models.gathered import GatheredCopy, build_inference_copy, load_gathered_weights
from rlhfkit.rollout import (
    ROLLOUT_BACKENDS,
    GenerationConfig,
    PromptBatch,
    RolloutOptions,
    check_backend,
    make_rollout_engine,
    postprocess,
    training_engine_options,
)

REPO = Path(__file__).resolve().parents[2]
PAD = 0
MAX_NEW = 8
CPU_REFUSAL = ("--rollout_backend deepspeed / --enable_hybrid_engine needs CUDA (DeepSpeed's Hybrid Engine kernels); "
               "on CPU use --rollout_backend hf")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, eos_token_id=None, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def prompts() -> PromptBatch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1000, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    ids[2, :4], mask[2, :4] = PAD, 0
    return PromptBatch(ids, mask)


def plain(model, prompts, **kwargs) -> torch.Tensor:
    """transformers' generate with explicit arguments on a model with a clean generation_config."""
    m = copy.deepcopy(model)
    m.generation_config = type(m.generation_config)()
    with torch.no_grad():
        out = m.generate(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask, pad_token_id=PAD,
                         max_new_tokens=MAX_NEW, synced_gpus=False, **kwargs)
    return out[:, prompts.input_ids.shape[1]:]


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f))
               for f in ("prompt_ids", "prompt_mask", "response_ids", "action_mask", "truncated"))


# registry ----------------------------------------------------------------------------------


def test_registry_names_and_errors(model):
    assert set(ROLLOUT_BACKENDS) == {"hf", "hf-synced", "deepspeed"}
    with pytest.raises(ConfigError, match="unknown rollout backend 'vllm'"):
        make_rollout_engine("vllm", model)
    with pytest.raises(ConfigError, match="does not take"):
        make_rollout_engine("hf-synced", model, keep_copy=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_deepspeed_backend_refused_on_cpu(model):
    with pytest.raises(ConfigError) as e:
        make_rollout_engine("deepspeed", model)
    assert str(e.value) == CPU_REFUSAL


def test_import_is_lazy():
    code = ("import sys, rlhfkit.rollout; "
            "bad = [m for m in sys.modules if m.startswith(('deepspeed', 'transformers', 'rlhfkit.rollout.deepspeed_he', "
            "'rlhfkit.rollout.hf', 'rlhfkit.models'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_gathered_copy_imports_no_rollout():
    code = ("import sys, rlhfkit.models.gathered; "
            "bad = [m for m in sys.modules if m.startswith('rlhfkit.rollout')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


# one interface for every backend: the early check, the training engine's options, the options, the copy ---------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_check_backend_refuses_deepspeed_on_cpu():
    with pytest.raises(ConfigError) as e:
        check_backend("deepspeed")
    assert str(e.value) == CPU_REFUSAL
    assert check_backend("hf") is None and check_backend("hf-synced") is None  # nothing they need
    with pytest.raises(ConfigError, match="unknown rollout backend 'vllm'"):
        check_backend("vllm")


def test_training_engine_options():
    options = RolloutOptions(inference_tp_size=2, release_inference_cache=True, pin_parameters=False, tp_gather_partition_size=4)
    assert training_engine_options("hf", options) is None
    assert training_engine_options("hf-synced", options) is None
    assert training_engine_options("deepspeed", options) == {
        "inference_tp_size": 2, "release_inference_cache": True, "pin_parameters": False, "tp_gather_partition_size": 4}
    # step 3's flag defaults: --inference_tp_size 1, no --release_inference_cache, no --unpin_actor_parameters,
    # --tp_gather_partition_size 8
    assert training_engine_options("deepspeed", RolloutOptions()) == {
        "inference_tp_size": 1, "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8}


def test_options_reach_the_backend(model):
    assert make_rollout_engine("hf", model, RolloutOptions(keep_copy=True)).inference_copy.keep is True
    assert make_rollout_engine("hf", model, RolloutOptions()).inference_copy.keep is False
    assert make_rollout_engine("hf", model, keep_copy=True).inference_copy.keep is True  # the keyword form
    synced = make_rollout_engine("hf-synced", model, RolloutOptions(keep_copy=True))  # a field it does not use: ignored
    assert synced.inference_copy is None
    synced.release()
    with pytest.raises(ConfigError, match="given both"):
        make_rollout_engine("hf", model, RolloutOptions(), keep_copy=True)


@pytest.mark.parametrize("keep", [True, False])
def test_hf_generates_with_its_inference_copy(model, prompts, keep, monkeypatch):
    """As under ZeRO-3 (the copy told that the model is partitioned), the model that generates is the
    one the engine's ``inference_copy`` hands out; with ``keep_copy`` it outlives the call."""
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[999], pad_token_id=PAD)
    want = make_rollout_engine("hf", model).generate(prompts, gen)
    monkeypatch.setattr(GatheredCopy, "partitioned", property(lambda self: True))
    used, real = [], hf_backend.hf_generate
    monkeypatch.setattr(hf_backend, "hf_generate", lambda m, *args, **kw: used.append(m) or real(m, *args, **kw))
    rollout = make_rollout_engine("hf", model, RolloutOptions(keep_copy=keep))
    with rollout.inference_copy.held():  # as step 3 does: generate, then score on the same copy
        got = rollout.generate(prompts, gen)
        assert len(used) == 1 and used[0] is not model and used[0] is rollout.inference_copy.model()
    assert same(got, want)
    assert (rollout.inference_copy._copy is used[0]) is keep
    rollout.release()
    assert rollout.inference_copy._copy is None


# plain modules (ZeRO-0 path) ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["hf", "hf-synced"])
def test_greedy_equals_plain_generate(model, prompts, backend):
    probe = plain(model, prompts, do_sample=False)
    eos = [int(probe[0, 2]), int(probe[1, 5])]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    want = postprocess(prompts.input_ids, prompts.attention_mask, plain(model, prompts, do_sample=False, eos_token_id=eos),
                       eos, PAD)
    got = make_rollout_engine(backend, model).generate(prompts, gen)
    assert same(got, want)
    assert got.response_lengths[0] <= 3 and not got.truncated[0]


@pytest.mark.parametrize("backend", ["hf", "hf-synced"])
def test_groups_of_one_prompt_decode_like_plain_generate(model, prompts, backend):
    """Rows that repeat a prompt (a GRPO group, prefilled once by the hf backend) and a prompt that
    comes back later (not a neighbour: prefilled again) give generate's greedy tokens."""
    idx = torch.tensor([0, 0, 0, 1, 2, 2, 0])
    rows = PromptBatch(prompts.input_ids[idx], prompts.attention_mask[idx])
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[999], pad_token_id=PAD)
    got = make_rollout_engine(backend, model).generate(rows, gen)
    assert torch.equal(got.response_ids, plain(model, rows, do_sample=False, eos_token_id=[999]))
    assert torch.equal(got.response_ids, make_rollout_engine(backend, model).generate(prompts, gen).response_ids[idx])


def test_model_generation_defaults_do_not_leak(model, prompts):
    m = copy.deepcopy(model)
    m.generation_config.do_sample = True
    m.generation_config.temperature = 0.01
    m.generation_config.top_k = 1
    m.generation_config.repetition_penalty = 10.0
    m.generation_config.no_repeat_ngram_size = 1
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[999], pad_token_id=PAD)
    got = make_rollout_engine("hf", m).generate(prompts, gen)
    assert torch.equal(got.response_ids, plain(model, prompts, do_sample=False, eos_token_id=[999]))
    assert m.generation_config.repetition_penalty == 10.0  # the model's own config is back

    sampled = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.3, top_p=0.95, eos_token_id=[999], pad_token_id=PAD)
    torch.manual_seed(7)
    got = make_rollout_engine("hf", m).generate(prompts, sampled)
    torch.manual_seed(7)
    want = make_rollout_engine("hf", model).generate(prompts, sampled)  # the same model, its generation_config untouched
    assert torch.equal(got.response_ids, want.response_ids)
    torch.manual_seed(8)
    assert not torch.equal(make_rollout_engine("hf", model).generate(prompts, sampled).response_ids, want.response_ids)


def test_min_new_tokens_suppresses_eos(model, prompts):
    first = plain(model, prompts, do_sample=False)[:, 0].tolist()
    eos = sorted(set(first))
    free = make_rollout_engine("hf", model).generate(
        prompts, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD))
    assert free.response_lengths.tolist() == [1, 1, 1]  # EOS allowed at the first step by default
    forced = make_rollout_engine("hf", model).generate(
        prompts, GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                                  pad_token_id=PAD))
    assert forced.truncated.all() and forced.response_ids.shape == (3, MAX_NEW)


def test_modes_and_checkpointing_restored(model, prompts):
    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    m.train()
    m.model.layers[1].eval()  # a deliberately frozen-in-eval submodule stays so
    before = [x.training for x in m.modules()]
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[999], pad_token_id=PAD)
    got = make_rollout_engine("hf", m).generate(prompts, gen)
    assert [x.training for x in m.modules()] == before
    assert m.config.use_cache is False and m.is_gradient_checkpointing
    assert torch.equal(got.response_ids, plain(model, prompts, do_sample=False, eos_token_id=[999]))


def test_empty_prompt_batch(model):
    empty = PromptBatch(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long))
    gen = GenerationConfig(max_new_tokens=MAX_NEW, eos_token_id=2, pad_token_id=PAD)
    for backend in ("hf", "hf-synced"):
        out = make_rollout_engine(backend, model).generate(empty, gen)
        assert len(out) == 0 and out.response_ids.shape == (0, 0)


# the inference copy ------------------------------------------------------------------------


def test_copy_is_plain_while_zero3_config_alive(model):
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    alive = HfDeepSpeedConfig(cfg)  # noqa: F841 - from_config would partition (and need torch.distributed) now
    assert is_deepspeed_zero3_enabled()
    c = build_inference_copy(model, torch.device("cpu"))
    assert is_deepspeed_zero3_enabled()  # the flag is back
    assert not any(hasattr(p, "ds_id") for p in c.parameters())
    assert not c.training
    load_gathered_weights(c, model, bucket_numel=10_000)  # many small buckets
    sd, ref = c.state_dict(), model.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    del alive


def test_copy_in_bf16_keeps_dtype(model):
    m = copy.deepcopy(model).to(torch.bfloat16)
    c = build_inference_copy(m, torch.device("cpu"))
    load_gathered_weights(c, m, bucket_numel=2**25)
    assert {p.dtype for p in c.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(c.state_dict().values(), m.state_dict().values()))


@pytest.mark.parametrize("variant", ["lora", "lora+modules_to_save", "dora", "two_adapters"])
def test_copy_of_peft_model_equals_merge_and_unload(model, variant):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    kwargs = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    if variant == "lora+modules_to_save":
        kwargs["modules_to_save"] = ["lm_head"]
    if variant == "dora":
        kwargs["use_dora"] = True
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(**kwargs))
    if variant == "two_adapters":
        pm.add_adapter("other", LoraConfig(r=2, lora_alpha=2, target_modules=["o_proj"]))
        pm.base_model.set_adapter(["default", "other"])
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "modules_to_save" in name or "magnitude" in name:
                p.add_(torch.randn_like(p) * 0.3)
    c = build_inference_copy(pm, torch.device("cpu"))
    assert type(c) is LlamaForCausalLM
    load_gathered_weights(c, pm, bucket_numel=2**25)
    merged = copy.deepcopy(pm).merge_and_unload().state_dict()
    got = c.state_dict()
    assert got.keys() == merged.keys()
    for k in merged:
        torch.testing.assert_close(got[k], merged[k], rtol=0, atol=1e-6 if variant == "dora" else 0)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.q_proj.weight"])
