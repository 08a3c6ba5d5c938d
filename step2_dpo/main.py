"""Step 2 (alternative to reward model + PPO): Direct Preference Optimization from preference pairs.

    deepspeed --num_gpus 2 step2_dpo/main.py --model_name_or_path SFT --data_path DATA \
        --zero_stage 3 --beta 0.1 --output_dir out/step2_dpo

The policy starts from --model_name_or_path (the step-1 model) and the same directory, loaded a
second time and frozen, is the reference. Each pair is one row in training (--pack_pairs: the prompt
once, then the chosen and the rejected response, each attending to the prompt and itself); evaluation
runs chosen rows then rejected rows ([2B, T]). One forward per model scores both sides.
Loss (Rafailov et al. 2023; IPO, Azar et al. 2023; SimPO, Meng et al. 2024):
    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
    sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)      ipo: (h - 1 / (2 beta))^2
    simpo:   -log sigmoid(beta / |y_w| log pi(y_w|x) - beta / |y_l| log pi(y_l|x) - gamma)   (no reference)
    kto:     unpaired completions (Ethayarajh et al. 2024; see rlhfkit.algos.kto_loss), a pair giving one
             desirable and one undesirable; z0 from mismatched (prompt, completion) rows of the batch
with log pi(y|x) the sum of the response tokens' log-probs. Writes a 'dpo' checkpoint directory
(an actor: it loads with AutoModelForCausalLM).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import dpo_loss, kto_loss, simpo_loss  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, export_model  # noqa: E402
from rlhfkit.config import config_dict  # noqa: E402
from rlhfkit.data import collate_kto, collate_packed_pairs, collate_pairs, tokenize_kto, tokenize_pairs  # noqa: E402
from rlhfkit.ds_config import init_config  # noqa: E402
from rlhfkit.engines import batch_plan, build_frozen_engine, count_steps, trainable_engine  # noqa: E402
from rlhfkit.loaders import eval_batches, feature_length, to_device, train_loader  # noqa: E402
from rlhfkit.models import attention_kernel_of, load_model, load_tokenizer, pair_logprobs, pair_response_lengths  # noqa: E402
from rlhfkit.models.gathered import GatheredCopy  # noqa: E402
from rlhfkit.resume_reshard import resume_layout, with_layout  # noqa: E402
from rlhfkit.program import load_split, make_logger, make_run_state, print_summary, run_main, start_program  # noqa: E402
from rlhfkit.supervised import LoopResult, fit  # noqa: E402
from step2_dpo.config import LOSS_TYPES, DPOArgs, DPOConfig  # noqa: E402, F401 - DPOArgs, LOSS_TYPES: their former home

EVAL_KEYS = ("accuracy", "margin", "chosen_reward", "rejected_reward", "loss")  # compared before and after training


class Reference:
    """The frozen reference: the policy's starting directory loaded again as an inference engine in
    eval mode (sharded under ZeRO-3, parameters in CPU memory with --offload_reference_model), with
    the policy's attention kernel: in bf16 eager and SDPA round differently, and the implicit rewards
    beta * (log pi - log ref) must be exactly 0 while the policy is the reference.

    Its forward passes need no gradient: a sharded reference runs them on a gathered, hook-free copy
    (:class:`GatheredCopy`), gathered once with --keep_reference_copy.
    """

    def __init__(self, cfg: DPOConfig, policy: Any, pad_token_id: int, micro_batch: int):
        stage = cfg.reference_zero_stage
        model = load_model(cfg.model_name_or_path, "causal_lm", attn_implementation=attention_kernel_of(policy),
                           zero3_ds_config=init_config(zero_stage=stage, dtype=cfg.dtype, offload=cfg.offload_reference_model),
                           dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights,
                           pad_token_id=pad_token_id)
        self.engine = build_frozen_engine(model, zero_stage=stage, dtype=cfg.dtype, offload=cfg.offload_reference_model,
                                          micro_batch=micro_batch)
        self.copy = (GatheredCopy(self.engine, keep=cfg.keep_reference_copy, frozen=True)
                     if cfg.reference_on_gathered_copy else None)
        self.description = (f"reference ZeRO-{stage}{', offloaded to CPU' if cfg.offload_reference_model else ''}"
                            f"{', its forwards on a gathered copy' if self.copy else ''}"
                            f"{' (kept)' if self.copy and self.copy.keep else ''}")

    @torch.no_grad()
    def logprobs(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B]) summed response log-probs under the reference."""
        return pair_logprobs(self.engine, batch) if self.copy is None else self.copy.run(pair_logprobs, batch)


