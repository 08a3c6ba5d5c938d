"""Every step-3 flag the speed benches pin on the command line, so that a changed default never counts as speed.

``STEP3`` holds each step3_ppo/main.py flag that takes a value, at its default of commit 5f6227d unless a
bench overrides it (bench/step3.py and bench/grpo.py start from this dict). ``STEP3_UNSET`` names the
flags deliberately left off, with why: their default is "none" (a value the command line cannot spell)
or the launcher sets them. bench/revisions.py's ``pin_report`` prints any option of either tree that is
in neither, and any unpinned default that differs between the trees.
"""

from __future__ import annotations

LORA_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

STEP3 = {
    # models and rewards
    "reward_fn_weight": 1.0, "reward_model_weight": 1.0, "format_bonus": 0.0, "trust_remote_code": False,
    "allow_pickle_weights": False, "attn_implementation": "auto", "actor_gradient_checkpointing": False,
    "critic_gradient_checkpointing": False, "actor_dropout": 0.0, "critic_dropout": 0.0,
    # data
    "data_split": "2,4,4", "eval_fraction": 0.05, "max_eval_samples": 16, "max_prompt_seq_len": 256,
    "eval_greedy": True, "eval_n_samples_per_prompt": 1,  # the held-out evaluation of revisions before sampled evals
    "max_answer_seq_len": 256, "strict": False, "group_by_length": True, "unsup_coef": 27.8,
    # generation
    "rollout_backend": "hf", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_new_tokens": 0, "greedy_rollouts": False,
    "keep_inference_copy": False, "experience_on_copies": True, "enable_hybrid_engine": False, "inference_tp_size": 1,
    "release_inference_cache": False, "unpin_actor_parameters": False, "tp_gather_partition_size": 8,
    "print_answers": False, "print_answers_interval": 1,
    # algorithm
    "algo": "ppo", "n_samples_per_prompt": 1, "pack_groups": True, "kl_ctl": 0.1, "kl_estimator": "k1", "kl_horizon": 10000,
    "clip_reward_value": 5.0, "gamma": 1.0, "lam": 0.95, "cliprange": 0.2, "cliprange_value": 0.2,
    "whiten_advantages": False, "loss_agg": "token_mean", "ppo_epochs": 1, "dynamic_sampling": False,
    "max_sampling_rounds": 4, "overlong_buffer_len": 0, "overlong_penalty_factor": 1.0, "mask_truncated": False,
    "enable_ema": False, "ema_beta": 0.992,
    # training
    "per_device_generation_batch_size": 4, "per_device_training_batch_size": 4, "generation_batches": 1,
    "num_train_epochs": 1, "actor_learning_rate": 1e-6, "critic_learning_rate": 5e-6, "actor_weight_decay": 0.0,
    "critic_weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.95, "lr_scheduler_type": "constant_with_warmup",
    "num_warmup_steps": 0, "gradient_clipping": 1.0, "actor_zero_stage": 0, "critic_zero_stage": 0, "offload": False,
    "zero3_block_leaves": True, "offload_reference_model": False, "offload_reward_model": False, "dtype": "bf16",
    "actor_lora_dim": 0, "actor_lora_module_name": LORA_MODULES, "critic_lora_dim": 0,
    "critic_lora_module_name": LORA_MODULES, "only_optimize_lora": False, "dist_timeout_s": 600, "seed": 1234,
    # logging and saving
    "enable_tensorboard": False, "eval_interval": 0, "log_interval": 1, "progress_bar": False,  # (the benches turn it off)
    "save_interval": 0,
    "keep_last_k": 2, "resume_allow_config_change": False, "max_nonfinite_steps": 10,
}

STEP3_UNSET = {
    "local_rank": "set by the deepspeed launcher",
    "output_dir": "set by each bench run", "data_path": "set by each bench run", "max_steps": "set by each bench run",
    "actor_model_name_or_path": "set by each bench run", "critic_model_name_or_path": "set by the bench when it has a critic",
    "reward_model_name_or_path": "none: the critic's checkpoint scores", "reward_fn": "none, or set by the bench",
    "tensorboard_path": "none: TensorBoard is off", "resume": "none: a fresh run", "target_kl": "none: a fixed KL coefficient",
    "truncated_reward": "none: truncated responses keep their score", "clip_eps_low": "none: --cliprange",
    "clip_eps_high": "none: --cliprange", "prompt_suffix": "none", "unsupervised_dataset_name": "none: no PTX loss",
    # flags newer than the benches' base revisions: their defaults are the old behaviour, and pinning them
    # would make an older tree refuse the command line
    "policy_loss": "ppo: the token-level clipped ratio", "entropy_coef": "0: no entropy bonus",
    "scale_rewards": "none: the algorithm's own", "kl_placement": "none: the algorithm's own",
    "loss_norm_constant": "none: --max_answer_seq_len", "normalize_reward_fns": "false",
    "empty_reward": "min: it changes only empty answers, and the benches force every answer to full length",
    "compile_blocks": "false: eager blocks; bench/step3.py's hf-compiled variant turns it on where a tree has it",
}
