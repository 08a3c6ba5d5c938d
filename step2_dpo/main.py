"""Step 2 (alternative to reward model + PPO): Direct Preference Optimization from preference pairs.

    deepspeed --num_gpus 2 step2_dpo/main.py --model_name_or_path SFT --data_path DATA \
        --zero_stage 3 --beta 0.1 --output_dir out/step2_dpo

The policy starts from --model_name_or_path (the step-1 model) and the same directory, loaded a
second time and frozen, is the reference. Each pair is one row in training (--pack_pairs: the prompt
once, then the chosen and the rejected response, each attending to the prompt and itself); evaluation
runs chosen rows then rejected rows ([2B, T]). One forward per model scores both sides.
Loss (Rafailov et al. 2023; IPO, Azar et al. 2023):
    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
    sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)      ipo: (h - 1 / (2 beta))^2
with log pi(y|x) the sum of the response tokens' log-probs. Writes a 'dpo' checkpoint directory
(an actor: it loads with AutoModelForCausalLM).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import dpo_loss, logprobs_from_logits  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import (  # noqa: E402
    DataArgs, DeepSpeedArgs, LogArgs, LoraArgs, ModelArgs, OptimArgs, PairArgs, arg, check_common, config_dict, require,
)
from rlhfkit.data import collate_packed_pairs, collate_pairs, tokenize_pairs  # noqa: E402
from rlhfkit.data.tokenize import IGNORE_INDEX  # noqa: E402
from rlhfkit.ds_config import init_config  # noqa: E402
from rlhfkit.errors import ConfigError  # noqa: E402
from rlhfkit.metrics import MetricsLogger  # noqa: E402
from rlhfkit.models import additive_mask, attention_kernel_of, load_model, load_tokenizer  # noqa: E402
from rlhfkit.rollout.hf import GatheredCopy  # noqa: E402
from rlhfkit.training import (  # noqa: E402
    batch_plan, build_frozen_engine, count_steps, eval_batches, feature_length, fit, load_split, make_run_state, print_summary,
    run_main, start_program, to_device, train_loader, trainable_engine,
)

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOArgs:
    beta: float = arg(0.1, "DPO temperature beta: strength of the implicit KL to the reference (larger: stay closer).")
    label_smoothing: float = arg(
        0.0, "Conservative DPO (Mitchell 2023): assumed probability that a preference label is flipped, in [0, 0.5). "
             "sigmoid loss only.")
    loss_type: str = arg("sigmoid", "sigmoid (DPO) or ipo (IPO, Azar et al. 2023; on summed response log-probs).")
    offload_reference_model: bool = arg(
        False, "Keep the frozen reference's parameters in CPU memory (ZeRO-3 parameter offload; the reference runs "
               "ZeRO-3 even when --zero_stage is lower).")
    reference_on_copy: bool = arg(
        True, "Under ZeRO-3 the reference's forward passes run on a gathered, hook-free full-weight copy (one all-gather "
              "a forward instead of DeepSpeed's per-layer gathers and hooks); an offloaded reference keeps the engine path.")
    keep_reference_copy: bool = arg(
        False, "Keep that copy for the whole run (the reference is frozen: gathered once): faster, one full model more "
               "in memory per rank between the reference's forward passes.")


@dataclass
class DPOConfig(ModelArgs, DataArgs, OptimArgs, DeepSpeedArgs, LoraArgs, LogArgs, PairArgs, DPOArgs):
    """DPO flags: step 1's shared flags plus the DPO loss and the reference model."""

    def validate(self) -> None:
        require(self, "model_name_or_path", "data_path", "output_dir")
        check_common(self)
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"--loss_type {self.loss_type}: use {' or '.join(LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0 (got {self.beta})")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ConfigError("--label_smoothing applies to --loss_type sigmoid only")
        if self.keep_reference_copy and not self.reference_on_copy:
            raise ConfigError("--keep_reference_copy keeps the copy of --reference_on_copy: set that too (or drop it)")

    @property
    def reference_zero_stage(self) -> int:
        """The frozen reference is sharded (ZeRO-3) with the policy, or whenever it is offloaded."""
        return 3 if self.zero_stage == 3 or self.offload_reference_model else 0


def response_labels(batch: dict) -> torch.Tensor:
    """Labels [N, T] aligned with the logits of a right-padded batch: position t holds token t+1 when
    that token is a real response token (index >= prompt_len, not padding), else IGNORE_INDEX."""
    ids = batch["input_ids"]
    position = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    scored = (batch["attention_mask"] == 1) & (position >= batch["prompt_len"].unsqueeze(1))
    return at_predicting_column(torch.where(scored, ids, torch.full_like(ids, IGNORE_INDEX)), IGNORE_INDEX)


