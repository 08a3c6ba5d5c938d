"""What dist_rollout_worker.py's checks share: the tiny reference model, each rank's prompts, plain
``generate`` on an unsharded copy (the expected tokens), DeepSpeed configs, a collective counter and the
:class:`Checker` that writes each rank's results."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from rlhfkit.rollout import GenerationConfig, PromptBatch, RolloutBatch, postprocess  # noqa: E402

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


@dataclass
class Setup:
    """One rank's fixtures: the unsharded reference model (saved to ``model_dir``), its EOS ids, greedy
    generation settings, this rank's prompts and the reference's tokens for them."""

    c: Checker
    rank: int
    world: int
    device: torch.device
    model_dir: str
    ref: LlamaForCausalLM
    eos: list[int]
    gen: GenerationConfig
    prompts: PromptBatch
    expected: RolloutBatch


def reference_setup(c: Checker, rank: int, world: int, device, model_dir: str, gpu: bool = False) -> Setup:
    """Build the reference model (rank 0 saves it for the engines to load), pick EOS ids that end some
    rows mid-response, and generate the expected tokens with plain ``generate``."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_config(gpu=gpu)).to(device).eval()  # plain, before any HfDeepSpeedConfig exists
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
    return Setup(c, rank, world, device, model_dir, ref, eos, gen, prompts, expected)
