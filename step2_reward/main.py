"""Step 2: a pairwise reward model, loss softplus(r_rejected - r_chosen).

    deepspeed --num_gpus 2 step2_reward/main.py --model_name_or_path out/step1 --data_path DATA \
        --zero_stage 3 --output_dir out/step2

Reads a step-1 (or base) checkpoint, writes a 'reward' checkpoint directory: a one-label
AutoModelForSequenceClassification whose score is read at the last real token of a sequence.
Each pair is one row in training (--pack_pairs: the prompt once, then the chosen and the rejected
response, each attending to the prompt and itself); evaluation runs chosen rows then rejected rows
([2B, T]). Either way one forward scores both sides of a pair.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import pairwise_loss  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import config_dict  # noqa: E402
from rlhfkit.data import collate_packed_pairs, collate_pairs, tokenize_by_source, tokenize_pairs  # noqa: E402
from rlhfkit.engines import batch_plan, count_steps, trainable_engine  # noqa: E402
from rlhfkit.loaders import eval_batches, feature_length, train_loader  # noqa: E402
from rlhfkit.models import load_tokenizer, packed_pair_scores, scores_and_head_inputs, sequence_scores  # noqa: E402
from rlhfkit.resume_reshard import resume_layout, with_layout  # noqa: E402
from rlhfkit.program import load_split, make_logger, make_run_state, print_summary, run_main, start_program  # noqa: E402
from rlhfkit.rewards import by_source, held_out_baselines, pair_metrics_by_source, score_pairs  # noqa: E402
from rlhfkit.supervised import LoopResult, fit  # noqa: E402
from step2_reward.config import RewardConfig  # noqa: E402 - RewardConfig: its former home was this module
from step2_reward.head_fit import fit_head  # noqa: E402


class PairwiseObjective:
    """The pairwise loss of the reward model being trained: the training loss over this rank's pairs
    and the held-out preference accuracy and scores."""

    def __init__(self, engine: Any, pack_pairs: bool):
        self.engine, self.pack_pairs = engine, pack_pairs

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The training loss softplus(r_rejected - r_chosen), mean over the rank's pairs, and its
        statistics; a pair's chosen and rejected go through the model in the same forward."""
        if self.pack_pairs:
            chosen, rejected = packed_pair_scores(self.engine, batch)
        else:
            chosen, rejected = sequence_scores(self.engine, batch["input_ids"], batch["attention_mask"]).chunk(2)
        loss, accuracy = pairwise_loss(chosen, rejected)
        return loss, {"loss": loss.item(), "accuracy": float(accuracy), "margin": (chosen - rejected).mean().item()}

    def evaluate(self, eval_set: list, collate: Any, batch_size: int) -> dict:
        """Held-out pairs, over all ranks: accuracy (chosen scored above rejected) with its 95% interval,
        margin, mean scores, the longer-answer baseline and the accuracy on the pairs where the chosen
        answer is the shorter (:func:`rlhfkit.rewards.pair_metrics`); the same per data source when the
        set blends several (the gathered rows keep ``eval_set``'s order)."""
        return self._evaluate(eval_set, collate, batch_size, functools.partial(sequence_scores, self.engine), 1)[0]

    def evaluate_beside(self, eval_set: list, collate: Any, batch_size: int,
                        head: torch.nn.Module) -> tuple[dict, dict]:
        """:meth:`evaluate` of the model and of the same model with ``head`` (a plain one-output linear layer)
        in place of its score head, from one forward pass over the held-out pairs."""
        score_fn = functools.partial(scores_beside, self.engine, head)
        own, other = self._evaluate(eval_set, collate, batch_size, score_fn, 2)
        return own, other

    def _evaluate(self, eval_set: list, collate: Any, batch_size: int, score_fn: Any, columns: int) -> list[dict]:
        """The metrics of each column of ``score_fn(input_ids, attention_mask)``: [2B], or [2B, columns]."""
        self.engine.eval()
        mine = score_pairs(score_fn, eval_batches(eval_set, collate, batch_size), self.engine.device)
        gathered = list(zip(*dist.gather_lists(list(zip(*(t.tolist() for t in mine)))))) or [(), (), (), ()]
        c, r, c_len, r_len = (torch.tensor(col, dtype=torch.float64) for col in gathered)
        c, r = c.reshape(len(c_len), columns), r.reshape(len(r_len), columns)
        sources = [f.get("source", "") for f in eval_set]
        return [pair_metrics_by_source(c[:, k], r[:, k], c_len, r_len, sources) for k in range(columns)]


