"""Step 3: PPO (and GRPO, DAPO, RLOO, REINFORCE++) with ZeRO-3 and the hybrid rollout engine.

    deepspeed --num_gpus 2 step3_ppo/main.py --actor_model_name_or_path out/step1 \
        --critic_model_name_or_path out/step2 --data_path DATA --actor_zero_stage 3 --critic_zero_stage 3 \
        --output_dir out/step3

Each step: rollout (generate) -> experience (four forward passes, rewards, advantages) -> ppo_epochs of
mini-batch updates of actor and critic -> metrics. Writes actor/ and critic/ (and actor_ema/).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

import torch  # noqa: E402

from rlhfkit import distributed as dist  # noqa: E402
from rlhfkit.algos import (  # noqa: E402
    AdaptiveKLController, FixedKLController, clipped_value_loss, kl_estimate, kl_loss, masked_mean, masked_sum, overlong_penalty,
    ppo_policy_loss, sft_loss,
)
from rlhfkit.checkpoint import build_manifest, check_model_dir, check_output_dir, check_same_tokenizer, export_model  # noqa: E402
from rlhfkit.config import config_dict, parse_config  # noqa: E402
from rlhfkit.data import (  # noqa: E402
    collate_prompts, collate_sft, load_phase_data, tokenize_prompts, tokenize_sft, with_prompt_suffix,
)
from rlhfkit.ds_config import init_config  # noqa: E402
from rlhfkit.errors import ConfigError  # noqa: E402
from rlhfkit.experience import Experience, actor_forward, critic_forward, packs_groups  # noqa: E402
from rlhfkit.metrics import MetricsLogger  # noqa: E402
from rlhfkit.models import apply_lora, enable_gradient_checkpointing, load_model, load_tokenizer, sequence_scores  # noqa: E402
from rlhfkit.rewards import call_reward_fn, load_reward_fn  # noqa: E402
from rlhfkit.rl import ALGOS, compute_advantages  # noqa: E402
from rlhfkit.rollout import GenerationConfig, PromptBatch, make_rollout_engine  # noqa: E402
from rlhfkit.rollout.hf import GatheredCopy  # noqa: E402
from rlhfkit.training import (  # noqa: E402
    BatchStream, NonFiniteGuard, ParamEMA, batch_plan, crash_point, build_engine, build_frozen_engine, eval_batches, make_run_state,
    param_fingerprint, peak_rss_gb, print_summary, run_main, silence_libraries, to_device, train_loader,
)
from step3_ppo.config import Step3Config  # noqa: E402


def attention_kernel(cfg) -> str | None:
    return None if cfg.attn_implementation == "auto" else cfg.attn_implementation


def load_trained(path, kind, cfg, zero_stage, dropout, gradient_checkpointing, lora_dim, lora_modules, lr, weight_decay,
                 total_updates, pad_id, hybrid_engine=None):
    """A trained model (actor or critic) as a DeepSpeed engine."""
    model = load_model(path, kind, dtype=cfg.dtype, dropout=dropout, pad_token_id=pad_id, attn_implementation=attention_kernel(cfg),
                       zero3_ds_config=init_config(zero_stage=zero_stage, dtype=cfg.dtype, offload=cfg.offload),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_lora(model, lora_dim, None, lora_modules, cfg.only_optimize_lora,
                       task_type="CAUSAL_LM" if kind == "causal_lm" else "SEQ_CLS")
    return build_engine(model, plan=batch_plan(cfg.per_device_training_batch_size, 1), zero_stage=zero_stage, dtype=cfg.dtype,
                        offload=cfg.offload, learning_rate=lr, weight_decay=weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
                        gradient_clipping=cfg.gradient_clipping, lr_scheduler_type=cfg.lr_scheduler_type,
                        num_warmup_steps=cfg.num_warmup_steps, total_steps=total_updates, hybrid_engine=hybrid_engine,
                        block_leaves=cfg.zero3_block_leaves)


def load_frozen(path, kind, cfg, zero_stage, offload, pad_id):
    """A frozen model (reference or reward) as a DeepSpeed inference engine, ZeRO-3 sharded if asked."""
    model = load_model(path, kind, dtype=cfg.dtype, dropout=0.0, pad_token_id=pad_id, attn_implementation=attention_kernel(cfg),
                       zero3_ds_config=init_config(zero_stage=zero_stage, dtype=cfg.dtype),
                       trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle_weights)
    return build_frozen_engine(model, zero_stage=zero_stage, dtype=cfg.dtype, offload=offload,
                               micro_batch=cfg.per_device_training_batch_size, block_leaves=cfg.zero3_block_leaves)


def main() -> None:
    cfg = parse_config(Step3Config)
    silence_libraries()
    dist.init(cfg.dist_timeout_s)
    dist.set_seed(cfg.seed)
    spec = ALGOS[cfg.algo]
    if cfg.backend == "deepspeed" and not dist.on_cuda():
        raise ConfigError("--rollout_backend deepspeed / --enable_hybrid_engine needs CUDA (DeepSpeed's Hybrid Engine kernels); "
                          "on CPU use --rollout_backend hf")

    # 1. Check every checkpoint (stage, completeness, one tokenizer) and the output directory.
    actor_path = cfg.actor_model_name_or_path
    actor_manifest = check_model_dir(actor_path, ("sft", "base", "dpo", "actor"), "--actor_model_name_or_path")
    critic_path = cfg.critic_model_name_or_path if spec.needs_critic else None
    reward_path = cfg.reward_model_name_or_path or cfg.critic_model_name_or_path
    tokenizer = load_tokenizer(actor_path, cfg.trust_remote_code, padding_side="left")
    for path, role in ((reward_path, "--reward_model_name_or_path"), (critic_path, "--critic_model_name_or_path")):
        if path:
            manifest = check_model_dir(path, ("reward", "critic"), role)
            check_same_tokenizer(actor_path, actor_manifest, path, manifest, tokenizer, load_tokenizer(path, cfg.trust_remote_code))
    check_output_dir(cfg.output_dir)
    reward_fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None

    # 2. Prompts: step 3's share of each source, chat-templated, left-truncated at a turn boundary.
    train_rows, eval_rows, sources = load_phase_data(cfg.data_path, phase=3, need="prompts", data_split=cfg.data_split,
                                                     seed=cfg.seed, eval_fraction=cfg.eval_fraction, strict=cfg.strict,
                                                     max_eval=cfg.max_eval_samples)
    if cfg.prompt_suffix:
        train_rows, eval_rows = with_prompt_suffix(train_rows, cfg.prompt_suffix), with_prompt_suffix(eval_rows, cfg.prompt_suffix)
    train_prompts, prompt_report = tokenize_prompts(train_rows, tokenizer, cfg.max_prompt_seq_len)
    eval_prompts, _ = tokenize_prompts(eval_rows, tokenizer, cfg.max_prompt_seq_len)
    for s in sources:
        dist.print_rank0(s.summary())
    dist.print_rank0(f"prompts: {prompt_report.summary()}; held-out prompts: {len(eval_prompts)}")

    def collate(rows):
        return collate_prompts(rows, tokenizer.pad_token_id)

    loader = train_loader(train_prompts, collate, cfg.per_device_generation_batch_size, cfg.seed,
                          lengths=[len(f["prompt_ids"]) for f in train_prompts] if cfg.group_by_length else None)
    steps_per_epoch = max(1, len(loader) // cfg.generation_batches)
    total_steps = min(cfg.max_steps or 10**12, steps_per_epoch * cfg.num_train_epochs)
    updates_per_step = cfg.ppo_epochs * cfg.samples_per_rank // cfg.per_device_training_batch_size
    # One optimiser update per batch: the policy being trained IS the one that sampled, so the training
    # forward's own logprobs (detached) are the "old" ones and the experience pass skips the actor (as
    # TRL and verl do). Not when the KL goes into the reward: the advantages need it before training.
    old_logprobs_from_training = updates_per_step == 1 and not spec.kl_in_reward
    # --pack_groups: every pass over a batch runs each group as one row (its prompt once), or none does.
    # The same layout in the actor's and the reference's passes and the updates makes the first
    # update's ratio exactly 1 and the KL to the reference exactly 0 while the policy is the reference
    # (in bf16 packed and unpacked rows round differently, ~0.002 nats of KL per token on SmolLM2).
    # With several updates a batch, mini-batches then hold whole groups, so G must divide them.
    packed_groups = (cfg.n_samples_per_prompt if cfg.pack_groups and (
        old_logprobs_from_training or cfg.per_device_training_batch_size % cfg.n_samples_per_prompt == 0) else 1)
    ptx_iter = None
    if cfg.unsupervised_dataset_name:
        ptx_rows, _, _ = load_phase_data(cfg.unsupervised_dataset_name, phase=1, need="sft", data_split="1,0,0", seed=cfg.seed,
                                         eval_fraction=0.0, strict=cfg.strict)
        ptx_set, _ = tokenize_sft(ptx_rows, tokenizer, cfg.max_prompt_seq_len + cfg.max_answer_seq_len)
        ptx_loader = train_loader(ptx_set, lambda r: collate_sft(r, tokenizer.pad_token_id), cfg.per_device_training_batch_size, cfg.seed)
        ptx_iter = BatchStream(ptx_loader)

    # 3. The four models: actor (trained) + reference (frozen copy of it), critic (trained, from the
    #    reward model) + reward model (frozen); the GRPO family has no critic.
    pad = tokenizer.pad_token_id
    he = ({"inference_tp_size": cfg.inference_tp_size, "release_inference_cache": cfg.release_inference_cache,
           "pin_parameters": not cfg.unpin_actor_parameters, "tp_gather_partition_size": cfg.tp_gather_partition_size}
          if cfg.backend == "deepspeed" else None)
    actor = load_trained(actor_path, "causal_lm", cfg, cfg.actor_zero_stage, cfg.actor_dropout, cfg.actor_gradient_checkpointing,
                         cfg.actor_lora_dim, cfg.actor_lora_module_name, cfg.actor_learning_rate, cfg.actor_weight_decay,
                         total_steps * updates_per_step, pad, hybrid_engine=he)
    ref = load_frozen(actor_path, "causal_lm", cfg, cfg.actor_zero_stage, cfg.offload_reference_model, pad)
    critic = (load_trained(critic_path, "reward", cfg, cfg.critic_zero_stage, cfg.critic_dropout, cfg.critic_gradient_checkpointing,
                           cfg.critic_lora_dim, cfg.critic_lora_module_name, cfg.critic_learning_rate, cfg.critic_weight_decay,
                           total_steps * updates_per_step, pad) if critic_path else None)
    reward_model = load_frozen(reward_path, "reward", cfg, cfg.critic_zero_stage, cfg.offload_reward_model, pad) if reward_path else None
    rollout = make_rollout_engine(cfg.backend, actor, **({"keep_copy": cfg.keep_inference_copy} if cfg.backend == "hf" else {}))
    # The experience passes need no gradient: ZeRO-3 models run them on a gathered, hook-free copy
    # (one all-gather per model per step instead of DeepSpeed's per-layer fetch hooks); the frozen
    # models' copies are gathered once and kept with --keep_inference_copy. A model whose parameters
    # are offloaded keeps the engine path: a full copy on the device is what the offload avoids.
    # The actor's view is the rollout engine's own copy: it generates, then scores what it generated
    # (held in between: one gather of the actor a step).
    views = {name: rollout.copy if name == "actor" and hasattr(rollout, "copy") else
             GatheredCopy(m, keep=cfg.keep_inference_copy, frozen=frozen)
             for name, m, frozen, offloaded in (("actor", actor, False, cfg.offload), ("ref", ref, True, cfg.offload_reference_model),
                                                ("critic", critic, False, cfg.offload),
                                                ("reward", reward_model, True, cfg.offload_reward_model))
             if m is not None and cfg.experience_on_copies and not offloaded}

    def no_grad_forward(name, engine, fn, *args):
        """``fn(model, *args)`` with ``model`` the engine's gathered copy (or the engine itself)."""
        view = views.get(name)
        return fn(engine, *args) if view is None else view.run(fn, *args)

    kl_ctl = (AdaptiveKLController(cfg.kl_ctl, cfg.target_kl, cfg.kl_horizon) if cfg.target_kl else FixedKLController(cfg.kl_ctl))
    ema = ParamEMA(actor.module, cfg.ema_beta) if cfg.enable_ema else None
    gen = GenerationConfig(max_new_tokens=cfg.max_answer_seq_len, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                           min_new_tokens=cfg.min_new_tokens, do_sample=not cfg.greedy_rollouts,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    eval_gen = GenerationConfig(max_new_tokens=cfg.max_answer_seq_len, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=pad)
    logger = MetricsLogger(os.path.join(cfg.output_dir, "logs"), cfg.enable_tensorboard, cfg.tensorboard_path, cfg.algo)
    dev = actor.device
    dist.print_rank0(f"{cfg.algo}: {total_steps} steps x {cfg.samples_per_rank} samples/rank "
                     f"({cfg.per_device_generation_batch_size} prompts x {cfg.generation_batches} x {cfg.n_samples_per_prompt}), "
                     f"{updates_per_step} updates/step{', groups packed' if packed_groups > 1 else ''}, "
                     f"rollout backend {cfg.backend}, critic {'yes' if critic else 'no'}")

    def score(batch, rows, parts):
        """Sequence rewards [B]: the reward model (read at the last real token) and/or reward functions.
        ``parts`` collects per-sample reward components for the metrics (gsm8k: accuracy, format)."""
        total = torch.zeros(len(batch), device=dev)
        if reward_model is not None:
            total += cfg.reward_model_weight * no_grad_forward("reward", reward_model, sequence_scores, batch.sequences,
                                                               batch.attention_mask)
        if reward_fn is not None:
            prompts = tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
            responses = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
            extra = {"format_bonus": cfg.format_bonus, "parts": parts} if cfg.reward_fn == "gsm8k" else {}
            total += cfg.reward_fn_weight * torch.tensor(call_reward_fn(cfg.reward_fn, reward_fn, prompts, responses, rows, **extra),
                                                         device=dev)
        return total

    @torch.no_grad()
    def rollout_and_score(prompt_batch, gen_cfg, repeat, source_rows, parts):
        """Generate for this rank's prompts (each `repeat` times, kept contiguous: a group stays on one
        rank) and run the experience forward passes. Returns (Experience without advantages, rows)."""
        ids = prompt_batch["input_ids"].to(dev).repeat_interleave(repeat, 0)
        mask = prompt_batch["attention_mask"].to(dev).repeat_interleave(repeat, 0)
        rows = [source_rows[i].meta for i in prompt_batch["index"].tolist() for _ in range(repeat)]
        t0 = time.time()
        if gen_cfg is gen:
            crash_point("generation")
        actor_view = views.get("actor")
        with actor_view.held() if actor_view is not None else contextlib.nullcontext():
            batch = rollout.generate(PromptBatch(ids, mask), gen_cfg)
            t_gen = time.time() - t0
            P, seqs, attn = batch.prompt_ids.shape[1], batch.sequences, batch.attention_mask
            temperature = cfg.temperature if gen_cfg.do_sample else 1.0
            old_lp = None
            if not (old_logprobs_from_training and gen_cfg is gen):  # evaluation needs them for its KL
                old_lp, _ = no_grad_forward("actor", actor, actor_forward, seqs, attn, P, temperature, False,
                                            packed_groups if gen_cfg is gen else 1)
        ref_lp, _ = no_grad_forward("ref", ref, actor_forward, seqs, attn, P, temperature, False,
                                    packed_groups if gen_cfg is gen else 1)
        values = no_grad_forward("critic", critic, critic_forward, seqs, attn, P) if critic is not None else None
        raw = score(batch, rows, parts)
        scores = raw.clone()
        if cfg.truncated_reward is not None:
            scores = torch.where(batch.truncated.to(dev), torch.full_like(scores, cfg.truncated_reward), scores)
        if cfg.overlong_buffer_len:
            scores = scores + overlong_penalty(batch.response_lengths.to(dev), cfg.max_answer_seq_len, cfg.overlong_buffer_len,
                                               cfg.overlong_penalty_factor)
        amask = batch.action_mask.float()
        loss_mask = amask * (~batch.truncated).float()[:, None].to(dev) if cfg.mask_truncated else amask
        zeros = torch.zeros_like(amask)
        exp = Experience(sequences=seqs, attention_mask=attn, action_mask=amask, loss_mask=loss_mask, old_logprobs=old_lp,
                         ref_logprobs=ref_lp, values=values, scores=scores, raw_scores=raw, rewards=zeros, advantages=zeros,
                         returns=zeros, kl=zeros, truncated=batch.truncated.to(dev), prompt_len=P)
        return exp, time.time() - t0 - t_gen, t_gen

    def collect(prompt_iter):
        """Experience for one step; with --dynamic_sampling, uniform-reward groups are dropped and more
        prompts sampled (every rank runs the same number of rounds; all keep the same sample count)."""
        G, target = cfg.n_samples_per_prompt, cfg.samples_per_rank
        parts, kept, rounds, t_gen, t_exp, reward_parts = [], 0, 0, 0.0, 0.0, {}
        max_rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else cfg.generation_batches
        while rounds < max_rounds:
            exp, te, tg = rollout_and_score(next(prompt_iter), gen, G, train_rows, reward_parts)
            rounds, t_gen, t_exp = rounds + 1, t_gen + tg, t_exp + te
            if cfg.dynamic_sampling:
                groups = exp.scores.view(-1, G)
                keep = (groups.max(1).values - groups.min(1).values) > 1e-6
                exp = exp.select(keep.repeat_interleave(G).nonzero().squeeze(-1))
            parts.append(exp)
            kept += len(exp)
            need_more = dist.all_reduce_sum(torch.tensor([float(kept < target)], device=dev)).item() > 0
            if not cfg.dynamic_sampling or not need_more:
                if not cfg.dynamic_sampling and rounds < cfg.generation_batches:
                    continue
                break
        exp = Experience.concat([p for p in parts if len(p)] or parts[:1], pad)
        n = int(dist.all_reduce_min(torch.tensor([float(min(len(exp), target))], device=dev)).item())
        n -= n % G
        exp = exp.select(torch.arange(n)) if n < len(exp) else exp
        return exp, rounds, t_gen, t_exp, reward_parts

    def part_means(parts, weights=None):
        """Global means of per-sample reward components (same keys on every rank)."""
        out = {}
        for name in sorted(parts):
            v = torch.tensor(parts[name], dtype=torch.float64)
            w = torch.ones_like(v) if weights is None else weights.double().cpu()
            total = dist.all_reduce_sum(torch.stack([(w * v).sum(), w.sum()]))
            out[name] = total[0].item() / max(total[1].item(), 1e-9)
        return out

    def add_advantages(exp):
        # without old logprobs yet (filled in by train_on) the KL estimate is 0 here; only metrics read it
        logprobs = exp.ref_logprobs if exp.old_logprobs is None else exp.old_logprobs
        adv = compute_advantages(spec, scores=exp.scores, logprobs=logprobs, ref_logprobs=exp.ref_logprobs,
                                 mask=exp.action_mask, values=exp.values, kl_coef=kl_ctl.value, kl_estimator=cfg.kl_estimator,
                                 clip_reward_value=cfg.clip_reward_value, gamma=cfg.gamma, lam=cfg.lam,
                                 group_size=cfg.n_samples_per_prompt, whiten_advantages=cfg.whiten_advantages,
                                 all_reduce_sum=dist.all_reduce_sum)
        exp.rewards, exp.advantages, exp.returns, exp.kl = adv.rewards, adv.advantages, adv.returns, adv.kl

    def train_on(exp):
        """ppo_epochs passes of mini-batch updates; one optimiser step of actor (and critic) per mini-batch."""
        actor.train()
        if critic is not None:
            critic.train()
        stats: dict[str, float] = {}
        n = 0
        low, high = cfg.clip_eps
        gen_rng = torch.Generator().manual_seed(cfg.seed + dist.rank())
        # packed where the experience passes were: whole-group mini-batches are not trimmed, so they have
        # the batch's shape; otherwise rows apart, shuffled sample by sample and trimmed
        groups = packed_groups if packs_groups(actor, exp.prompt_len, exp.action_mask.shape[1], packed_groups) else 1
        for _ in range(cfg.ppo_epochs):
            for mb in [exp] if old_logprobs_from_training else exp.minibatches(cfg.per_device_training_batch_size, gen_rng, groups):
                norm = dist.all_reduce_sum(torch.tensor([mb.loss_mask.sum().item(), float(len(mb))], dtype=torch.float64))
                n_tok, n_seq = max(norm[0].item(), 1.0) / dist.world_size(), norm[1].item() / dist.world_size()
                logp, entropy = actor_forward(actor, mb.sequences, mb.attention_mask, mb.prompt_len, cfg.temperature, with_entropy=True,
                                              group_size=groups)
                if mb.old_logprobs is None:  # the single update of this batch (old_logprobs_from_training)
                    mb.old_logprobs = logp.detach()
                    mb.kl = kl_estimate(mb.old_logprobs, mb.ref_logprobs, cfg.kl_estimator) * mb.action_mask
                pg_loss, pg = ppo_policy_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, low, high, cfg.loss_agg,
                                              num_tokens=n_tok, num_seqs=n_seq)
                loss = pg_loss
                step_stats = {"policy/loss": pg_loss.item(), "policy/clip_frac": float(pg["clip_frac"]),
                              "policy/approx_kl": float(pg["approx_kl"]),
                              "policy/entropy": masked_mean(entropy.detach(), mb.action_mask).item()}
                if spec.kl_in_loss and kl_ctl.value > 0:
                    kl_term = kl_loss(logp, mb.ref_logprobs, mb.loss_mask, cfg.kl_estimator, cfg.loss_agg, num_tokens=n_tok, num_seqs=n_seq)
                    loss = loss + kl_ctl.value * kl_term
                    step_stats["policy/kl_loss"] = kl_term.item()
                if ptx_iter is not None:
                    ptx = to_device(next(ptx_iter), dev)
                    ptx_loss, _ = sft_loss(actor(input_ids=ptx["input_ids"], attention_mask=ptx["attention_mask"], use_cache=False).logits,
                                           ptx["labels"])
                    loss = loss + cfg.unsup_coef * ptx_loss
                    step_stats["policy/ptx_loss"] = ptx_loss.item()
                if guard.ok(loss):
                    actor.backward(loss)
                    actor.step()
                if critic is not None:
                    v = critic_forward(critic, mb.sequences, mb.attention_mask, mb.prompt_len)
                    vf_loss, vs = clipped_value_loss(v, mb.values, mb.returns, mb.action_mask, cfg.cliprange_value, cfg.loss_agg,
                                                     num_tokens=max(norm[0].item(), 1.0) / dist.world_size(), num_seqs=n_seq)
                    if guard.ok(vf_loss):
                        critic.backward(vf_loss)
                        critic.step()
                    step_stats.update({"value/loss": vf_loss.item(), "value/clip_frac": float(vs["vf_clip_frac"])})
                if ema is not None:
                    ema.update()
                for k, v in step_stats.items():
                    stats[k] = stats.get(k, 0.0) + v
                n += 1
        return {k: v / max(n, 1) for k, v in stats.items()}

    @torch.no_grad()
    def evaluate():
        """Greedy responses of the current actor to the held-out prompts: mean reward and KL to the
        reference (before training the actor IS the step-1 model, so step 0 is the baseline)."""
        actor.eval()
        sums = torch.zeros(5, dtype=torch.float64)
        parts, part_weights = {}, []
        for batch, weights in eval_batches(eval_prompts, collate, cfg.per_device_generation_batch_size):
            exp, _, _ = rollout_and_score(batch, eval_gen, 1, eval_rows, parts)
            part_weights.append(weights)
            w = weights.to(dev).double()
            seq_kl = masked_sum(exp.old_logprobs - exp.ref_logprobs, exp.action_mask, dim=-1).double()
            sums += torch.stack([(w * exp.raw_scores.double()).sum(), (w * seq_kl).sum(),
                                 (w * exp.action_mask.sum(-1).double()).sum(), (w * exp.truncated.double()).sum(), w.sum()]).cpu()
        total = dist.all_reduce_sum(sums)
        n = max(total[4].item(), 1.0)
        return {"reward": total[0].item() / n, "kl_per_seq": total[1].item() / n, "response_len": total[2].item() / n,
                "truncated_rate": total[3].item() / n, "prompts": int(total[4].item()),
                **part_means(parts, torch.cat(part_weights) if part_weights else None)}

    # 4. The loop: rollout -> experience -> advantages -> ppo_epochs of updates -> metrics.
    from tqdm import tqdm

    frozen = {"reference": ref.module, **({"reward_model": reward_model.module} if reward_model is not None else {})}
    fingerprints_before = {k: param_fingerprint(m) for k, m in frozen.items()}

    run_state = make_run_state(cfg, {"actor": actor, **({"critic": critic} if critic is not None else {})})
    restored = run_state.restore()
    prompt_iter = BatchStream(loader)
    start, samples_done, tokens_done = 1, 0, 0
    if restored:  # continue exactly: engines and RNGs are loaded; counters, data position, KL coefficient, EMA here
        c, extra = restored["counters"], restored["extra"]
        start, samples_done, tokens_done = c["step"] + 1, c["samples"], c["tokens"]
        prompt_iter = BatchStream(loader, **c["prompts"])
        if ptx_iter is not None:
            ptx_iter = BatchStream(ptx_iter.loader, **c["ptx"])
        kl_ctl.load_state_dict(extra["kl_ctl"])
        evals = extra["evals"]
        if ema is not None:
            ema.load_state_dict(restored["rank_extra"]["ema"])
    else:
        evals = [{"step": 0, **evaluate()}] if eval_prompts else []
        if evals:
            logger.log(0, {f"eval/{k}": v for k, v in evals[0].items() if k != "step"})
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, lambda: run_state.last_saved)
    bar = tqdm(total=total_steps, initial=start - 1, desc=cfg.algo, disable=not (cfg.progress_bar and dist.is_main()), file=sys.stdout)
    t_start = time.time()
    for step in range(start, total_steps + 1):
        t0 = time.time()
        exp, rounds, t_gen, t_exp, reward_parts = collect(prompt_iter)
        part_metrics = {f"reward/{k}": v for k, v in part_means(reward_parts).items()}  # over every sample generated
        if len(exp) == 0:  # dynamic sampling found no informative group on some rank within max rounds
            logger.log(step, {"sampling/rounds": rounds, "sampling/skipped_step": 1, **part_metrics}, write=bar.write)
            bar.update(1)
            continue
        add_advantages(exp)
        t1 = time.time()
        train_stats = train_on(exp)
        t_train = time.time() - t1
        seq_kl = masked_sum(exp.kl, exp.action_mask, dim=-1)
        if cfg.target_kl:
            kl_ctl.update(dist.all_reduce_mean(seq_kl.mean().detach()).item(), len(exp) * dist.world_size())
        lengths = exp.action_mask.sum(-1)
        local = {"reward/score_mean": exp.raw_scores.mean().item(), "reward/score_std": exp.raw_scores.std().item() if len(exp) > 1 else 0.0,
                 "reward/shaped_mean": exp.scores.mean().item(),
                 "kl/per_token": masked_mean(exp.kl, exp.action_mask).item(), "kl/per_seq": seq_kl.mean().item(),
                 "adv/mean": masked_mean(exp.advantages, exp.action_mask).item(),
                 "adv/return_mean": masked_mean(exp.returns, exp.action_mask).item(),
                 "gen/response_len": lengths.float().mean().item(), "gen/truncated_rate": exp.truncated.float().mean().item(),
                 **train_stats}
        metrics = dist.mean_over_ranks(local, dev)
        step_s = time.time() - t0
        n_samples = len(exp) * dist.world_size()
        n_tokens = dist.all_reduce_sum(lengths.sum().double()).item()
        samples_done, tokens_done = samples_done + n_samples, tokens_done + n_tokens
        metrics.update(dist.max_over_ranks({"mem/peak_rss_gb": peak_rss_gb()}, dev))
        metrics.update(part_metrics)
        metrics.update({"kl/coef": kl_ctl.value, "nonfinite/skipped": guard.total, "sampling/rounds": rounds,
                        "time/generation_s": t_gen, "time/experience_s": t_exp,
                        "time/training_s": t_train, "time/step_s": step_s, "time/generation_share": t_gen / max(step_s, 1e-9),
                        "perf/samples_per_s": n_samples / step_s, "perf/gen_tokens_per_s": n_tokens / max(t_gen, 1e-9)})
        if step % cfg.log_interval == 0 or step == total_steps:
            logger.log(step, metrics, write=bar.write)
        if cfg.print_answers and step % cfg.print_answers_interval == 0 and dist.is_main():
            P = exp.prompt_len
            bar.write(f"--- prompt: {tokenizer.decode(exp.sequences[0, :P], skip_special_tokens=True)[-300:]!r}\n"
                      f"--- answer: {tokenizer.decode(exp.sequences[0, P:], skip_special_tokens=True)!r}\n"
                      f"--- reward: {exp.raw_scores[0].item():.4f} truncated={bool(exp.truncated[0])}")
        if eval_prompts and cfg.eval_interval and step % cfg.eval_interval == 0 and step < total_steps:
            evals.append({"step": step, **evaluate()})
            logger.log(step, {f"eval/{k}": v for k, v in evals[-1].items() if k != "step"}, write=bar.write)
        if run_state.due(step):
            run_state.save(step, {"samples": samples_done, "tokens": tokens_done, "prompts": prompt_iter.position(),
                                  **({"ptx": ptx_iter.position()} if ptx_iter is not None else {})},
                           extra={"kl_ctl": kl_ctl.state_dict(), "evals": evals},
                           rank_extra={"ema": ema.state_dict()} if ema is not None else None)
        bar.update(1)
    bar.close()
    seconds = time.time() - t_start
    if eval_prompts:
        evals.append({"step": total_steps, **evaluate()})
        logger.log(total_steps, {f"eval/{k}": v for k, v in evals[-1].items() if k != "step"})

    # 5. Export actor/ and critic/ (and actor_ema/), each a checkpoint directory.
    fingerprints_after = {k: param_fingerprint(m) for k, m in frozen.items()}
    if fingerprints_after != fingerprints_before:  # a frozen model was updated: a bug, never a result to keep
        raise RuntimeError(f"frozen model weights changed during training: {fingerprints_before} -> {fingerprints_after}")
    final = {"steps": total_steps, "seconds": seconds, "samples": samples_done,
             "frozen_fingerprints": fingerprints_after,
             **({"eval_reward_before": evals[0]["reward"], "eval_reward_after": evals[-1]["reward"],
                 "eval_kl_per_seq_after": evals[-1]["kl_per_seq"]} if evals else {})}
    common = dict(config=config_dict(cfg), tokenizer=tokenizer, data=sources, metrics=final, dtype=cfg.dtype)
    out = os.path.abspath(cfg.output_dir)
    gen_cfg = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad, "bos_token_id": tokenizer.bos_token_id}
    export_model(actor, tokenizer, os.path.join(out, "actor"),
                 build_manifest(stage="actor", parent=actor_path, zero_stage=cfg.actor_zero_stage, **common), generation=gen_cfg)
    if critic is not None:
        export_model(critic, tokenizer, os.path.join(out, "critic"),
                     build_manifest(stage="critic", parent=critic_path, zero_stage=cfg.critic_zero_stage, **common))
    if ema is not None:
        with ema.swapped():
            export_model(actor, tokenizer, os.path.join(out, "actor_ema"),
                         build_manifest(stage="actor", parent=actor_path, zero_stage=cfg.actor_zero_stage,
                                        extra={"ema_beta": cfg.ema_beta}, **common), generation=gen_cfg)
    logger.close()
    lines = {"steps": total_steps, "time": f"{seconds:.1f} s ({samples_done / max(seconds, 1e-9):.2f} samples/s)",
             "actor": os.path.join(out, "actor")}
    if critic is not None:
        lines["critic"] = os.path.join(out, "critic")
    if evals:
        b, a = evals[0], evals[-1]
        lines["held-out reward"] = (f"step-1 model {b['reward']:.4f} -> actor {a['reward']:.4f} "
                                    f"({a['reward'] - b['reward']:+.4f}, {a['prompts']} prompts, greedy)")
        lines["KL to step-1 model"] = f"{a['kl_per_seq']:.4f} per sequence"
    lines["metrics"] = os.path.join(out, "logs", "metrics.jsonl")
    lines["next"] = f"rlhfkit chat --model {os.path.join(out, 'actor')}   |   rlhfkit report {os.path.dirname(out)}"
    print_summary(f"step 3 ({cfg.algo}) done", lines)


if __name__ == "__main__":
    run_main(main)
