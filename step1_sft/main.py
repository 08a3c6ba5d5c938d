"""Step 1: supervised fine-tuning (SFT) on prompt + chosen response, loss on response tokens only.

    deepspeed --num_gpus 2 step1_sft/main.py --model_name_or_path BASE --data_path DATA \
        --zero_stage 3 --output_dir out/step1

Reads a base checkpoint (or any HF causal LM directory), writes an 'sft' checkpoint directory.
Loss: the token mean of -log pi(y_t | x, y_<t) over the response tokens of the whole global
micro-batch (every rank's tokens count alike, whatever the rank's share of them).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import IGNORE_INDEX, sft_loss  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import config_dict  # noqa: E402
from rlhfkit.data import collate_sft, tokenize_sft  # noqa: E402
from rlhfkit.engines import batch_plan, count_steps, trainable_engine  # noqa: E402
from rlhfkit.loaders import eval_batches, feature_length, to_device, train_loader  # noqa: E402
from rlhfkit.models import load_tokenizer  # noqa: E402
from rlhfkit.resume_reshard import resume_layout, with_layout  # noqa: E402
from rlhfkit.program import load_split, make_logger, make_run_state, print_summary, run_main, start_program  # noqa: E402
from rlhfkit.supervised import LoopResult, fit  # noqa: E402
from step1_sft.config import SFTConfig  # noqa: E402 - SFTConfig: its former home was this module


def response_logits(model: Any, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels from the batch's earliest response position on. The prompt's logits are
    never used, so the LM head (a large vocabulary) and its log-softmax skip them."""
    labels = batch["labels"]
    first = int((labels != IGNORE_INDEX).float().argmax(-1).min().item())  # earliest labelled position
    keep = labels.shape[1] - max(first - 1, 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                   logits_to_keep=keep).logits
    return logits, labels[:, labels.shape[1] - keep:]


class SFTObjective:
    """The response-token NLL of the model being trained: the training loss and the held-out
    loss and perplexity."""

    def __init__(self, engine: Any):
        self.engine = engine

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The training loss: this rank's NLL sum over the global micro-batch's response-token count
        divided by the world size, so that DeepSpeed's gradient average over ranks is the global token
        mean (and so is the mean of the logged losses over ranks)."""
        n_global = dist.all_reduce_sum((batch["labels"][:, 1:] != IGNORE_INDEX).sum().to(torch.float64))
        logits, labels = response_logits(self.engine, batch)
        loss, _ = sft_loss(logits, labels, num_tokens=n_global.item() / dist.world_size())
        return loss, {"loss": loss.item()}

    @torch.no_grad()
    def evaluate(self, eval_set: list, collate: Any, batch_size: int) -> dict:
        """Held-out loss (token mean over all ranks' response tokens) and its perplexity."""
        self.engine.eval()
        nll = torch.zeros(2, dtype=torch.float64)  # NLL sum, tokens
        for batch, weights in eval_batches(eval_set, collate, batch_size):
            batch = to_device(batch, self.engine.device)
            batch["labels"][weights.to(batch["labels"].device) == 0] = IGNORE_INDEX  # padding rows
            logits, labels = response_logits(self.engine, batch)
            loss, n = sft_loss(logits, labels)
            nll += torch.tensor([loss.item() * n.item(), n.item()], dtype=torch.float64)
        total = dist.all_reduce_sum(nll)
        mean = (total[0] / total[1].clamp(min=1)).item()
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}


def run_metrics(result: LoopResult) -> dict:
    """The manifest's metrics: held-out perplexity before and after training, and the run's size."""
    first, last = result.evals[0], result.evals[-1]
    return {"eval_perplexity_before": first["perplexity"], "eval_perplexity_after": last["perplexity"],
            "eval_loss_after": last["loss"], "steps": result.steps, "nonfinite_skipped": result.nonfinite_skipped,
            "train_samples": result.samples, "train_tokens": result.tokens, "seconds": result.seconds}


def summary(result: LoopResult, cfg: SFTConfig) -> dict:
    """The end-of-run summary lines, with the command of the next step."""
    first, last = result.evals[0], result.evals[-1]
    seconds, out = max(result.seconds, 1e-9), os.path.abspath(cfg.output_dir)
    return {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s",
        "throughput": f"{result.samples / seconds:.2f} samples/s, {result.tokens / seconds:.0f} tokens/s",
        "eval perplexity": f"{first['perplexity']:.3f} before -> {last['perplexity']:.3f} after",
        "checkpoint": out,
        "metrics": os.path.join(out, "logs", "metrics.jsonl"),
        "next": f"deepspeed step2_reward/main.py --model_name_or_path {out} --data_path {' '.join(cfg.data_path)} --output_dir OUT",
    }


def main() -> None:
    cfg = start_program(SFTConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "actor"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)
    pad = tokenizer.pad_token_id

    # 2. Data: this step's share of each source, as prompt + response with labels on the response only.
    train_set, eval_set, sources = load_split(cfg, phase=1, need="sft", tokenize=tokenize_sft, tokenizer=tokenizer)
    collate = functools.partial(collate_sft, pad_token_id=pad)

    # 3. The model as a DeepSpeed training engine (LoRA optional).
    layout = resume_layout(cfg)  # the saved run's batch layout when --resume continues one
    plan = batch_plan(layout.micro_batch, layout.grad_accum)
    loader = train_loader(train_set, collate, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None,
                          order_batch=layout.order_batch)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "causal_lm", plan=plan, total_steps=total_steps, pad_token_id=pad)
    logger = make_logger(cfg, "sft")
    dist.print_rank0(f"training {total_steps} steps, global batch {plan.global_batch} "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation)")

    # 4. Train on the response-token NLL, evaluating loss and perplexity on the held-out split before,
    #    every --eval_interval steps and after.
    sft = SFTObjective(engine)
    result = fit(engine, loader, compute_loss=sft,
                 evaluate=functools.partial(sft.evaluate, eval_set, collate, cfg.per_device_eval_batch_size),
                 total_steps=total_steps, epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum,
                 eval_interval=cfg.eval_interval, log_interval=cfg.log_interval, logger=logger, program="sft",
                 progress_bar=cfg.progress_bar, run_state=with_layout(make_run_state(cfg, {"model": engine}, logger), layout),
                 max_nonfinite_steps=cfg.max_nonfinite_steps)

    # 5. Export the checkpoint directory.
    manifest = build_manifest(stage="sft", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=run_metrics(result), zero_stage=cfg.zero_stage, dtype=cfg.dtype)
    export_model(engine, tokenizer, cfg.output_dir, manifest,
                 generation={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad,
                             "bos_token_id": tokenizer.bos_token_id})
    logger.close()
    print_summary("step 1 (SFT) done", summary(result, cfg))


if __name__ == "__main__":
    run_main(main)
