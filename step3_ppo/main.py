"""Step 3: PPO (and GRPO, DAPO, RLOO, REINFORCE++) with ZeRO-3 and the hybrid rollout engine.

    deepspeed --num_gpus 2 step3_ppo/main.py --actor_model_name_or_path out/step1 \
        --critic_model_name_or_path out/step2 --data_path DATA --actor_zero_stage 3 --critic_zero_stage 3 \
        --output_dir out/step3

Each step: rollout (generate, then the no-grad passes: the actor's and the reference's logprobs, the
critic's values, the rewards) -> advantages -> ppo_epochs of mini-batch updates of actor and critic
-> metrics. Writes actor/ and critic/ (and actor_ema/).
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from tqdm import tqdm  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, check_same_tokenizer, export_model  # noqa: E402
from rlhfkit.config import config_dict  # noqa: E402
from rlhfkit.data import collate_prompts, collate_sft, load_phase_data, load_ptx_rows, tokenize_prompts, tokenize_sft, with_prompt_suffix  # noqa: E402
from rlhfkit.metrics import MetricsLogger  # noqa: E402
from rlhfkit.models import load_tokenizer  # noqa: E402
from rlhfkit.ppo import ExperienceMaker, HeldOutEval, Trainables, UpdateSettings, add_advantages, build_models, part_means  # noqa: E402
from rlhfkit.ppo import step_metrics, train_on  # noqa: E402
from rlhfkit.ppo.evaluate import PROMPT_PARTS, PROMPT_REWARDS, paired_gain, part_change_line  # noqa: E402
from rlhfkit.ppo.progress import Progress, kl_controller, update_kl_controller  # noqa: E402
from rlhfkit.ppo.reshard import resume_layout  # noqa: E402
from rlhfkit.rewards import RewardFunctions  # noqa: E402
from rlhfkit.rollout import check_backend  # noqa: E402
from rlhfkit.loaders import BatchStream, train_loader  # noqa: E402
from rlhfkit.params import ParamEMA  # noqa: E402
from rlhfkit.program import make_logger, make_run_state, print_summary, run_main, start_program  # noqa: E402
from rlhfkit.supervised import NonFiniteGuard  # noqa: E402
from step3_ppo.config import Step3Config  # noqa: E402


@dataclass
class Prompts:
    train_rows: list  # step 3's share of the data (Examples), for the reward functions' rows
    eval_rows: list  # the held-out share
    train: list  # tokenised training prompts {"prompt_ids", "index"}
    eval: list  # tokenised held-out prompts
    sources: list  # what was read from each data source (for the manifest)


def check_inputs(cfg: Step3Config):
    """Every checkpoint (stage, completeness, one tokenizer) and the output directory; the tokenizer."""
    actor_manifest = check_model_dir(cfg.actor_model_name_or_path, ("sft", "base", "dpo", "actor"), "--actor_model_name_or_path")
    tokenizer = load_tokenizer(cfg.actor_model_name_or_path, cfg.trust_remote_code, padding_side="left")
    for path, role in ((cfg.reward_path, "--reward_model_name_or_path"), (cfg.critic_path, "--critic_model_name_or_path"),
                       *((judge, "--judge") for judge in cfg.judge)):
        if path:
            manifest = check_model_dir(path, ("reward", "critic"), role)
            check_same_tokenizer(cfg.actor_model_name_or_path, actor_manifest, path, manifest, tokenizer,
                                 load_tokenizer(path, cfg.trust_remote_code))
    check_output_dir(cfg.output_dir)
    return tokenizer


def load_prompts(cfg: Step3Config, tokenizer) -> Prompts:
    """Step 3's share of each source, chat-templated, left-truncated at a turn boundary."""
    train_rows, eval_rows, sources = load_phase_data(cfg.data_path, phase=3, need="prompts", data_split=cfg.data_split,
                                                     seed=cfg.seed, eval_fraction=cfg.eval_fraction, strict=cfg.strict,
                                                     max_eval=cfg.max_eval_samples, max_per_prompt=cfg.max_per_prompt)
    if cfg.prompt_suffix:
        train_rows, eval_rows = with_prompt_suffix(train_rows, cfg.prompt_suffix), with_prompt_suffix(eval_rows, cfg.prompt_suffix)
    train, report = tokenize_prompts(train_rows, tokenizer, cfg.max_prompt_seq_len)
    held_out, _ = tokenize_prompts(eval_rows, tokenizer, cfg.max_prompt_seq_len)
    for s in sources:
        dist.print_rank0(s.summary())
    dist.print_rank0(f"prompts: {report.summary()}; held-out prompts: {len(held_out)}")
    return Prompts(train_rows, eval_rows, train, held_out, sources)


