"""DeepSpeed-Chat's step-1 and step-2 recipes, re-stated for same-run baselines in bench/train_throughput.py.

    deepspeed --num_gpus 2 bench/dschat_baseline.py --stage sft --model BASE --data PAIRS --steps 8 --micro 4 --seq 256 --out r.json
    deepspeed --num_gpus 2 bench/dschat_baseline.py --stage reward --model SFT --data PAIRS --steps 8 --micro 2 --seq 256 --out r.json

What DeepSpeed-Chat does (training/step{1,2}_*/main.py and dschat/utils/ of DeepSpeedExamples),
written down here so that its recipe and rlhfkit's run on the same machine in the same minute:
every sequence padded to --max_seq_len; DeepSpeed-Chat's ZeRO-3 settings (persistence 1e4, 3e7 live
parameters, 3e7 prefetch, overlap_comm); the model's default attention kernel; torch's AdamW without
fused kernels (DeepSpeed-Chat uses FusedAdam, a CUDA op; on the CPU accelerator the plain torch
optimizer is its closest stand-in).
- step 1: the loss on every real token (prompt included), the model's own loss (full-vocabulary
  logits at every position).
- step 2: a batch is the --micro chosen sequences then their rejected ones (2 x micro rows); the
  RewardModel's loss, a python loop over pairs of -logsigmoid(chosen - rejected) averaged over the
  positions from where the two sequences diverge to the end of the longer one.
The text comes from rlhfkit's data layer (chat template, truncation), so both recipes see the same
sequences. Not part of the library; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.program import join_process_group  # noqa: E402
from rlhfkit.data import load_phase_data, tokenize_pairs, tokenize_sft  # noqa: E402
from rlhfkit.models import load_model, load_tokenizer, token_values  # noqa: E402


def dschat_config(micro: int, world: int) -> dict:
    return {
        "train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "zero_force_ds_cpu_optimizer": False,
    }


def pad_to(seqs: list[list[int]], width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed-Chat's padding="max_length": every row padded to ``width``."""
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def dschat_reward_loss(rewards: torch.Tensor, input_ids: torch.Tensor, pad: int) -> torch.Tensor:
    """DeepSpeed-Chat's RewardModel.forward loss (num_padding_at_beginning=0): per pair, the mean
    -logsigmoid(chosen - rejected) over the positions from the first differing token to the end of
    the longer sequence."""
    bs, seq_len = input_ids.shape[0] // 2, input_ids.shape[1]
    loss = 0.0
    for i in range(bs):
        chosen, rejected = input_ids[i], input_ids[bs + i]
        c_inds = (chosen == pad).nonzero()
        c_ind = c_inds[0].item() if len(c_inds) > 0 else seq_len
        diverge = (chosen != rejected).nonzero()
        if len(diverge) == 0:
            end, start = seq_len, seq_len - 1
        else:
            r_inds = (rejected == pad).nonzero()
            end, start = max(c_ind, r_inds[0].item() if len(r_inds) > 0 else seq_len), diverge[0].item()
        loss = loss - torch.nn.functional.logsigmoid(rewards[i, start:end] - rewards[bs + i, start:end]).mean()
    return loss / bs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--stage", choices=["sft", "reward"], default="sft")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="rows (sft) or pairs (reward) per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # DeepSpeed-Chat joins with deepspeed.init_distributed: ZeRO's collectives through gloo, not rlhfkit's
    # shared-memory ones (rlhfkit/shm_collectives.py)
    os.environ["RLHFKIT_SHM_COLLECTIVES"] = "0"
    join_process_group(600)
    torch.manual_seed(1234)
    tok = load_tokenizer(args.model)
    pad = tok.pad_token_id
    if args.stage == "sft":
        rows, _, _ = load_phase_data([args.data], phase=1, need="sft", data_split="2,4,4", seed=1234, eval_fraction=0.1)
        feats, _ = tokenize_sft(rows, tok, args.seq)
        ids, mask = pad_to([f["input_ids"] for f in feats], args.seq, pad)
        labels = ids.masked_fill(mask == 0, -100)
    else:
        rows, _, _ = load_phase_data([args.data], phase=2, need="pairs", data_split="2,4,4", seed=1234, eval_fraction=0.1)
        feats, _ = tokenize_pairs(rows, tok, args.seq)
        chosen, chosen_mask = pad_to([f["chosen_input_ids"] for f in feats], args.seq, pad)
        rejected, rejected_mask = pad_to([f["rejected_input_ids"] for f in feats], args.seq, pad)
    sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(torch.zeros(len(feats))), seed=1234)
    order = list(sampler)

    # partitioned while loading, as DeepSpeed-Chat does through transformers' HfDeepSpeedConfig
    config = dschat_config(args.micro, dist.world_size())
    model = load_model(args.model, "causal_lm" if args.stage == "sft" else "reward", dtype="bf16", zero3_ds_config=config,
                       pad_token_id=pad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.train()
    times, tokens = [], 0
    for step in range(args.steps):
        t = time.time()
        idx = order[step * args.micro:(step + 1) * args.micro]
        if args.stage == "sft":
            batch_mask = mask[idx]
            loss = engine(input_ids=ids[idx], attention_mask=batch_mask, labels=labels[idx], use_cache=False).loss
        else:
            batch_ids = torch.cat([chosen[idx], rejected[idx]])
            batch_mask = torch.cat([chosen_mask[idx], rejected_mask[idx]])
            loss = dschat_reward_loss(token_values(engine, batch_ids, batch_mask), batch_ids, pad)
        engine.backward(loss)
        engine.step()
        times.append(time.time() - t)
        if step:  # the first step warms up
            tokens += int(dist.all_reduce_sum(batch_mask.sum().double()).item())
    seconds = dist.all_reduce_max(torch.tensor(sum(times[1:]), dtype=torch.float64)).item()
    if dist.is_main():
        timed = args.steps - 1
        sequences = timed * args.micro * dist.world_size() * (1 if args.stage == "sft" else 2)
        with open(args.out, "w") as f:
            json.dump({"seconds_per_step": seconds / timed, "samples_per_s": sequences / seconds,
                       "tokens_per_s": tokens / seconds, "steps_timed": timed}, f)


if __name__ == "__main__":
    main()
