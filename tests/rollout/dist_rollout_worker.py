"""Distributed checks of the rollout backends, run by test_rollout_distributed.py as

    deepspeed --num_gpus 2 tests/rollout/dist_rollout_worker.py --out DIR [--mode cpu|gpu]

The shared fixtures are in dist_rollout_common.py. Each rank writes DIR/rank{r}.json: {"checks": {name: bool}, "details": {...}}; the test asserts.
Every rank has its own prompts, of other lengths and counts than the other rank's, so ranks
generate different lengths and finish at different times.

mode cpu (2 ranks, gloo, fp32): greedy tokens of hf / hf-synced on a ZeRO-3 actor, of hf on a ZeRO-3
LoRA actor, on a ZeRO-0 engine and on a plain module all equal plain ``generate`` on an unsharded
copy; generation leaves the engine's weights and modes alone and the engine still trains; a kept
copy is refreshed after an optimizer step.
mode gpu (1 CUDA rank): hf and hf-synced on CUDA, and DeepSpeed's Hybrid Engine backend (fp16) at ZeRO 3 and 2.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time

import torch

from dist_rollout_common import (
    MAX_NEW, PAD, Checker, CountCollectives, Setup, batch_equal, batch_summary, ds_config, full_state, mask_ok, modes,
    plain_generate, postprocess, reference_setup, train_step,
)

import deepspeed  # noqa: E402 - after dist_rollout_common has put the repository on sys.path
from deepspeed.accelerator import get_accelerator  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

from rlhfkit.rollout import GenerationConfig, PromptBatch, RolloutOptions, make_rollout_engine  # noqa: E402


def zero0(s: Setup) -> None:
    """hf on a ZeRO-0 engine and on a plain module: generate's tokens; modes restored; the engine trains."""
    c = s.c
    model = copy.deepcopy(s.ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(0))
    before = modes(engine.module)
    out = make_rollout_engine("hf", engine).generate(s.prompts, s.gen)
    c.check("zero0.hf_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    c.check("zero0.modes_restored", modes(engine.module) == before and engine.module.training)
    c.check("zero0.trains", torch.isfinite(torch.tensor(train_step(engine, s.expected))))

    plain = copy.deepcopy(s.ref).train()
    out = make_rollout_engine("hf", plain).generate(s.prompts, s.gen)
    c.check("module.hf_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    c.check("module.mode_restored", plain.training)


def zero3(s: Setup) -> None:
    """The ZeRO-3 actor: every backend's tokens, the engine untouched, gathered copies, after a step."""
    c = s.c
    model = LlamaForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32)
    c.check("zero3.actor_partitioned_at_load", any(hasattr(p, "ds_id") for p in model.parameters()))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.generation_config.temperature = 0.3  # a saved default that must not leak in
    model.generation_config.repetition_penalty = 5.0
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    before_state = full_state(engine.module)
    before_modes = modes(engine.module)
    before_status = [str(p.ds_status) for p in engine.module.parameters()]

    hf, kept = zero3_backends(s, engine)
    after_state = full_state(engine.module)
    c.check("zero3.weights_untouched", all(torch.equal(before_state[k], after_state[k]) for k in before_state))
    c.check("zero3.modes_restored", modes(engine.module) == before_modes and engine.module.training)
    c.check("zero3.zero_status_untouched", [str(p.ds_status) for p in engine.module.parameters()] == before_status)
    c.check("zero3.generation_config_restored", engine.module.generation_config.temperature == 0.3)
    zero3_copies(s, engine)
    zero3_after_step(s, engine, hf, kept, before_state)


def zero3_backends(s: Setup, engine) -> tuple:
    """hf (one gather per call, no per-token collectives), hf-synced, hf through GatheredParameters and
    hf with a kept copy, each giving generate's tokens -> (the hf engine, the kept-copy engine)."""
    c, prompts, gen = s.c, s.prompts, s.gen
    hf = make_rollout_engine("hf", engine)
    out, hf_calls = timed_generate(s, "hf", hf)
    c.check("zero3.hf_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    c.check("zero3.hf_mask_ok", mask_ok(out, s.eos))
    c.check("zero3.hf_released_copy", hf._copy is None)

    synced = make_rollout_engine("hf-synced", engine)
    out, synced_calls = timed_generate(s, "synced", synced)
    c.check("zero3.synced_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    short = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=s.eos, pad_token_id=PAD)
    with CountCollectives() as hf_short_calls:
        hf.generate(prompts, short)
    with CountCollectives() as synced_short_calls:
        synced.generate(prompts, short)
    # hf: each parameter gathered once per call, whatever the length; synced: gathers for every token
    n_params = len(list(engine.module.parameters()))
    counts = dict(hf=hf_calls.count, hf_short=hf_short_calls.count, synced=synced_calls.count,
                  synced_short=synced_short_calls.count)
    c.check("zero3.hf_no_per_token_collectives",
            0 < hf_calls.count == hf_short_calls.count <= n_params + 2
            and synced_calls.count - synced_short_calls.count >= MAX_NEW - 2, n_params=n_params, **counts)
    c.details["zero3.collectives"] = counts

    out = make_rollout_engine("hf", engine, direct_gather=False).generate(prompts, gen)
    c.check("zero3.hf_via_gathered_parameters_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    kept = make_rollout_engine("hf", engine, keep_copy=True)
    out = kept.generate(prompts, gen)
    c.check("zero3.kept_equals_plain", batch_equal(out, s.expected), got=batch_summary(out))
    c.check("zero3.kept_copy_plain", kept._copy is not None
            and not any(hasattr(p, "ds_id") for p in kept._copy.parameters()) and not kept._copy.training)
    return hf, kept


def timed_generate(s: Setup, name: str, rollout) -> tuple:
    """``rollout`` generates this rank's prompts -> (the batch, its collective counter); the seconds and the
    count go into the details as ``zero3.{name}_seconds`` and ``zero3.{name}_collectives``."""
    t0 = time.perf_counter()
    with CountCollectives() as calls:
        out = rollout.generate(s.prompts, s.gen)
    s.c.details[f"zero3.{name}_seconds"] = time.perf_counter() - t0
    s.c.details[f"zero3.{name}_collectives"] = calls.count
    return out, calls


def zero3_copies(s: Setup, engine) -> None:
    """Step 3's experience passes on a gathered copy give the engine's own logprobs; copies are dropped."""
    from rlhfkit.experience import actor_forward
    from rlhfkit.models.gathered import GatheredCopy

    c = s.c
    seqs, attn, plen = s.expected.sequences, s.expected.attention_mask, s.expected.prompt_ids.shape[1]
    engine.eval()
    with torch.no_grad():
        via_engine, _ = actor_forward(engine, seqs, attn, plen)
        view = GatheredCopy(engine)
        gathered = view.model()
        via_copy, _ = actor_forward(gathered, seqs, attn, plen)
        view.done()
    engine.train()
    c.check("zero3.experience_on_copy_equals_engine",
            torch.allclose(via_copy, via_engine, atol=1e-5, rtol=1e-5) and view._copy is None,
            max_diff=float((via_copy - via_engine).abs().max()))
    # done() frees the copy's weights at once, even while something still holds the module
    c.check("zero3.released_copy_holds_no_weights", all(p.numel() == 0 for p in gathered.parameters()))
    # held(): uses in a row share one gathered copy (their done() keeps it); it is dropped at the end
    with torch.no_grad(), view.held():
        first = view.model()
        view.done()
        second = view.model()
        view.done()
        held_ok = first is second and view._copy is first and first.training is False
    c.check("zero3.held_copy_shared_then_dropped", held_ok and view._copy is None)

    # the hf engine's inference_copy is the copy it generated with (step 3 scores on it, held); kept with keep_copy
    opts = make_rollout_engine("hf", engine, RolloutOptions(keep_copy=True))
    with torch.no_grad(), opts.inference_copy.held():
        out = opts.generate(s.prompts, s.gen)
        generated_with = opts.inference_copy._copy
        same_copy = generated_with is not None and opts.inference_copy.model() is generated_with
    c.check("zero3.inference_copy_is_the_generating_copy", same_copy and batch_equal(out, s.expected)
            and opts.inference_copy._copy is generated_with, got=batch_summary(out))
    opts.release()
    c.check("zero3.inference_copy_released", opts.inference_copy._copy is None)


def zero3_after_step(s: Setup, engine, hf, kept, before_state: dict) -> None:
    """After an optimizer step the hf engine and the kept copy generate with the new weights; an idle rank
    still joins the gather."""
    c, prompts, gen = s.c, s.prompts, s.gen
    loss = train_step(engine, s.expected)
    stepped = full_state(engine.module)
    c.check("zero3.trains", torch.isfinite(torch.tensor(loss))
            and any(not torch.equal(before_state[k], stepped[k]) for k in before_state))

    new_ref = copy.deepcopy(s.ref)
    new_ref.load_state_dict(stepped)
    expected2 = postprocess(prompts.input_ids, prompts.attention_mask,
                            plain_generate(new_ref, prompts, s.eos, s.device), s.eos, PAD)
    out = kept.generate(prompts, gen)
    c.check("zero3.kept_refreshed_after_step", batch_equal(out, expected2), got=batch_summary(out),
            want=batch_summary(expected2))
    out = hf.generate(prompts, gen)
    c.check("zero3.hf_after_step", batch_equal(out, expected2), got=batch_summary(out))
    c.check("zero3.trains_again", torch.isfinite(torch.tensor(train_step(engine, expected2))))

    # a rank with no prompts still joins the gather; the others are not left hanging
    empty = PromptBatch(prompts.input_ids[:0], prompts.attention_mask[:0]) if s.rank == 1 else prompts
    out = hf.generate(empty, gen)
    c.check("zero3.empty_rank_ok", len(out) == len(empty))


def lora(s: Setup) -> None:
    """hf on a ZeRO-3 LoRA actor: the tokens of the merged model; weights untouched; it trains."""
    from peft import LoraConfig, get_peft_model

    c, ref, prompts, gen, eos, device, model_dir = s.c, s.ref, s.prompts, s.gen, s.eos, s.device, s.model_dir
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(1)
    ref_lora = get_peft_model(copy.deepcopy(ref), lcfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in ref_lora.named_parameters():
            if "lora_B" in name:  # peft starts B at 0 (a no-op adapter): make it bite
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    lora_state = {k: v.detach().clone() for k, v in ref_lora.named_parameters() if "lora_" in k}
    merged = copy.deepcopy(ref_lora).merge_and_unload()
    want = postprocess(prompts.input_ids, prompts.attention_mask,
                       plain_generate(merged, prompts, eos, device), eos, PAD)
    c.check("lora.adapter_changes_output", not batch_equal(want, s.expected) or any(
        not torch.equal(merged.state_dict()[k], ref.state_dict()[k]) for k in ref.state_dict()))

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    model = get_peft_model(model, lcfg)
    for name, p in model.named_parameters():
        if name in lora_state:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                p.copy_(lora_state[name])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config(3))
    c.check("lora.actor_partitioned", any(hasattr(p, "ds_id") for p in engine.module.parameters()))
    before = full_state(engine.module)
    out = make_rollout_engine("hf", engine).generate(prompts, gen)
    c.check("lora.hf_equals_merged", batch_equal(out, want), got=batch_summary(out), want=batch_summary(want))
    after = full_state(engine.module)
    c.check("lora.weights_untouched", all(torch.equal(before[k], after[k]) for k in before))
    c.check("lora.trains", torch.isfinite(torch.tensor(train_step(engine, want))))


def hf_cuda(s: Setup) -> None:
    """hf and hf-synced on a ZeRO-3 CUDA actor: generate's tokens, on the GPU; the engine trains."""
    c, prompts, gen, expected, model_dir = s.c, s.prompts, s.gen, s.expected, s.model_dir
    dschf = HfDeepSpeedConfig(ds_config(3))  # noqa: F841
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    c.check("gpu.actor_partitioned", any(hasattr(p, "ds_id") for p in engine.module.parameters()))
    out = make_rollout_engine("hf", engine).generate(prompts, gen)
    c.check("gpu.hf_equals_plain", batch_equal(out, expected), got=batch_summary(out))
    c.check("gpu.hf_on_cuda", out.response_ids.device.type == "cuda")
    out = make_rollout_engine("hf-synced", engine).generate(prompts, gen)
    c.check("gpu.synced_equals_plain", batch_equal(out, expected), got=batch_summary(out))
    c.check("gpu.hf_trains", torch.isfinite(torch.tensor(train_step(engine, expected))))
    del dschf


def he(s: Setup, stage: int) -> None:
    """DeepSpeed's Hybrid Engine backend (fp16) at ZeRO ``stage``: a clear refusal, or valid rollouts."""
    from rlhfkit.errors import ConfigError

    c, prompts, gen, expected, model_dir, eos = s.c, s.prompts, s.gen, s.expected, s.model_dir, s.eos
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, fp16=True, hybrid=True))
    c.details[f"he{stage}.engine"] = type(engine).__name__
    try:
        rollout = make_rollout_engine("deepspeed", engine)
    except ConfigError as e:  # e.g. no inference kernels for this architecture: the message must say so
        c.details[f"he{stage}.config_error"] = str(e)
        c.check(f"gpu.he{stage}_refused_clearly", "--rollout_backend hf" in str(e))
        return
    t0 = time.perf_counter()
    before = modes(engine.module)
    try:
        out = rollout.generate(prompts, gen)
    except ConfigError as e:  # DeepSpeed's kernels do not fit this transformers: a clear refusal, engine intact
        c.details[f"he{stage}.config_error"] = str(e)
        c.check(f"gpu.he{stage}_refused_clearly", "--rollout_backend hf" in str(e))
        c.check(f"gpu.he{stage}_modes_restored_after_refusal", modes(engine.module) == before)
        loss = train_step(engine, expected)
        c.details[f"he{stage}.loss_after_refusal"] = loss
        c.check(f"gpu.he{stage}_trains_after_refusal", torch.isfinite(torch.tensor(loss)))
        return
    c.details[f"he{stage}.first_call_seconds"] = time.perf_counter() - t0
    c.details[f"he{stage}.out"] = batch_summary(out)
    c.check(f"gpu.he{stage}_mask_ok", mask_ok(out, eos), got=batch_summary(out))
    c.check(f"gpu.he{stage}_modes_restored", modes(engine.module) == before)
    c.check(f"gpu.he{stage}_trains", torch.isfinite(torch.tensor(train_step(engine, out))))
    out2 = rollout.generate(prompts, gen)  # generates again after a step (weights refreshed)
    c.check(f"gpu.he{stage}_second_call_mask_ok", mask_ok(out2, eos), got=batch_summary(out2))
    hf_out = make_rollout_engine("hf", engine).generate(prompts, gen)
    # fp16 fused kernels vs the transformers forward: report agreement, do not require it
    agree = (out2.response_ids[:, :4] == hf_out.response_ids[:, :4]).float().mean().item() \
        if out2.response_ids.shape[1] >= 4 and hf_out.response_ids.shape[1] >= 4 else None
    c.details[f"he{stage}.first4_token_agreement_with_hf"] = agree


def cpu_checks(c: Checker, rank: int, world: int, device, model_dir: str) -> None:
    s = reference_setup(c, rank, world, device, model_dir)
    c.check("reference.mask_ok", mask_ok(s.expected, s.eos))
    c.run("zero0", functools.partial(zero0, s))
    dschf = HfDeepSpeedConfig(ds_config(3))  # noqa: F841 - alive: from_pretrained partitions, and so would from_config
    c.run("zero3", functools.partial(zero3, s))
    c.run("lora", functools.partial(lora, s))


def gpu_checks(c: Checker, rank: int, world: int, device, model_dir: str) -> None:
    s = reference_setup(c, rank, world, device, model_dir, gpu=True)
    c.run("gpu.hf", functools.partial(hf_cuda, s))
    c.run("gpu.he3", functools.partial(he, s, 3))
    c.run("gpu.he2", functools.partial(he, s, 2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if args.mode == "cpu" else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(get_accelerator().current_device_name())
    model_dir = os.path.join(args.out, "tiny-llama")

    c = Checker(os.path.join(args.out, f"rank{rank}.json"), rank, world)
    t0 = time.perf_counter()
    (cpu_checks if args.mode == "cpu" else gpu_checks)(c, rank, world, device, model_dir)
    c.details["seconds"] = time.perf_counter() - t0
    c.dump()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
