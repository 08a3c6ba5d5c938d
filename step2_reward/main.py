"""Step 2: a pairwise reward model, loss softplus(r_rejected - r_chosen).

    deepspeed --num_gpus 2 step2_reward/main.py --model_name_or_path out/step1 --data_path DATA \
        --zero_stage 3 --output_dir out/step2

Reads a step-1 (or base) checkpoint, writes a 'reward' checkpoint directory: a one-label
AutoModelForSequenceClassification whose score is read at the last real token of a sequence.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import pairwise_loss  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import (  # noqa: E402
    DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, PairArgs, arg, check_common, config_dict, require,
)
from rlhfkit.data import collate_packed_pairs, collate_pairs, tokenize_pairs  # noqa: E402
from rlhfkit.metrics import MetricsLogger  # noqa: E402
from rlhfkit.models import load_tokenizer, packed_pair_scores, sequence_scores  # noqa: E402
from rlhfkit.rewards import score_pairs  # noqa: E402
from rlhfkit.training import (  # noqa: E402
    batch_plan, count_steps, eval_batches, feature_length, fit, load_split, make_run_state, print_summary, run_main,
    start_program, train_loader, trainable_engine,
)


@dataclass
class RewardConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs, PairArgs):
    """Step 2 flags: those of step 1 (DeepSpeed-Chat names). No --num_padding_at_beginning: the
    score is read at the last real token, whatever the padding."""

    learning_rate: float = arg(5e-6, "Peak learning rate.")
    per_device_train_batch_size: int = arg(2, "Pairs per rank per micro-batch (each pair = 2 sequences in one forward).")

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)


def main() -> None:
    cfg = start_program(RewardConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "reward"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)

    # 2. Data: this step's share of each source as (chosen, rejected) pairs that still differ after truncation.
    train_set, eval_set, sources = load_split(cfg, phase=2, need="pairs", tokenize=tokenize_pairs, tokenizer=tokenizer)

    def collate(rows):
        return collate_pairs(rows, tokenizer.pad_token_id)

    def collate_train(rows):
        return (collate_packed_pairs if cfg.pack_pairs else collate_pairs)(rows, tokenizer.pad_token_id)

    # 3. The reward model (a one-label sequence classifier; fresh score head) and its engine.
    plan = batch_plan(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    loader = train_loader(train_set, collate_train, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "reward", plan=plan, total_steps=total_steps, pad_token_id=tokenizer.pad_token_id,
                              row_len=2 * cfg.max_seq_len if cfg.pack_pairs else cfg.max_seq_len)
    logger = MetricsLogger(os.path.join(cfg.output_dir, "logs"), cfg.enable_tensorboard, cfg.tensorboard_path, "reward")
    dist.print_rank0(f"training {total_steps} steps, {plan.global_batch} pairs per step "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation)")

    # 4. The loss: chosen and rejected of a pair go through the model in the same forward batch.
    def compute_loss(batch):
        if cfg.pack_pairs:
            chosen, rejected = packed_pair_scores(engine, batch)
        else:
            scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"])
            chosen, rejected = scores.chunk(2)
        loss, accuracy = pairwise_loss(chosen, rejected)
        return loss, {"loss": loss.item(), "accuracy": float(accuracy), "margin": (chosen - rejected).mean().item()}

    # 5. Evaluation on the held-out pairs: accuracy, mean chosen / rejected score, mean margin.
    def evaluate():
        engine.eval()
        chosen, rejected = score_pairs(lambda ids, mask: sequence_scores(engine, ids, mask),
                                       eval_batches(eval_set, collate, cfg.per_device_eval_batch_size), engine.device)
        sums = torch.tensor([float((chosen > rejected).sum()), float(chosen.sum()), float(rejected.sum()), chosen.numel()],
                            dtype=torch.float64)
        total = dist.all_reduce_sum(sums)
        n = max(total[3].item(), 1.0)
        return {"accuracy": total[0].item() / n, "chosen_score": total[1].item() / n, "rejected_score": total[2].item() / n,
                "margin": (total[1].item() - total[2].item()) / n, "pairs": int(total[3].item())}

    # 6. Train, then export the checkpoint directory.
    result = fit(engine, loader, compute_loss=compute_loss, evaluate=evaluate, total_steps=total_steps,
                 epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum, eval_interval=cfg.eval_interval,
                 log_interval=cfg.log_interval, logger=logger, program="reward", progress_bar=cfg.progress_bar,
                 run_state=make_run_state(cfg, {"model": engine}), max_nonfinite_steps=cfg.max_nonfinite_steps,
                 sequences_per_row=2 if cfg.pack_pairs else 1)
    first, last = result.evals[0], result.evals[-1]
    metrics = {"eval_accuracy_before": first["accuracy"], "eval_accuracy_after": last["accuracy"],
               "eval_margin_before": first["margin"], "eval_margin_after": last["margin"], "eval_pairs": last["pairs"],
               "steps": result.steps, "nonfinite_skipped": result.nonfinite_skipped, "train_pairs": result.samples // 2, "seconds": result.seconds,
               "pairs_per_s": result.samples / 2 / max(result.seconds, 1e-9)}
    manifest = build_manifest(stage="reward", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=metrics, zero_stage=cfg.zero_stage, dtype=cfg.dtype,
                              extra={"score_rule": "last real token (rightmost attention_mask == 1)"})
    export_model(engine, tokenizer, cfg.output_dir, manifest)
    logger.close()
    out = os.path.abspath(cfg.output_dir)
    print_summary("step 2 (reward model) done", {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s ({metrics['pairs_per_s']:.2f} pairs/s)",
        "held-out accuracy": f"{first['accuracy']:.3f} before -> {last['accuracy']:.3f} after ({last['pairs']} pairs)",
        "held-out margin": f"{first['margin']:.3f} before -> {last['margin']:.3f} after",
        "checkpoint": out,
        "metrics": os.path.join(out, "logs", "metrics.jsonl"),
        "evaluate": f"python step2_reward/evaluate.py --model {out} --split heldout",
        "next": f"deepspeed step3_ppo/main.py --actor_model_name_or_path {os.path.abspath(cfg.model_name_or_path)} "
                f"--critic_model_name_or_path {out} --data_path {' '.join(cfg.data_path)} --output_dir OUT",
    })


if __name__ == "__main__":
    run_main(main)