def at_predicting_column(x: torch.Tensor, fill) -> torch.Tensor:
    """``x`` [N, T] moved one column left (the logits at column t predict the token at t+1), ``fill`` at the end."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)


def sequence_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs of every row [2B] -> (chosen [B], rejected [B])."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logps = logprobs_from_logits(logits, response_labels(batch)).sum(-1)  # ignored labels give 0
    return logps.chunk(2)


def packed_sequence_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) summed response log-probs of a ``collate_packed_pairs`` batch (one
    row per pair: prompt, chosen, rejected), equal to :func:`sequence_logprobs` on the two rows.

    A token is predicted at the column before it, except the rejected response's first token: the
    prompt's last column predicts it (as in the rejected row on its own), besides the chosen one's.
    """
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=additive_mask(model, batch["pair_mask"]), position_ids=batch["position_ids"],
                   use_cache=False).logits
    rows, col = torch.arange(ids.shape[0], device=ids.device), torch.arange(ids.shape[1], device=ids.device)
    p, c_end = batch["prompt_len"], batch["chosen_end"] + 1  # the chosen response is [p, c_end)
    n = batch["attention_mask"].sum(-1)  # the rejected response is [c_end, n)
    chosen = (col >= p[:, None]) & (col < c_end[:, None])
    rejected_rest = (col > c_end[:, None]) & (col < n[:, None])
    targets = torch.where(chosen | rejected_rest, ids, torch.full_like(ids, IGNORE_INDEX))
    lp = logprobs_from_logits(logits, at_predicting_column(targets, IGNORE_INDEX))  # [B, T]
    first = torch.where(c_end < n, ids[rows, c_end.clamp(max=ids.shape[1] - 1)], IGNORE_INDEX)
    first_lp = logprobs_from_logits(logits[rows, p - 1], first)  # [B], 0 where the rejected side is empty
    return ((lp * at_predicting_column(chosen, False)).sum(-1),
            (lp * at_predicting_column(rejected_rest, False)).sum(-1) + first_lp)