def ptx_batches(cfg: Step3Config, tokenizer) -> BatchStream | None:
    """PTX: SFT batches of ``--unsupervised_dataset_name``, one per update, or None."""
    if not cfg.unsupervised_dataset_name:
        return None
    rows = load_ptx_rows(cfg.unsupervised_dataset_name, seed=cfg.seed, strict=cfg.strict)
    features, _ = tokenize_sft(rows, tokenizer, cfg.max_prompt_seq_len + cfg.max_answer_seq_len)
    collate = functools.partial(collate_sft, pad_token_id=tokenizer.pad_token_id)
    return BatchStream(train_loader(features, collate, cfg.per_device_training_batch_size, cfg.seed))


def print_sample(exp, tokenizer, write) -> None:
    """The first prompt, its response and reward of a batch (--print_answers)."""
    P = exp.prompt_len
    write(f"--- prompt: {tokenizer.decode(exp.sequences[0, :P], skip_special_tokens=True)[-300:]!r}\n"
          f"--- answer: {tokenizer.decode(exp.sequences[0, P:], skip_special_tokens=True)!r}\n"
          f"--- reward: {exp.raw_scores[0].item():.4f} truncated={bool(exp.truncated[0])}")


def export(cfg: Step3Config, trained: Trainables, tokenizer, sources: list, final: dict) -> dict:
    """Write actor/ and critic/ (and actor_ema/), each a checkpoint directory; returns their paths."""
    common = dict(config=config_dict(cfg), tokenizer=tokenizer, data=sources, metrics=final, dtype=cfg.dtype)
    out = os.path.abspath(cfg.output_dir)
    actor = dict(stage="actor", parent=cfg.actor_model_name_or_path, zero_stage=cfg.actor_zero_stage, **common)
    gen_cfg = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    paths = {"actor": os.path.join(out, "actor")}
    export_model(trained.actor, tokenizer, paths["actor"], build_manifest(**actor), generation=gen_cfg)
    if trained.critic is not None:
        paths["critic"] = os.path.join(out, "critic")
        export_model(trained.critic, tokenizer, paths["critic"],
                     build_manifest(stage="critic", parent=cfg.critic_path, zero_stage=cfg.critic_zero_stage, **common))
    if trained.ema is not None:
        with trained.ema.swapped():
            export_model(trained.actor, tokenizer, os.path.join(out, "actor_ema"),
                         build_manifest(**actor, extra={"ema_beta": cfg.ema_beta}), generation=gen_cfg)
    return paths


def summary(cfg: Step3Config, progress: Progress, seconds: float, paths: dict) -> dict:
    """The end-of-run lines: where the models are, and how the held-out reward moved."""
    lines = {"steps": progress.step, "time": f"{seconds:.1f} s ({progress.samples / max(seconds, 1e-9):.2f} samples/s)", **paths}
    if progress.evals:
        b, a = progress.evals[0], progress.evals[-1]
        lines["held-out reward"] = (f"step-1 model {b['reward']:.4f} -> actor {a['reward']:.4f} "
                                    f"({a['reward'] - b['reward']:+.4f}; {a['prompts']} prompts x "
                                    f"{a['samples'] // max(a['prompts'], 1)} {'greedy' if cfg.eval_greedy else 'sampled'})")
        gain = paired_gain(b, a)
        if gain["n"] >= 2:
            verdict = "above" if gain["ci_low"] > 0 else "below" if gain["ci_high"] < 0 else "no change from"
            lines["held-out gain"] = (f"{gain['mean']:+.4f}, 95% CI [{gain['ci_low']:+.4f}, {gain['ci_high']:+.4f}] paired over "
                                      f"{gain['n']} prompts: the actor is {verdict} the step-1 model")
        for part in b.get(PROMPT_PARTS, {}):  # reward components (gsm8k: accuracy, format), each with its own change
            if part.endswith("/weighted"):
                continue
            lines[f"held-out {part}"] = part_change_line(b, a, part)
        lines["held-out length"] = (f"{b['response_len']:.1f} -> {a['response_len']:.1f} tokens per response, truncated "
                                    f"{b['truncated_rate']:.0%} -> {a['truncated_rate']:.0%}, empty "
                                    f"{b.get('empty_rate', 0):.0%} -> {a.get('empty_rate', 0):.0%}")
        lines["KL to step-1 model"] = f"{a['kl_per_token']:.4f} nats per token (k3), {a['kl_per_seq']:.3f} per sequence"
    out = os.path.abspath(cfg.output_dir)
    lines["metrics"] = os.path.join(out, "logs", "metrics.jsonl")
    lines["next"] = f"rlhfkit chat --model {paths['actor']}   |   rlhfkit report {os.path.dirname(out)}"
    return lines


