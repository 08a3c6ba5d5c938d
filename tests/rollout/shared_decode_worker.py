"""Run on 2 ranks by tests/rollout/test_shared_decode.py: decode steps shared by the ranks
(rlhfkit.rollout.shared_decode) against each rank's own decode, and the hf backend on a bf16 ZeRO-3
actor choosing it. Each rank has its own prompts (another length; left padding on rank 0 only), so
the ranks' rows end at different steps. Rank 0 writes what the test checks."""

from __future__ import annotations

import argparse
import copy
import json

import torch

from rlhfkit import distributed, shm_collectives
from rlhfkit.engines import batch_plan, build_engine
from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine, shared_decode
from rlhfkit.rollout.fast_decode import llama_decoder
from rlhfkit.models import position_ids
from rlhfkit.rollout.sampling import _forward_kwargs, _new_cache, decode
from rlhfkit.rollout.shared_decode import SharedDecoder, decode_group
from transformers import LlamaConfig, LlamaForCausalLM

ROWS, PAD = 3, 0
BOUND = shared_decode.MIN_WEIGHT_BYTES  # the module's: this test's model is far smaller, so main() lowers it
LOW_BOUND = 1  # bytes: any gathered copy shares its steps; weights counted on ZeRO-3 shards (no elements) would not
EOS = list(range(192, 224))  # an eighth of the vocabulary: rank 0's rows all end at step 8, rank 1's run to the limit


def prompts(rank: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's ``rows`` prompts: 9 + 4r tokens; rank 0's first row left-padded by 3."""
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(8, 200, (rows, 9 + 4 * rank), generator=gen)
    mask = torch.ones_like(ids)
    if rank == 0:
        ids[0, :3], mask[0, :3] = PAD, 0
    return ids, mask


def decoded(model, ids, mask, gen: GenerationConfig, group, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return decode(model, model, ids, mask, gen, group)


def step_logits(model, ids, mask, group, steps: int = 6) -> list[torch.Tensor]:
    """The next-token logits of ``steps`` decode steps after a prefill, fed the same tokens: through the
    group's shared step (``group``) or this rank's own (None)."""
    with torch.inference_mode():
        cache = _new_cache(model)
        pos = position_ids(mask)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{_forward_kwargs(model)[0]: cache})
        capacity = ids.shape[1] + steps
        step = SharedDecoder(model, cache, capacity, group) if group else llama_decoder(model, cache, capacity)
        out, full = [], mask.bool()
        for t in range(steps):
            tokens = torch.full((ids.shape[0],), 11 + t)
            if group:
                step.running(tokens, False)
            full = torch.cat([full, full.new_ones(ids.shape[0], 1)], dim=1)
            out.append(step(tokens, pos[:, -1:] + t + 1, full[:, None, None, :]))
        return out


def check_decoder(model, rank: int) -> dict:
    ids, mask = prompts(rank)
    group = decode_group(model, ROWS, 12)
    got: dict = {"group": group is not None}
    greedy = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    sampled = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, min_new_tokens=2,
                               eos_token_id=EOS, pad_token_id=PAD)
    for name, gen in (("greedy", greedy), ("sampled", sampled)):
        own = decoded(model, ids, mask, gen, None, seed=5 + rank)
        after_own = torch.rand(3)  # the random stream after each: nothing is drawn once a rank's rows have ended
        shared = decoded(model, ids, mask, gen, group, seed=5 + rank)
        got[name] = {"equal": torch.equal(own, shared), "same_random_stream_after": torch.equal(after_own, torch.rand(3)),
                     "width": own.shape[1], "ended": bool(torch.isin(own, torch.tensor(EOS)).any(-1).all())}
    # the most rows the group shares (32 in all, where products were measured to keep each row's bits): still
    # the rank's own tokens
    most = 16
    many, many_mask = prompts(rank, most)
    got["greedy_most_rows"] = torch.equal(decoded(model, many, many_mask, greedy, None, seed=0),
                                          decoded(model, many, many_mask, greedy, decode_group(model, most, 12), seed=0))
    own, shared = step_logits(model, ids, mask, None), step_logits(model, ids, mask, group)
    got["logits_bitwise"] = all(torch.equal(a, b) for a, b in zip(own, shared))
    got["logits_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(own, shared))
    got["logits_scale"] = max(float(a.abs().max()) for a in own)
    return got


def check_backend(model, rank: int) -> dict:
    """The hf backend on a bf16 ZeRO-3 engine: shares its decode steps (exchanges counted) and returns the
    tokens of plain ``generate`` on the unsharded model; unequal row counts and RLHFKIT_SHARED_DECODE=0 do not."""
    ids, mask = prompts(rank)
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    plain = copy.deepcopy(model)
    plain.generation_config = type(plain.generation_config)()
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                              pad_token_id=PAD)[:, ids.shape[1]:]
    engine = build_engine(copy.deepcopy(model).train(), plan=batch_plan(ROWS, 1), zero_stage=3, dtype="bf16", offload=False,
                          learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), gradient_clipping=1.0,
                          lr_scheduler_type="constant", num_warmup_steps=0, total_steps=1)
    rollout = make_rollout_engine("hf", engine)
    shm = shm_collectives.installed()
    exchanges = []
    shm.exchange = lambda *a, _own=shm.exchange, **k: exchanges.append(1) or _own(*a, **k)  # counted
    out = rollout.generate(PromptBatch(ids, mask), gen).response_ids
    width = min(out.shape[1], want.shape[1])
    got = {"exchanges": len(exchanges), "equals_generate": torch.equal(out[:, :width], want[:, :width])
           and bool((want[:, width:] == PAD).all()) and bool((out[:, width:] == PAD).all())}
    exchanges.clear()
    rollout.generate(PromptBatch(ids[:ROWS - rank], mask[:ROWS - rank]), gen)  # 3 rows on rank 0, 2 on rank 1
    got["unequal_rows_exchanges"] = len(exchanges)
    exchanges.clear()
    rollout.generate(PromptBatch(*prompts(rank, 17)), gen)  # more than 32 rows in all
    got["too_many_rows_exchanges"] = len(exchanges)
    exchanges.clear()
    shared_decode.MIN_WEIGHT_BYTES = BOUND  # weights that fit in the caches: each rank decodes alone
    rollout.generate(PromptBatch(ids, mask), gen)
    shared_decode.MIN_WEIGHT_BYTES = LOW_BOUND
    got["small_weights_exchanges"] = len(exchanges)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher's
    args = ap.parse_args()
    distributed.init()
    rank = distributed.rank()
    shared_decode.MIN_WEIGHT_BYTES = LOW_BOUND  # share this tiny model's steps
    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, pad_token_id=PAD,
                                         attn_implementation="sdpa")).to(torch.bfloat16).eval()
    got = {"decoder": check_decoder(model, rank), "backend": check_backend(model, rank)}
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, got)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(everyone, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