class DPOObjective:
    """The DPO loss of the policy against the reference over this rank's pairs, with the implicit
    rewards beta * (log pi - log ref): the training loss and the held-out evaluation."""

    def __init__(self, policy: Any, reference: Optional[Reference], cfg: DPOConfig, loss_type: Optional[str] = None):
        self.policy, self.reference = policy, reference
        self.beta, self.label_smoothing, self.gamma = cfg.beta, cfg.label_smoothing, cfg.simpo_gamma
        self.loss_type = loss_type or cfg.loss_type

    def __call__(self, batch: dict, keep: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """Policy forward (with grad), reference forward (no grad; none for SimPO), the loss over the pairs
        ``keep`` selects (all by default) -> (loss, chosen rewards, rejected rewards, policy log-probs of both)."""
        policy = pair_logprobs(self.policy, batch)
        if self.loss_type == "simpo":  # reference-free: the response lengths take the reference's place
            others = pair_response_lengths(batch)
        else:
            others = self.reference.logprobs(batch)
        if keep is not None:  # evaluation: drop the padding pairs
            policy, others = tuple(t[keep] for t in policy), tuple(t[keep] for t in others)
        if self.loss_type == "simpo":
            loss, chosen_rewards, rejected_rewards = simpo_loss(*policy, *others, beta=self.beta, gamma=self.gamma)
        else:
            loss, chosen_rewards, rejected_rewards = dpo_loss(*policy, *others, beta=self.beta,
                                                              label_smoothing=self.label_smoothing, loss_type=self.loss_type)
        return loss, chosen_rewards, rejected_rewards, policy[0].detach(), policy[1].detach()

    def train_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The training loss: the mean over the rank's pairs (equal pair counts on every rank, so
        DeepSpeed's gradient average over ranks is the global mean), and its statistics."""
        loss, chosen_r, rejected_r, logp_chosen, logp_rejected = self(batch)
        return loss, {"loss": loss.item(), "accuracy": (chosen_r > rejected_r).float().mean().item(),
                      "chosen_reward": chosen_r.mean().item(), "rejected_reward": rejected_r.mean().item(),
                      "margin": (chosen_r - rejected_r).mean().item(),
                      "logp_chosen": logp_chosen.mean().item(), "logp_rejected": logp_rejected.mean().item()}

    @torch.no_grad()
    def evaluate(self, eval_set: list, collate: Any, batch_size: int) -> dict:
        """Held-out pairs: preference accuracy of the implicit reward (chosen > rejected), mean chosen /
        rejected rewards, their mean margin and the loss, summed over all ranks."""
        self.policy.eval()
        sums = torch.zeros(5, dtype=torch.float64)  # pairs, loss, correct, chosen reward, rejected reward
        for batch, weights in eval_batches(eval_set, collate, batch_size):
            batch, keep = to_device(batch, self.policy.device), weights.bool().to(self.policy.device)
            loss, chosen_r, rejected_r, _, _ = self(batch, keep)
            n = int(keep.sum())
            if n:
                sums += torch.tensor([n, loss.item() * n, (chosen_r > rejected_r).sum().item(), chosen_r.sum().item(),
                                      rejected_r.sum().item()], dtype=torch.float64)
        total = dist.all_reduce_sum(sums.to(self.policy.device)).cpu()  # NCCL reduces device tensors only
        if total[0] == 0:
            return {}
        loss, correct, chosen, rejected = (total[1:] / total[0]).tolist()
        return {"loss": loss, "accuracy": correct, "chosen_reward": chosen, "rejected_reward": rejected,
                "margin": chosen - rejected, "pairs": int(total[0])}


class KTOObjective:
    """KTO's loss over this rank's completions (:func:`rlhfkit.data.collate_kto` batches: each completion,
    then a mismatched one), its reference point z0 the mean log-ratio of the mismatched rows of all ranks.
    Held out, it is judged as DPO is, on pairs: the implicit rewards beta (log pi - log ref) of the chosen
    and the rejected answer (labelled rows are not evaluated)."""

    def __init__(self, policy: Any, reference: Reference, cfg: DPOConfig):
        self.policy, self.reference, self.cfg = policy, reference, cfg
        self.pairs = DPOObjective(policy, reference, cfg, loss_type="sigmoid")  # the held-out pairs' rewards

    def train_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        policy, policy_kl = pair_logprobs(self.policy, batch)  # [B] own completions, [B] mismatched
        ref, ref_kl = self.reference.logprobs(batch)
        w = batch["kl_weight"].to(policy.device)
        sums = dist.all_reduce_sum(torch.stack([((policy_kl.detach().float() - ref_kl.float()) * w).sum(), w.sum()]))
        kl = (sums[0] / sums[1]).item() if sums[1] > 0 else 0.0
        good = batch["desirable"].to(policy.device)
        loss, rewards = kto_loss(policy, ref, good, kl, self.cfg.beta, self.cfg.kto_lambda_d, self.cfg.kto_lambda_u)
        n_good, n_bad = good.sum().clamp_min(1), (~good).sum().clamp_min(1)
        return loss, {"loss": loss.item(), "kl": kl, "z0": max(kl, 0.0), "desirable_frac": good.float().mean().item(),
                      "desirable_reward": ((rewards * good).sum() / n_good).item(),
                      "undesirable_reward": ((rewards * ~good).sum() / n_bad).item()}

    def evaluate(self, eval_set: list, collate: Any, batch_size: int) -> dict:
        out = self.pairs.evaluate(eval_set, collate, batch_size)
        out.pop("loss", None)  # DPO's loss is not KTO's
        return out


def run_metrics(result: LoopResult, cfg: DPOConfig) -> dict:
    """The manifest's metrics: held-out evaluation before and after training, and the run's size."""
    first, last = result.evals[0], result.evals[-1]
    metrics = {f"eval_{k}_{when}": ev[k] for when, ev in (("before", first), ("after", last)) for k in EVAL_KEYS if k in ev}
    metrics.update(steps=result.steps, train_tokens=result.tokens,
                   **{"train_completions" if cfg.loss_type == "kto" else "train_pairs": result.samples // 2},
                   seconds=result.seconds, beta=cfg.beta, loss_type=cfg.loss_type)
    return metrics


def summary(result: LoopResult, output_dir: str) -> dict:
    """The end-of-run summary lines."""
    first, last = result.evals[0], result.evals[-1]
    loss = f", loss {first['loss']:.4f} -> {last['loss']:.4f}" if "loss" in first and "loss" in last else ""
    held_out = (f"accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}, margin {first['margin']:.4f} -> "
                f"{last['margin']:.4f}{loss} ({last['pairs']} pairs)"
                if "accuracy" in first and "accuracy" in last else "no held-out pairs (--eval_fraction 0)")
    seconds = max(result.seconds, 1e-9)
    return {
        "steps": result.steps,
        "time": f"{result.seconds:.1f} s",
        "throughput": f"{result.samples / 2 / seconds:.2f} pairs/s, {result.tokens / seconds:.0f} tokens/s",
        "eval (held out)": held_out,
        "checkpoint": os.path.abspath(output_dir),
        "metrics": os.path.join(os.path.abspath(output_dir), "logs", "metrics.jsonl"),
    }


def main() -> None:
    cfg = start_program(DPOConfig)

    # 1. Check the input model and the output directory before loading anything big.
    check_model_dir(cfg.model_name_or_path, expect=("base", "sft", "dpo", "actor"), role="--model_name_or_path")
    check_output_dir(cfg.output_dir)
    tokenizer = load_tokenizer(cfg.model_name_or_path, cfg.trust_remote_code)
    pad = tokenizer.pad_token_id

    # 2. Data: phase 2's share of each source (the reward model's share), as chosen/rejected pairs;
    #    training packs each pair into one row with --pack_pairs, evaluation runs the two rows apart.
    #    KTO trains on completions (a pair gives two), each with a mismatched one; it is evaluated on pairs.
    kto = cfg.loss_type == "kto"
    train_set, eval_set, sources = load_split(cfg, phase=2, need="labelled" if kto else "pairs", tokenizer=tokenizer,
                                              tokenize=tokenize_kto if kto else tokenize_pairs, tokenize_eval=tokenize_pairs)
    train_collate = functools.partial(collate_kto if kto else collate_packed_pairs if cfg.pack_pairs else collate_pairs,
                                      pad_token_id=pad)
    eval_collate = functools.partial(collate_pairs, pad_token_id=pad)

    # 3. The policy as a DeepSpeed training engine (LoRA optional).
    layout = resume_layout(cfg)  # the saved run's batch layout when --resume continues one
    plan = batch_plan(layout.micro_batch, layout.grad_accum)
    loader = train_loader(train_set, train_collate, plan.micro_batch, cfg.seed,
                          lengths=[feature_length(f) for f in train_set] if cfg.group_by_length else None,
                          order_batch=layout.order_batch)
    total_steps = count_steps(len(loader), plan.grad_accum, cfg.num_train_epochs, cfg.max_steps)
    engine = trainable_engine(cfg, "causal_lm", plan=plan, total_steps=total_steps, pad_token_id=pad,
                              row_len=2 * cfg.max_seq_len if cfg.pack_pairs and not kto else cfg.max_seq_len)

    # 4. The reference: the same directory loaded again, frozen (see Reference); SimPO has none.
    reference = Reference(cfg, engine, pad, plan.micro_batch) if cfg.uses_reference else None
    logger = make_logger(cfg, "dpo")
    dist.print_rank0(f"training {total_steps} steps, global batch {plan.global_batch} pairs "
                     f"({plan.micro_batch} x {plan.world_size} ranks x {plan.grad_accum} accumulation); "
                     f"{reference.description if reference else 'no reference model (' + cfg.loss_type + ')'}")

    # 5. Train on the DPO loss, evaluating on the held-out pairs before, every --eval_interval steps and after.
    dpo = KTOObjective(engine, reference, cfg) if kto else DPOObjective(engine, reference, cfg)
    result = fit(engine, loader, compute_loss=dpo.train_loss,
                 evaluate=functools.partial(dpo.evaluate, eval_set, eval_collate, cfg.per_device_eval_batch_size),
                 total_steps=total_steps, epochs=cfg.num_train_epochs, grad_accum=plan.grad_accum,
                 eval_interval=cfg.eval_interval, log_interval=cfg.log_interval, logger=logger, program="dpo",
                 progress_bar=cfg.progress_bar, run_state=with_layout(make_run_state(cfg, {"model": engine}, logger), layout),
                 max_nonfinite_steps=cfg.max_nonfinite_steps, sequences_per_row=2 if cfg.pack_pairs and not kto else 1)

    # 6. Export the policy as an actor-type checkpoint directory.
    manifest = build_manifest(stage="dpo", config=config_dict(cfg), tokenizer=tokenizer, parent=cfg.model_name_or_path,
                              data=sources, metrics=run_metrics(result, cfg), zero_stage=cfg.zero_stage, dtype=cfg.dtype)
    export_model(engine, tokenizer, cfg.output_dir, manifest,
                 generation={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad,
                             "bos_token_id": tokenizer.bos_token_id})
    logger.close()
    print_summary("step 2 (DPO) done", summary(result, cfg.output_dir))


if __name__ == "__main__":
    run_main(main)