def scores_beside(model: Any, head: torch.nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 2]: each sequence's score under the model's own score head and under ``head``, one forward pass."""
    scores, head_inputs = scores_and_head_inputs(model, input_ids, attention_mask)
    return torch.stack([scores, head.to(head_inputs.device)(head_inputs).squeeze(-1)], dim=1)


def run_metrics(result: LoopResult) -> dict:
    """The manifest's metrics: held-out accuracy and margin before and after training, and the run's size."""
    first, last = result.evals[0], result.evals[-1]
    sets = by_source(last)
    return {"eval_accuracy_before": first["accuracy"], "eval_accuracy_after": last["accuracy"],
            "eval_accuracy_ci": [last["accuracy_ci_low"], last["accuracy_ci_high"]],
            **{f"eval_{k}": last[k] for k in ("longer_baseline", "chosen_shorter_accuracy", "chosen_shorter_pairs") if k in last},
            "eval_margin_before": first["margin"], "eval_margin_after": last["margin"], "eval_pairs": last["pairs"],
            **({"eval_by_source": sets} if sets else {}),
            "steps": result.steps, "nonfinite_skipped": result.nonfinite_skipped, "train_pairs": result.samples // 2,
            "seconds": result.seconds, "pairs_per_s": result.samples / 2 / max(result.seconds, 1e-9)}


def summary(result: LoopResult, metrics: dict, cfg: RewardConfig) -> dict:
    """The end-of-run summary lines, with the commands that evaluate the model and run step 3."""
    first, last = result.evals[0], result.evals[-1]
    out = os.path.abspath(cfg.output_dir)
    return {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s ({metrics['pairs_per_s']:.2f} pairs/s)",
        "held-out accuracy": f"{first['accuracy']:.3f} before -> {last['accuracy']:.3f} after ({last['pairs']} pairs; "
                             f"95% CI {last['accuracy_ci_low']:.3f}-{last['accuracy_ci_high']:.3f})",
        "baselines": held_out_baselines(last),
        **{f"held-out, {tag}": f"accuracy {ev['accuracy']:.3f} ({ev['pairs']} pairs; 95% CI {ev['accuracy_ci_low']:.3f}-"
                       f"{ev['accuracy_ci_high']:.3f}); {held_out_baselines(ev)}" for tag, ev in metrics.get("eval_by_source", {}).items()},
        "held-out margin": f"{first['margin']:.3f} before -> {last['margin']:.3f} after",
        "checkpoint": out,
        "metrics": os.path.join(out, "logs", "metrics.jsonl"),
        "evaluate": f"python step2_reward/evaluate.py --model {out} --split heldout",
        "next": f"deepspeed step3_ppo/main.py --actor_model_name_or_path {os.path.abspath(cfg.model_name_or_path)} "
                f"--critic_model_name_or_path {out} --data_path {' '.join(cfg.data_path)} --output_dir OUT",
    }


def main() -> None:
    cfg = start_program(RewardConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "reward"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)
    pad = tokenizer.pad_token_id

    # 2. Data: this step's share of each source as (chosen, rejected) pairs that still differ after
    #    truncation; training packs each pair into one row with --pack_pairs, evaluation runs the two rows apart.
    train_set, eval_set, sources = load_split(cfg, phase=2, need="pairs", tokenize=tokenize_pairs, tokenizer=tokenizer,
                                              tokenize_eval=functools.partial(tokenize_by_source, tokenize_pairs))
    train_collate = functools.partial(collate_packed_pairs if cfg.pack_pairs else collate_pairs, pad_token_id=pad)
    eval_collate = functools.partial(collate_pairs, pad_token_id=pad)

    # 3. The reward model (a one-label sequence classifier; fresh score head) as a DeepSpeed training engine.
    layout = resume_layout(cfg)  # the saved run's batch layout when --resume continues one
    plan = batch_plan(layout.micro_batch, layout.grad_accum)
    loader = train_loader(train_set, train_collate, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None,
                          order_batch=layout.order_batch)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "reward", plan=plan, total_steps=total_steps, pad_token_id=pad,
                              row_len=2 * cfg.max_seq_len if cfg.pack_pairs else cfg.max_seq_len)
    logger = make_logger(cfg, "reward")
    dist.print_rank0(f"fitting the score head on {len(train_set)} pairs' features (the body frozen, no optimiser steps)"
                     if cfg.fit_head_only else f"training {total_steps} steps, {plan.global_batch} pairs per step "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation)")

    # 4. Train on the pairwise loss, evaluating on the held-out pairs before, every --eval_interval steps and after.
    #    With --fit_head_only the body stays frozen and the head is the exact fit on the training pairs' features.
    pairwise = PairwiseObjective(engine, cfg.pack_pairs)
    evaluate = functools.partial(pairwise.evaluate, eval_set, eval_collate, cfg.per_device_eval_batch_size)
    head_fit: dict = {}
    if cfg.fit_head_only:
        # the training pairs' features read as training reads pairs: packed (each prompt computed once) by default;
        # the held-out pairs read once, scored by the fitted head (the model's own) and beside it by the fresh one
        result, head_fit = fit_head(engine, train_set, train_collate, cfg.per_device_eval_batch_size, logger, cfg.seed,
                                    functools.partial(pairwise.evaluate_beside, eval_set, eval_collate,
                                                      cfg.per_device_eval_batch_size))
    else:
        result = fit(engine, loader, compute_loss=pairwise, evaluate=evaluate, total_steps=total_steps,
                     epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum, eval_interval=cfg.eval_interval,
                     log_interval=cfg.log_interval, logger=logger, program="reward", progress_bar=cfg.progress_bar,
                     run_state=with_layout(make_run_state(cfg, {"model": engine}, logger), layout),
                     max_nonfinite_steps=cfg.max_nonfinite_steps,
                     sequences_per_row=2 if cfg.pack_pairs else 1)

    # 5. Export the reward-type checkpoint directory.
    metrics = {**run_metrics(result), **head_fit}
    manifest = build_manifest(stage="reward", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=metrics, zero_stage=cfg.zero_stage, dtype=cfg.dtype,
                              extra={"score_rule": "last real token (rightmost attention_mask == 1)"})
    export_model(engine, tokenizer, cfg.output_dir, manifest)
    logger.close()
    print_summary("step 2 (reward model) done", summary(result, metrics, cfg))


if __name__ == "__main__":
    run_main(main)
