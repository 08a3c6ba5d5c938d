"""DeepSpeed-Chat's step-1 recipe, re-stated for a same-run baseline in bench/train_throughput.py.

    deepspeed --num_gpus 2 bench/dschat_sft_baseline.py --model BASE --data PAIRS --steps 8 --micro 4 --seq 256 --out r.json

What DeepSpeed-Chat's step 1 does (training/step1_supervised_finetuning/main.py and utils/ of
DeepSpeedExamples), written down here so that both recipes run on the same machine in the same
minute: every row padded to --max_seq_len, the loss on every real token (prompt included), the
model's own loss (full-vocabulary logits at every position), DeepSpeed-Chat's ZeRO-3 settings
(persistence 1e4, 3e7 live parameters, 3e7 prefetch, overlap_comm), the model's default attention
kernel, and torch's AdamW without fused kernels (DeepSpeed-Chat uses FusedAdam, a CUDA op; on the CPU
accelerator the plain torch optimizer is its closest stand-in). The text comes from rlhfkit's data
layer (chat template), so both recipes see the same rows. Not part of the library; not a test.
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
from rlhfkit.data import load_phase_data, tokenize_sft  # noqa: E402
from rlhfkit.models import load_model, load_tokenizer  # noqa: E402


def dschat_config(micro: int, world: int) -> dict:
    return {
        "train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "zero_force_ds_cpu_optimizer": False,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init(600)
    torch.manual_seed(1234)
    tok = load_tokenizer(args.model)
    rows, _, _ = load_phase_data([args.data], phase=1, need="sft", data_split="2,4,4", seed=1234, eval_fraction=0.1)
    feats, _ = tokenize_sft(rows, tok, args.seq)
    # DeepSpeed-Chat pads every row to max_seq_len and trains on every real token
    ids = torch.full((len(feats), args.seq), tok.pad_token_id)
    mask = torch.zeros((len(feats), args.seq), dtype=torch.long)
    for i, f in enumerate(feats):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    sampler = torch.utils.data.DistributedSampler(torch.utils.data.TensorDataset(ids), seed=1234)
    order = list(sampler)

    # partitioned while loading, as DeepSpeed-Chat does through transformers' HfDeepSpeedConfig
    model = load_model(args.model, "causal_lm", dtype="bf16", zero3_ds_config=dschat_config(args.micro, dist.world_size()),
                       pad_token_id=tok.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=dschat_config(args.micro, dist.world_size()))
    engine.train()
    times, tokens = [], 0
    for step in range(args.steps):
        t = time.time()
        idx = order[step * args.micro:(step + 1) * args.micro]
        loss = engine(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx], use_cache=False).loss
        engine.backward(loss)
        engine.step()
        times.append(time.time() - t)
        if step:  # the first step warms up
            tokens += int(dist.all_reduce_sum(mask[idx].sum().double()).item())
    seconds = dist.all_reduce_max(torch.tensor(sum(times[1:]), dtype=torch.float64)).item()
    if dist.is_main():
        timed = args.steps - 1
        with open(args.out, "w") as f:
            json.dump({"seconds_per_step": seconds / timed, "samples_per_s": timed * args.micro * dist.world_size() / seconds,
                       "tokens_per_s": tokens / seconds, "steps_timed": timed}, f)


if __name__ == "__main__":
    main()