def evaluate_at(step: int, evaluate: HeldOutEval, progress: Progress, logger: MetricsLogger, write=None) -> None:
    """The held-out evaluation at ``step``: kept in ``progress.evals`` and logged under eval/."""
    progress.evals.append({"step": step, **evaluate()})
    logger.log(step, {f"eval/{k}": v for k, v in progress.evals[-1].items() if k not in ("step", PROMPT_REWARDS, PROMPT_PARTS)}, write=write)


def final_metrics(progress: Progress, total_steps: int, seconds: float, fingerprints: dict) -> dict:
    """The manifest's metrics: run length, and the held-out reward before and after."""
    evals = progress.evals
    gain = paired_gain(evals[0], evals[-1]) if evals else {}
    return {"steps": total_steps, "seconds": seconds, "samples": progress.samples, "frozen_fingerprints": fingerprints,
            **({"eval_reward_before": evals[0]["reward"], "eval_reward_after": evals[-1]["reward"],
                "eval_reward_gain": gain["mean"], "eval_reward_gain_ci": [gain["ci_low"], gain["ci_high"]],
                "eval_prompts": evals[-1]["prompts"], "eval_kl_per_token_after": evals[-1]["kl_per_token"],
                "eval_response_len_before": evals[0]["response_len"], "eval_response_len_after": evals[-1]["response_len"],
                "eval_kl_per_seq_after": evals[-1]["kl_per_seq"], "eval_empty_rate_before": evals[0].get("empty_rate", 0.0),
                "eval_empty_rate_after": evals[-1].get("empty_rate", 0.0), **part_metrics(evals[0], evals[-1])} if evals else {})}


def part_metrics(before: dict, after: dict) -> dict:
    """Each reward component's held-out mean before and after, and its paired change with the 95% interval."""
    out = {}
    for part in before.get(PROMPT_PARTS, {}):
        g = paired_gain(before, after, part)
        out.update({f"eval_{part}_before": before[part], f"eval_{part}_after": after[part],
                    f"eval_{part}_change": g["mean"], f"eval_{part}_change_ci": [g["ci_low"], g["ci_high"]]})
    return out


def run_description(cfg: Step3Config, total_steps: int, has_critic: bool) -> str:
    """The run's one-line shape, printed before training."""
    warm_up = f", critic warm-up {cfg.freezing_actor_steps} steps" if cfg.freezing_actor_steps else ""
    return (f"{cfg.algo}: {total_steps} steps x {cfg.samples_per_rank} samples/rank "
            f"({cfg.per_device_generation_batch_size} prompts x {cfg.generation_batches} x {cfg.n_samples_per_prompt}), "
            f"{cfg.updates_per_step} updates/step{', groups packed' if cfg.packed_group_size > 1 else ''}, "
            f"rollout backend {cfg.backend}, critic {'yes' if has_critic else 'no'}{warm_up}")