def main() -> None:
    cfg = start_program(DPOConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "actor"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)

    # 2. Data: phase 2's share of each source (the reward model's share), as chosen/rejected pairs.
    train_set, eval_set, sources = load_split(cfg, phase=2, need="pairs", tokenize=tokenize_pairs, tokenizer=tokenizer)

    def collate(rows):
        return collate_pairs(rows, tokenizer.pad_token_id)

    def collate_train(rows):
        return (collate_packed_pairs if cfg.pack_pairs else collate_pairs)(rows, tokenizer.pad_token_id)

    # 3. The policy as a DeepSpeed training engine (LoRA optional).
    plan = batch_plan(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    loader = train_loader(train_set, collate_train, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "causal_lm", plan=plan, total_steps=total_steps, pad_token_id=tokenizer.pad_token_id,
                              row_len=2 * cfg.max_seq_len if cfg.pack_pairs else cfg.max_seq_len)
    load = dict(dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights,
                pad_token_id=tokenizer.pad_token_id)

    # 4. The reference: the same directory loaded again, frozen, as an inference engine in eval mode
    #    (sharded under ZeRO-3, parameters in CPU memory with --offload_reference_model), with the
    #    policy's attention kernel: in bf16 eager and SDPA round differently, and the implicit
    #    rewards beta * (log pi - log ref) must be exactly 0 while the policy is the reference.
    ref_stage = cfg.reference_zero_stage
    ref_model = load_model(cfg.model_name_or_path, "causal_lm", attn_implementation=attention_kernel_of(engine),
                           zero3_ds_config=init_config(zero_stage=ref_stage, dtype=cfg.dtype,
                                                       offload=cfg.offload_reference_model), **load)
    reference = build_frozen_engine(ref_model, zero_stage=ref_stage, dtype=cfg.dtype,
                                    offload=cfg.offload_reference_model, micro_batch=plan.micro_batch)
    # Its forward passes need no gradient: a sharded reference runs them on a gathered, hook-free copy,
    # gathered once with --keep_reference_copy.
    ref_copy = (GatheredCopy(reference, keep=cfg.keep_reference_copy, frozen=True)
                if cfg.reference_on_copy and ref_stage == 3 and not cfg.offload_reference_model else None)
    logger = MetricsLogger(os.path.join(cfg.output_dir, "logs"), cfg.enable_tensorboard, cfg.tensorboard_path, "dpo")
    dist.print_rank0(f"training {total_steps} steps, global batch {plan.global_batch} pairs "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation); "
                     f"reference ZeRO-{ref_stage}{', offloaded to CPU' if cfg.offload_reference_model else ''}"
                     f"{', its forwards on a gathered copy' if ref_copy else ''}{' (kept)' if ref_copy and ref_copy.keep else ''}")

    def dpo(batch, keep=None):
        """Policy forward (with grad), reference forward (no grad), DPO loss over this rank's pairs."""
        logprobs = packed_sequence_logprobs if "pair_mask" in batch else sequence_logprobs
        policy_chosen, policy_rejected = logprobs(engine, batch)
        with torch.no_grad():
            ref_chosen, ref_rejected = logprobs(reference, batch) if ref_copy is None else ref_copy.run(logprobs, batch)
        if keep is not None:  # evaluation: drop the padding pairs
            policy_chosen, policy_rejected, ref_chosen, ref_rejected = (
                t[keep] for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
        loss, chosen_rewards, rejected_rewards = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                                                          beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                                                          loss_type=cfg.loss_type)
        return loss, chosen_rewards, rejected_rewards, policy_chosen.detach(), policy_rejected.detach()

    # 5. The training loss: mean over the rank's pairs (equal pair counts on every rank, so DeepSpeed's
    #    gradient average over ranks is the global mean), with implicit rewards beta * (log pi - log ref).
    def compute_loss(batch):
        loss, chosen_r, rejected_r, logp_chosen, logp_rejected = dpo(batch)
        return loss, {"loss": loss.item(), "accuracy": (chosen_r > rejected_r).float().mean().item(),
                      "chosen_reward": chosen_r.mean().item(), "rejected_reward": rejected_r.mean().item(),
                      "margin": (chosen_r - rejected_r).mean().item(),
                      "logp_chosen": logp_chosen.mean().item(), "logp_rejected": logp_rejected.mean().item()}

    # 6. Evaluation on the held-out pairs: preference accuracy of the implicit reward (chosen > rejected),
    #    mean chosen / rejected rewards, their mean margin and the loss, summed over all ranks.
    @torch.no_grad()
    def evaluate():
        engine.eval()
        sums = torch.zeros(5, dtype=torch.float64)  # pairs, loss, correct, chosen reward, rejected reward
        for batch, weights in eval_batches(eval_set, collate, cfg.per_device_eval_batch_size):
            batch, keep = to_device(batch, engine.device), weights.bool().to(engine.device)
            loss, chosen_r, rejected_r, _, _ = dpo(batch, keep)
            n = int(keep.sum())
            if n:
                sums += torch.tensor([n, loss.item() * n, (chosen_r > rejected_r).sum().item(), chosen_r.sum().item(),
                                      rejected_r.sum().item()], dtype=torch.float64)
        total = dist.all_reduce_sum(sums.to(engine.device)).cpu()  # NCCL reduces device tensors only
        if total[0] == 0:
            return {}
        loss, correct, chosen, rejected = (total[1:] / total[0]).tolist()
        return {"loss": loss, "accuracy": correct, "chosen_reward": chosen, "rejected_reward": rejected,
                "margin": chosen - rejected, "pairs": int(total[0])}

    # 7. Train, then export the policy as an actor-type checkpoint directory.
    result = fit(engine, loader, compute_loss=compute_loss, evaluate=evaluate, total_steps=total_steps,
                 epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum, eval_interval=cfg.eval_interval,
                 log_interval=cfg.log_interval, logger=logger, program="dpo", progress_bar=cfg.progress_bar,
                 run_state=make_run_state(cfg, {"model": engine}), max_nonfinite_steps=cfg.max_nonfinite_steps,
                 sequences_per_row=2 if cfg.pack_pairs else 1)
    first, last = result.evals[0], result.evals[-1]
    metrics = {f"eval_{k}_{when}": ev[k] for when, ev in (("before", first), ("after", last))
               for k in ("accuracy", "margin", "chosen_reward", "rejected_reward", "loss") if k in ev}
    metrics.update(steps=result.steps, train_pairs=result.samples // 2, train_tokens=result.tokens,
                   seconds=result.seconds, beta=cfg.beta, loss_type=cfg.loss_type)
    manifest = build_manifest(stage="dpo", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=metrics, zero_stage=cfg.zero_stage, dtype=cfg.dtype)
    export_model(engine, tokenizer, cfg.output_dir, manifest,
                 generation={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                             "bos_token_id": tokenizer.bos_token_id})
    logger.close()
    held_out = (f"accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}, margin {first['margin']:.4f} -> "
                f"{last['margin']:.4f}, loss {first['loss']:.4f} -> {last['loss']:.4f} ({last['pairs']} pairs)"
                if "accuracy" in first and "accuracy" in last else "no held-out pairs (--eval_fraction 0)")
    print_summary("step 2 (DPO) done", {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s",
        "throughput": f"{result.samples / 2 / max(result.seconds, 1e-9):.2f} pairs/s, {result.tokens / max(result.seconds, 1e-9):.0f} tokens/s",
        "eval (held out)": held_out,
        "checkpoint": os.path.abspath(cfg.output_dir),
        "metrics": os.path.join(os.path.abspath(cfg.output_dir), "logs", "metrics.jsonl"),
    })


if __name__ == "__main__":
    run_main(main)
