"""Step 1: supervised fine-tuning (SFT) on prompt + chosen response, loss on response tokens only.

    deepspeed --num_gpus 2 step1_sft/main.py --model_name_or_path BASE --data_path DATA \
        --zero_stage 3 --output_dir out/step1

Reads a base checkpoint (or any HF causal LM directory), writes an 'sft' checkpoint directory.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import sft_loss  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, check_common, config_dict, require  # noqa: E402
from rlhfkit.data import collate_sft, tokenize_sft  # noqa: E402
from rlhfkit.metrics import MetricsLogger  # noqa: E402
from rlhfkit.models import load_tokenizer  # noqa: E402
from rlhfkit.training import (  # noqa: E402
    batch_plan, count_steps, eval_batches, feature_length, fit, load_split, make_run_state, print_summary, run_main,
    start_program, to_device, train_loader, trainable_engine,
)


@dataclass
class SFTConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs):
    """Step 1 flags (DeepSpeed-Chat names where it has them)."""

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)


def main() -> None:
    cfg = start_program(SFTConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "actor"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)

    # 2. Data: this step's share of each source, as prompt + response with labels on the response only.
    train_set, eval_set, sources = load_split(cfg, phase=1, need="sft", tokenize=tokenize_sft, tokenizer=tokenizer)

    def collate(rows):
        return collate_sft(rows, tokenizer.pad_token_id)

    # 3. Model and DeepSpeed engine.
    plan = batch_plan(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    loader = train_loader(train_set, collate, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "causal_lm", plan=plan, total_steps=total_steps, pad_token_id=tokenizer.pad_token_id)
    logger = MetricsLogger(os.path.join(cfg.output_dir, "logs"), cfg.enable_tensorboard, cfg.tensorboard_path, "sft")
    dist.print_rank0(f"training {total_steps} steps, global batch {plan.global_batch} "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation)")

    # 4. The loss: token-mean NLL of the response tokens over the whole global micro-batch. Logits
    #    are computed only from the earliest response position of the batch on (the prompt's are
    #    never used: that skips a share of the 49k-vocabulary LM head and its log-softmax).
    def response_logits(batch):
        labels = batch["labels"]
        first = int((labels != -100).float().argmax(-1).min().item())  # earliest labelled position
        keep = labels.shape[1] - max(first - 1, 0)
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                        logits_to_keep=keep).logits
        return logits, labels[:, labels.shape[1] - keep:]

    def compute_loss(batch):
        n_global = dist.all_reduce_sum((batch["labels"][:, 1:] != -100).sum().to(torch.float64))
        logits, labels = response_logits(batch)
        loss, _ = sft_loss(logits, labels, num_tokens=n_global.item() / dist.world_size())
        return loss, {"loss": loss.item()}  # the mean over ranks is the global token mean

    # 5. Evaluation: loss and perplexity on the held-out split.
    @torch.no_grad()
    def evaluate():
        engine.eval()
        nll = torch.zeros(2, dtype=torch.float64)
        for batch, weights in eval_batches(eval_set, collate, cfg.per_device_eval_batch_size):
            batch = to_device(batch, engine.device)
            batch["labels"][weights.to(batch["labels"].device) == 0] = -100
            logits, labels = response_logits(batch)
            loss, n = sft_loss(logits, labels)
            nll += torch.tensor([loss.item() * n.item(), n.item()], dtype=torch.float64)
        total = dist.all_reduce_sum(nll)
        mean = (total[0] / total[1].clamp(min=1)).item()
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}

    # 6. Train, then export the checkpoint directory.
    result = fit(engine, loader, compute_loss=compute_loss, evaluate=evaluate, total_steps=total_steps,
                 epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum, eval_interval=cfg.eval_interval,
                 log_interval=cfg.log_interval, logger=logger, program="sft", progress_bar=cfg.progress_bar,
                 run_state=make_run_state(cfg, {"model": engine}), max_nonfinite_steps=cfg.max_nonfinite_steps)
    first, last = result.evals[0], result.evals[-1]
    metrics = {"eval_perplexity_before": first["perplexity"], "eval_perplexity_after": last["perplexity"],
               "eval_loss_after": last["loss"], "steps": result.steps, "nonfinite_skipped": result.nonfinite_skipped, "train_samples": result.samples,
               "train_tokens": result.tokens, "seconds": result.seconds}
    manifest = build_manifest(stage="sft", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=metrics, zero_stage=cfg.zero_stage, dtype=cfg.dtype)
    export_model(engine, tokenizer, cfg.output_dir, manifest,
                 generation={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                             "bos_token_id": tokenizer.bos_token_id})
    logger.close()
    print_summary("step 1 (SFT) done", {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s",
        "throughput": f"{result.samples / max(result.seconds, 1e-9):.2f} samples/s, {result.tokens / max(result.seconds, 1e-9):.0f} tokens/s",
        "eval perplexity": f"{first['perplexity']:.3f} before -> {last['perplexity']:.3f} after",
        "checkpoint": os.path.abspath(cfg.output_dir),
        "metrics": os.path.join(os.path.abspath(cfg.output_dir), "logs", "metrics.jsonl"),
        "next": f"deepspeed step2_reward/main.py --model_name_or_path {os.path.abspath(cfg.output_dir)} --data_path {' '.join(cfg.data_path)} --output_dir OUT",
    })


if __name__ == "__main__":
    run_main(main)