def main() -> None:
    cfg = start_program(Step3Config)
    check_backend(cfg.backend)
    flags = config_dict(cfg)  # as given: what a later resume compares its flags with
    layout = resume_layout(cfg)  # the per-rank batches: the saved run's when --resume continues one, on any rank count
    layout.apply(cfg)

    # 1. Inputs: checkpoints, reward function, prompts (and PTX data).
    tokenizer = check_inputs(cfg)
    reward_fns = RewardFunctions.load(cfg.reward_fn, cfg.reward_fn_weight, cfg.normalize_reward_fns,
                                      urls=cfg.reward_url, url_timeout=cfg.reward_url_timeout, url_retries=cfg.reward_url_retries)
    prompts = load_prompts(cfg, tokenizer)
    loader = train_loader(prompts.train, functools.partial(collate_prompts, pad_token_id=tokenizer.pad_token_id),
                          cfg.per_device_generation_batch_size, cfg.seed,
                          lengths=[len(f["prompt_ids"]) for f in prompts.train] if cfg.group_by_length else None)
    total_steps = cfg.total_steps(len(loader))

    # 2. The four models (actor + reference, critic + reward model; no critic for the GRPO family).
    models = build_models(cfg, actor_path=cfg.actor_model_name_or_path, critic_path=cfg.critic_path, reward_path=cfg.reward_path,
                          pad_id=tokenizer.pad_token_id, total_updates=total_steps * cfg.updates_per_step)
    trained = Trainables(models.actor, models.critic, ParamEMA(models.actor.module, cfg.ema_beta) if cfg.enable_ema else None)
    maker = ExperienceMaker(cfg, models, tokenizer, reward_fns)
    evaluate = HeldOutEval(maker, prompts.eval, prompts.eval_rows, cfg.per_device_generation_batch_size)
    settings, kl_ctl = UpdateSettings.from_config(cfg), kl_controller(cfg)
    logger = make_logger(cfg, cfg.algo)
    dist.print_rank0(run_description(cfg, total_steps, models.critic is not None))

    # 3. Resume, or evaluate the step-1 model (the baseline).
    fingerprints = models.frozen_fingerprints()
    run_state = layout.attach(make_run_state(cfg, models.trained(), logger), flags)
    progress = Progress(prompts=BatchStream(loader), ptx=ptx_batches(cfg, tokenizer))
    restored = run_state.restore()
    if restored:
        progress.restore(layout.resharded(restored, trained.ema), kl_ctl, trained.ema, maker.reward_norm, maker.reward_fns)
    elif len(evaluate):
        evaluate_at(0, evaluate, progress, logger)
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, functools.partial(operator.attrgetter("last_saved"), run_state))
    bar = tqdm(total=total_steps, initial=progress.step, desc=cfg.algo, disable=not (cfg.progress_bar and dist.is_main()),
               file=sys.stdout)

    # 4. The loop: rollout -> advantages -> ppo_epochs of updates -> log -> save.
    t_start = time.time()
    for step in range(progress.step + 1, total_steps + 1):
        t0 = time.time()
        collected = maker.collect(progress.prompts, prompts.train_rows)
        if len(collected.exp) == 0:  # dynamic sampling found no informative group on some rank within max rounds
            logger.log(step, {"sampling/rounds": collected.rounds, "sampling/skipped_step": 1,
                              **{f"reward/{k}": v for k, v in part_means(collected.reward_parts).items()}}, write=bar.write)
            bar.update(1)
            continue
        add_advantages(collected.exp, cfg.spec, cfg, kl_ctl.value)
        t1 = time.time()
        train_stats = train_on(trained, collected.exp, settings, kl_coef=kl_ctl.value, packed_group_size=cfg.packed_group_size,
                               single_update=cfg.old_logprobs_from_training, ptx_iter=progress.ptx, guard=guard.ok,
                               train_actor=step > cfg.freezing_actor_steps)
        t_train = time.time() - t1
        if cfg.target_kl:
            update_kl_controller(kl_ctl, collected.exp)
        metrics, n_samples, n_tokens = step_metrics(collected, train_stats, step_s=time.time() - t0, training_s=t_train,
                                                    kl_coef=kl_ctl.value, nonfinite_skipped=guard.total)
        progress.step, progress.samples, progress.tokens = step, progress.samples + n_samples, progress.tokens + n_tokens
        if step % cfg.log_interval == 0 or step == total_steps:
            logger.log(step, metrics, write=bar.write)
        if cfg.print_answers and step % cfg.print_answers_interval == 0 and dist.is_main():
            print_sample(collected.exp, tokenizer, bar.write)
        if len(evaluate) and cfg.eval_interval and step % cfg.eval_interval == 0 and step < total_steps:
            evaluate_at(step, evaluate, progress, logger, write=bar.write)
        progress.checkpoint(run_state, kl_ctl, trained.ema, maker.reward_norm, maker.reward_fns)
        bar.update(1)
    bar.close()
    seconds = time.time() - t_start
    if len(evaluate):
        evaluate_at(total_steps, evaluate, progress, logger)

    # 5. Export actor/ and critic/ (and actor_ema/), each a checkpoint directory.
    if models.frozen_fingerprints() != fingerprints:  # a frozen model was updated: a bug, never a result to keep
        raise RuntimeError(f"frozen model weights changed during training: {fingerprints} -> {models.frozen_fingerprints()}")
    paths = export(cfg, trained, tokenizer, prompts.sources, final_metrics(progress, total_steps, seconds, fingerprints))
    logger.close()
    progress.step = total_steps
    print_summary(f"step 3 ({cfg.algo}) done", summary(cfg, progress, seconds, paths))


if __name__ == "__main__":
    run_main(main)
