"""Distributed checks of the rollout backends, run by test_rollout_distributed.py as

    deepspeed --num_gpus 2 tests/rollout/dist_rollout_worker.py --out DIR [--mode cpu|gpu]

Each rank writes DIR/rank{r}.json: {"checks": {name: bool}, "details": {...}}; the test asserts.
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
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

from rlhfkit.rollout import GenerationConfig, PromptBatch, RolloutOptions, make_rollout_engine, postprocess  # noqa: E402

PAD = 0
MAX_NEW = 12
# prompt lengths per rank: different counts and lengths on each rank
PROMPT_LENGTHS = {0: [5, 9, 3], 1: [7, 4]}


def tiny_config(gpu: bool = False) -> LlamaConfig:
    if gpu:  # DeepSpeed's inference kernels want a real head size (64) and no GQA
        return LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                           initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                           pad_token_id=PAD)
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                       pad_token_id=PAD)


def make_prompts(rank: int) -> PromptBatch:
    g = torch.Generator().manual_seed(100 + rank)
    lengths = PROMPT_LENGTHS[rank % 2]
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), P), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(3, 1000, (n,), generator=g)
        mask[i, P - n:] = 1
    return PromptBatch(ids, mask)


def plain_generate(model, prompts: PromptBatch, eos, device, max_new=MAX_NEW) -> torch.Tensor:
    """Plain transformers generate on an unsharded model: the reference. Returns the new tokens [B, G]."""
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompts.input_ids.to(device), attention_mask=prompts.attention_mask.to(device),
                             do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=PAD,
                             synced_gpus=False)
    return out[:, prompts.input_ids.shape[1]:].cpu()


def pick_eos(ref, device, world: int) -> list[int]:
    """EOS ids that the greedy decode emits mid-response in some rows but never in others."""
    rows = []
    for r in range(max(world, 2)):
        rows.extend(plain_generate(ref, make_prompts(r), None, device).tolist())

    def first_positions(tokens: set[int]) -> list[int | None]:
        return [next((i for i, t in enumerate(row) if t in tokens), None) for row in rows]

    def score(tokens: set[int]):
        pos = first_positions(tokens)
        found = [p for p in pos if p is not None]
        return (None in pos, sum(1 <= p <= MAX_NEW - 3 for p in found), len(set(found)))

    candidates = sorted({t for row in rows for t in row if t != PAD}, key=lambda t: (score({t}), -t), reverse=True)
    eos = [candidates[0]]
    for t in candidates[1:]:  # a second EOS id that still leaves a truncated row
        s = score({eos[0], t})
        if s[0] and s[1] > score({eos[0]})[1]:
            eos.append(t)
            break
    return eos


def batch_equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu())
               for f in ("prompt_ids", "prompt_mask", "response_ids", "action_mask", "truncated"))


def batch_summary(b) -> dict:
    return {"response_ids": b.response_ids.tolist(), "action_mask": b.action_mask.tolist(),
            "truncated": b.truncated.tolist()}


def mask_ok(b, eos) -> bool:
    """EOS is the last masked token of every non-truncated row, nothing after it is masked, all after is pad."""
    for i in range(len(b)):
        n = int(b.response_lengths[i])
        row, m = b.response_ids[i].tolist(), b.action_mask[i].tolist()
        if m != [1] * n + [0] * (len(m) - n) or any(t != PAD for t in row[n:]):
            return False
        if bool(b.truncated[i]) == (row[n - 1] in eos) or any(t in eos for t in row[:n - 1]):
            return False
    return True


def full_state(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().float().cpu().clone()
    return out


def train_step(engine, batch) -> float:
    engine.train()
    ids = batch.sequences.to(engine.device)
    mask = batch.attention_mask.to(engine.device)
    labels = ids.masked_fill(mask == 0, -100)
    loss = engine(input_ids=ids, attention_mask=mask, labels=labels).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def ds_config(stage: int, fp16: bool = False, hybrid: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        # no persistent small parameters: the tiny model is fetched per use, like a big one
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "fp16": {"enabled": fp16, "initial_scale_power": 8},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": 256, "inference_tp_size": 1,
                                "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8}
    return cfg


class CountCollectives:
    """Counts collective calls, both through DeepSpeed's comm backend (ZeRO-3's fetches) and
    straight through torch.distributed (the rollout's own gathers, synced generate's flag)."""

    NAMES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor", "barrier",
             "all_to_all_single", "all_gather_coalesced", "all_reduce_coalesced", "inference_all_reduce")

    def __enter__(self):
        from deepspeed.comm import comm as ds_comm

        self.count, self._patched = 0, []
        for owner in (ds_comm.cdb, torch.distributed):
            for name in self.NAMES:
                fn = getattr(owner, name, None)
                if fn is None:
                    continue

                def counted(*a, _fn=fn, **k):
                    self.count += 1
                    return _fn(*a, **k)

                self._patched.append((owner, name, fn, name in vars(owner)))
                setattr(owner, name, counted)
        return self

    def __exit__(self, *exc):
        for owner, name, fn, own_attr in reversed(self._patched):
            if own_attr:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # an instance attribute that shadowed the bound method


def modes(module) -> list[bool]:
    return [m.training for m in module.modules()]


class Checker:
    def __init__(self, path: str, rank: int, world: int):
        self.checks: dict[str, bool] = {}
        self.details: dict[str, object] = {}
        self.path, self.rank, self.world = path, rank, world

    def dump(self) -> None:
        """Write the results so far (atomically), so a run killed later still reports."""
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(self.path), delete=False) as f:
            json.dump({"rank": self.rank, "world": self.world, "checks": self.checks, "details": self.details}, f,
                      indent=1)
        os.replace(f.name, self.path)

    def check(self, name: str, ok: bool, **details) -> None:
        self.checks[name] = bool(ok)
        if details and not ok:
            self.details[name] = details

    def run(self, name: str, fn) -> None:
        """Run a group of checks; an exception fails the group with its traceback."""
        try:
            fn()
            self.checks.setdefault(name + ".ran", True)
        except Exception:  # noqa: BLE001 - reported to the test
            self.checks[name + ".ran"] = False
            self.details[name + ".error"] = traceback.format_exc()
        self.dump()


def cpu_checks(c: Checker, rank: int, world: int, device, model_dir: str) -> None:
    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_config()).to(device).eval()  # plain, before any HfDeepSpeedConfig exists
    if rank == 0:
        ref.save_pretrained(model_dir)
    torch.distributed.barrier()

    eos = pick_eos(ref, device, world)
    c.details["eos"] = eos
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    prompts = make_prompts(rank)
    expected = postprocess(prompts.input_ids, prompts.attention_mask, plain_generate(ref, prompts, eos, device), eos, PAD)
    c.details["expected"] = batch_summary(expected)
    c.check("reference.mask_ok", mask_ok(expected, eos))

    def zero0():
        model = copy.deepcopy(ref)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(0))
        before = modes(engine.module)
        out = make_rollout_engine("hf", engine).generate(prompts, gen)
        c.check("zero0.hf_equals_plain", batch_equal(out, expected), got=batch_summary(out))
        c.check("zero0.modes_restored", modes(engine.module) == before and engine.module.training)
        c.check("zero0.trains", torch.isfinite(torch.tensor(train_step(engine, expected))))

        plain = copy.deepcopy(ref).train()
        out = make_rollout_engine("hf", plain).generate(prompts, gen)
        c.check("module.hf_equals_plain", batch_equal(out, expected), got=batch_summary(out))
        c.check("module.mode_restored", plain.training)

    c.run("zero0", zero0)

    dschf = HfDeepSpeedConfig(ds_config(3))  # noqa: F841 - alive: from_pretrained partitions, and so would from_config

    def zero3():
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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

        hf = make_rollout_engine("hf", engine)
        t0 = time.perf_counter()
        with CountCollectives() as hf_calls:
            out = hf.generate(prompts, gen)
        c.details["zero3.hf_seconds"] = time.perf_counter() - t0
        c.details["zero3.hf_collectives"] = hf_calls.count
        c.check("zero3.hf_equals_plain", batch_equal(out, expected), got=batch_summary(out))
        c.check("zero3.hf_mask_ok", mask_ok(out, eos))
        c.check("zero3.hf_released_copy", hf._copy is None)

        synced = make_rollout_engine("hf-synced", engine)
        t0 = time.perf_counter()
        with CountCollectives() as synced_calls:
            out = synced.generate(prompts, gen)
        c.details["zero3.synced_seconds"] = time.perf_counter() - t0
        c.details["zero3.synced_collectives"] = synced_calls.count
        short = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
        with CountCollectives() as hf_short_calls:
            hf.generate(prompts, short)
        with CountCollectives() as synced_short_calls:
            synced.generate(prompts, short)
        # hf: each parameter gathered once per call, whatever the length; synced: gathers for every token
        n_params = len(list(engine.module.parameters()))
        c.check("zero3.hf_no_per_token_collectives",
                0 < hf_calls.count == hf_short_calls.count <= n_params + 2
                and synced_calls.count - synced_short_calls.count >= MAX_NEW - 2,
                hf=hf_calls.count, hf_short=hf_short_calls.count, n_params=n_params, synced=synced_calls.count,
                synced_short=synced_short_calls.count)
        c.details["zero3.collectives"] = dict(hf=hf_calls.count, hf_short=hf_short_calls.count,
                                              synced=synced_calls.count, synced_short=synced_short_calls.count)
        c.check("zero3.synced_equals_plain", batch_equal(out, expected), got=batch_summary(out))

        out = make_rollout_engine("hf", engine, direct_gather=False).generate(prompts, gen)
        c.check("zero3.hf_via_gathered_parameters_equals_plain", batch_equal(out, expected), got=batch_summary(out))

        kept = make_rollout_engine("hf", engine, keep_copy=True)
        out = kept.generate(prompts, gen)
        c.check("zero3.kept_equals_plain", batch_equal(out, expected), got=batch_summary(out))
        c.check("zero3.kept_copy_plain", kept._copy is not None
                and not any(hasattr(p, "ds_id") for p in kept._copy.parameters()) and not kept._copy.training)

        after_state = full_state(engine.module)
        c.check("zero3.weights_untouched", all(torch.equal(before_state[k], after_state[k]) for k in before_state))
        c.check("zero3.modes_restored", modes(engine.module) == before_modes and engine.module.training)
        c.check("zero3.zero_status_untouched", [str(p.ds_status) for p in engine.module.parameters()] == before_status)
        c.check("zero3.generation_config_restored", engine.module.generation_config.temperature == 0.3)

        # step 3's experience passes on a gathered copy give the engine's own logprobs, and the copy is dropped
        from rlhfkit.experience import actor_forward
        from rlhfkit.models.gathered import GatheredCopy

        seqs, attn, plen = expected.sequences, expected.attention_mask, expected.prompt_ids.shape[1]
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
            out = opts.generate(prompts, gen)
            generated_with = opts.inference_copy._copy
            same_copy = generated_with is not None and opts.inference_copy.model() is generated_with
        c.check("zero3.inference_copy_is_the_generating_copy", same_copy and batch_equal(out, expected)
                and opts.inference_copy._copy is generated_with, got=batch_summary(out))
        opts.release()
        c.check("zero3.inference_copy_released", opts.inference_copy._copy is None)

        loss = train_step(engine, expected)
        stepped = full_state(engine.module)
        c.check("zero3.trains", torch.isfinite(torch.tensor(loss))
                and any(not torch.equal(before_state[k], stepped[k]) for k in before_state))

        # the kept copy must pick up the new weights
        new_ref = copy.deepcopy(ref)
        new_ref.load_state_dict(stepped)
        expected2 = postprocess(prompts.input_ids, prompts.attention_mask,
                                plain_generate(new_ref, prompts, eos, device), eos, PAD)
        out = kept.generate(prompts, gen)
        c.check("zero3.kept_refreshed_after_step", batch_equal(out, expected2), got=batch_summary(out),
                want=batch_summary(expected2))
        out = hf.generate(prompts, gen)
        c.check("zero3.hf_after_step", batch_equal(out, expected2), got=batch_summary(out))
        c.check("zero3.trains_again", torch.isfinite(torch.tensor(train_step(engine, expected2))))

        # a rank with no prompts still joins the gather; the others are not left hanging
        empty = PromptBatch(prompts.input_ids[:0], prompts.attention_mask[:0]) if rank == 1 else prompts
        out = hf.generate(empty, gen)
        c.check("zero3.empty_rank_ok", len(out) == len(empty))

    c.run("zero3", zero3)

    def lora():
        from peft import LoraConfig, get_peft_model

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
        c.check("lora.adapter_changes_output", not batch_equal(want, expected) or any(
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

    c.run("lora", lora)


def gpu_checks(c: Checker, rank: int, world: int, device, model_dir: str) -> None:
    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_config(gpu=True)).to(device).eval()
    if rank == 0:
        ref.save_pretrained(model_dir)
    torch.distributed.barrier()
    eos = pick_eos(ref, device, world)
    c.details["eos"] = eos
    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    prompts = make_prompts(rank)
    expected = postprocess(prompts.input_ids.to(device), prompts.attention_mask.to(device),
                           plain_generate(ref, prompts, eos, device).to(device), eos, PAD)
    c.details["expected"] = batch_summary(expected)

    def hf_cuda():
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

    c.run("gpu.hf", hf_cuda)

    def he(stage: int):
        from rlhfkit.errors import ConfigError

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

    c.run("gpu.he3", lambda: he(3))
    c.run("gpu.he2", lambda: he(2))


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
