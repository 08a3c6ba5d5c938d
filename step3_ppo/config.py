"""Step 3 flags: one typed config (DeepSpeed-Chat names where it has them), composed from the shared
parts of :mod:`rlhfkit.config` plus step 3's own, and the values derived from it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

from rlhfkit.algos.advantages import REWARD_SCALES
from rlhfkit.algos.kl import KL_ESTIMATORS
from rlhfkit.algos.losses import LOSS_AGG_MODES
from rlhfkit.config import MAX_PER_PROMPT_HELP, AdamArgs, LoadArgs, LogArgs, RunLengthArgs, RuntimeArgs, arg, require
from rlhfkit.errors import ConfigError
from rlhfkit.rl import ALGOS, GSPO_CLIP_EPS, KL_PLACEMENTS, POLICY_LOSSES, AlgoSpec, with_kl_placement
from rlhfkit.rollout import DEFAULT_ROLLOUT_BACKEND, ROLLOUT_BACKENDS, RolloutOptions
from rlhfkit.trackers import parse_report_to


@dataclass
class Step3Models(LoadArgs):
    actor_model_name_or_path: Optional[str] = arg(None, "Step-1 (SFT) checkpoint: the actor, and the frozen reference.")
    critic_model_name_or_path: Optional[str] = arg(None, "Step-2 reward model: initialises the critic (PPO); also the reward model unless --reward_model_name_or_path.")
    reward_model_name_or_path: Optional[str] = arg(None, "Frozen reward model (default: --critic_model_name_or_path).")
    reward_fn: list[str] = arg([], "Rule-based rewards, one or more (repeat the flag or list them), each NAME[:WEIGHT]: gsm8k, "
                                   "or module.path:function(prompts, responses, rows) -> scores; e.g. --reward_fn gsm8k:1.0 "
                                   "--reward_fn mymod:len_penalty:0.2. The weighted sum is added to the reward model's score.",
                               action="extend")
    reward_fn_weight: float = arg(1.0, "Weight of a --reward_fn given without its own :WEIGHT.")
    normalize_reward_fns: bool = arg(False, "Normalise each --reward_fn by the running mean and std of its own scores so far "
                                            "(all ranks) before weighting it.")
    reward_url: list[str] = arg([], "Reward servers (rlhfkit serve-rm, or any server with its schema), one or more, each "
                                    "URL[:WEIGHT] with the weight after the URL's path (http://host:8000/score:0.5; default "
                                    "weight --reward_fn_weight). Each is a reward component like a --reward_fn.",
                                action="extend")
    reward_url_timeout: float = arg(60.0, "Seconds a --reward_url request may take before it is retried.")
    reward_url_retries: int = arg(3, "Retries of a failed --reward_url request (exponential backoff from 1 s) before the run "
                                     "stops with an error naming the URL.")
    judge: list[str] = arg([], "Held-out evaluation only: more reward models (e.g. an independent judge, trained from the base "
                               "model on pairs that no stage of this run trained on) that score every held-out response; each "
                               "is reported on its own (eval/judge, or eval/judge1, eval/judge2, ...) with its paired change "
                               "over the step-1 model. Never trained on.", action="extend")
    reward_model_weight: float = arg(1.0, "Weight of the reward model in the summed reward.")
    format_bonus: float = arg(0.0, "gsm8k: extra reward when the answer is stated as '#### n' or \\boxed{n}.")
    attn_implementation: str = arg("auto", "Attention kernel of the four models, passed to transformers (sdpa, eager, "
                                           "flash_attention_2, ...). auto: the model's default (SDPA). Unlike steps 1-2, not eager "
                                           "on the CPU: generation dominates step 3, and eager attention copies a grouped-query "
                                           "model's KV cache at every decoded token.")
    actor_gradient_checkpointing: bool = arg(False, "Gradient checkpointing for the actor.")
    critic_gradient_checkpointing: bool = arg(False, "Gradient checkpointing for the critic.")
    actor_dropout: Optional[float] = arg(0.0, "Actor dropout (0 keeps log-probs of old and new policy comparable).")
    critic_dropout: Optional[float] = arg(0.0, "Critic dropout.")


@dataclass
class Step3Data:
    data_path: list[str] = arg([], "Prompt data: one or more files (blended); any supported format, prompts are used.")
    data_split: str = arg("2,4,4", "Shares of each source for steps 1,2,3; step 3 uses the third (e.g. 0,0,1 for prompt-only data).")
    eval_fraction: float = arg(0.05, "Fraction of the step-3 share held out to compare the actor with the step-1 model.")
    max_eval_samples: Optional[int] = arg(64, "Cap on held-out prompts (None: all of --eval_fraction; the rest of it is trained "
                                              "on). Enough prompts that the held-out reward's standard error can show a gain.")
    max_per_prompt: Optional[int] = arg(None, MAX_PER_PROMPT_HELP)
    eval_n_samples_per_prompt: int = arg(4, "Held-out evaluation: responses sampled per prompt at temperature 1, top_p 1, top_k 0 "
                                            "(the policy's own distribution, whatever the rollout settings), so the reward averages "
                                            "over what the policy does and the KL to the reference (k3 on the actor's own samples) "
                                            "is an estimate. Seeded with --seed, with the training's random state set aside, so "
                                            "training is the same whatever the evaluation does.")
    per_device_eval_batch_size: Optional[int] = arg(None, "Held-out evaluation: prompts per rank per generation batch (each "
                                                         "with its --eval_n_samples_per_prompt responses). Default: about "
                                                         "as many sequences as a training generation batch.")
    eval_greedy: bool = arg(False, "Held-out evaluation: one greedy response per prompt instead of sampling (the KL is then only a "
                                   "log-ratio on the greedy path, not an estimate).")
    max_prompt_seq_len: int = arg(256, "Prompts longer than this are left-truncated at a turn boundary, or dropped (counted).")
    max_answer_seq_len: int = arg(256, "Maximum response tokens; a response without EOS by then is 'truncated'.")
    strict: bool = arg(False, "Fail on the first malformed data row instead of skipping it.")
    prompt_suffix: Optional[str] = arg(
        None, "Text appended to the last user turn of every prompt (training and held-out), e.g. for GSM8K: "
              "\"Let's think step by step and output the final answer after '####'.\"")
    group_by_length: bool = arg(True, "Batch prompts of similar length together (less padding in generation and training).")
    unsupervised_dataset_name: Optional[str] = arg(None, "PTX: a dataset (any supported data path) whose SFT loss is mixed into the actor loss.")
    unsup_coef: float = arg(27.8, "PTX loss coefficient (InstructGPT's gamma).")


@dataclass
class Step3Generation:
    rollout_backend: str = arg(DEFAULT_ROLLOUT_BACKEND, f"Rollout engine: {', '.join(ROLLOUT_BACKENDS)}.")
    temperature: float = arg(1.0, "Sampling temperature of rollouts (logprobs are taken at the same temperature).")
    top_p: float = arg(1.0, "Nucleus sampling for rollouts (1.0 = off).")
    top_k: int = arg(0, "Top-k sampling for rollouts (0 = off).")
    min_new_tokens: int = arg(0, "EOS suppressed for this many tokens (0: EOS allowed at any step).")
    greedy_rollouts: bool = arg(False, "Greedy decoding for rollouts (tests only; RL needs sampling).")
    keep_inference_copy: bool = arg(False, "Keep the gathered inference copies between steps: the actor's (hf backend) and the "
                                           "frozen models' (--experience_on_copies); faster, more memory.")
    experience_on_copies: bool = arg(True, "ZeRO-3 models run the experience forward passes (old/reference logprobs, values, "
                                           "scores) on a gathered full-weight copy, one model at a time, instead of through "
                                           "DeepSpeed's per-layer gathers (models with offloaded parameters keep the engine path).")
    enable_hybrid_engine: bool = arg(False, "DeepSpeed Hybrid Engine for generation (CUDA only; implies --rollout_backend deepspeed).")
    inference_tp_size: int = arg(1, "Hybrid Engine: inference tensor-parallel size.")
    release_inference_cache: bool = arg(False, "Hybrid Engine: release the inference cache after generation.")
    unpin_actor_parameters: bool = arg(False, "Hybrid Engine: unpin actor parameters between generations.")
    tp_gather_partition_size: int = arg(8, "Hybrid Engine: partition size of the tensor-parallel gather.")
    print_answers: bool = arg(False, "Print a prompt/response/reward sample every --print_answers_interval steps.")
    print_answers_interval: int = arg(1, "See --print_answers.")


@dataclass
class Step3Algo:
    algo: str = arg("ppo", f"Algorithm: {', '.join(ALGOS)} (PPO-penalty = ppo with --target_kl).")
    n_samples_per_prompt: int = arg(1, "Samples per prompt (G); group algorithms need >= 2.")
    pack_groups: bool = arg(True, "Run the G samples of a prompt as one row (the prompt once, each response attending to the "
                                  "prompt and itself) in the actor's and the reference's passes and in the updates; where the "
                                  "attention kernel takes a 4D mask (eager, sdpa) and it costs less than G rows (short "
                                  "responses). With several updates a batch, mini-batches then hold whole groups: G must "
                                  "divide --per_device_training_batch_size.")
    kl_ctl: float = arg(0.1, "KL coefficient beta: in the reward (ppo, rloo, reinforce_pp) or in the loss (grpo).", aliases=["--init_kl_coef"])
    kl_placement: Optional[str] = arg(None, f"Where the KL to the reference goes: {', '.join(KL_PLACEMENTS)}. reward: -beta KL_t in the "
                                            "per-token reward (PPO, DeepSpeed-Chat); loss: + beta KL in the actor loss (GRPO); "
                                            "none (DAPO). Default: the algorithm's own (README table).")
    kl_estimator: Optional[str] = arg(None, f"KL estimator: {', '.join(KL_ESTIMATORS)}. Default: the algorithm's own, k1 where "
                                             "the KL shapes the reward (ppo, rloo, reinforce_pp), k3 where it is a loss term "
                                             "(grpo): on-policy the gradient of k1 has expectation 0, so as a loss it does not "
                                             "regularise; k3's pulls pi toward pi_ref (in expectation, the gradient of KL(pi_ref || pi)).")
    target_kl: Optional[float] = arg(None, "Adaptive KL controller target (PPO-penalty); None = fixed coefficient.")
    kl_horizon: int = arg(10000, "Adaptive KL controller horizon.")
    normalize_reward: bool = arg(False, "Normalise the sequence scores by the running mean and std of every score so far "
                                        "(all ranks), before clipping and KL shaping, so the reward's scale, not the reward "
                                        "model's, meets --kl_ctl (TRL's score scaling, OpenRLHF's --normalize_reward).")
    clip_reward_value: Optional[float] = arg(5.0, "Clip sequence scores to [-c, c] (None: no clipping).")
    truncated_reward: Optional[float] = arg(None, "Replace the score of a truncated response (no EOS) with this value.")
    empty_reward: str = arg("min", "The score of an empty response (EOS first): min, capped at the lowest score of a non-empty "
                                   "response in the global batch (a reward model never saw an empty answer and may score it "
                                   "high; PPO then learns to say nothing); keep, the reward's own score; or a number, which "
                                   "replaces it after --normalize_reward.")
    gamma: float = arg(1.0, "Discount factor.")
    lam: float = arg(0.95, "GAE lambda.")
    cliprange: float = arg(0.2, "PPO policy clip range (both sides unless --clip_eps_low/high).")
    clip_eps_low: Optional[float] = arg(None, "Lower clip epsilon (DAPO: 0.2).")
    clip_eps_high: Optional[float] = arg(None, "Upper clip epsilon (DAPO clip-higher: 0.28).")
    cliprange_value: float = arg(0.2, "Value clip range.")
    whiten_advantages: Optional[bool] = arg(None, "Whiten advantages over the whole global batch. Default: the algorithm's "
                                                  "own, on for ppo (as TRL and OpenRLHF do), off where advantages are "
                                                  "already normalised per group (grpo, dapo) or returns are (reinforce_pp).")
    loss_agg: Optional[str] = arg(None, f"Loss aggregation: {', '.join(LOSS_AGG_MODES)}. Default: the algorithm's own, "
                                        "token_mean except dr_grpo's seq_mean_token_sum_norm (the sum over every token of "
                                        "every sequence / (sequences x --loss_norm_constant)).")
    loss_norm_constant: Optional[float] = arg(None, "seq_mean_token_sum_norm's constant C. Default: --max_answer_seq_len.")
    policy_loss: str = arg("ppo", f"Policy loss: {', '.join(POLICY_LOSSES)}. ppo: the token-level clipped ratio; gspo: GSPO's "
                                  "length-normalised sequence ratio, clipped per sequence (Zheng et al. 2025; its clip range "
                                  "defaults to 3e-4 / 4e-4; it differs from ppo only with 2+ updates a batch); gspo_token: "
                                  "GSPO-token, per-token advantages on the sequence ratio.")
    scale_rewards: Optional[str] = arg(None, f"Group-relative advantages (grpo, dapo, dr_grpo): divide the group-centred rewards by "
                                             f"the std of the group, of the whole global batch, or by nothing ({', '.join(REWARD_SCALES)}). "
                                             "Default: the algorithm's own, group except dr_grpo's none. batch differs from "
                                             "--whiten_advantages: it scales sequence rewards by their std before the advantages "
                                             "reach the tokens and keeps each group's mean at 0; whitening re-centres and rescales "
                                             "the token advantages over the batch.")
    entropy_coef: float = arg(0.0, "Weight of the entropy bonus in the actor loss: loss - coef x entropy, the entropy of the "
                                   "training forward pass over the response tokens, aggregated like the policy loss.")
    ppo_epochs: int = arg(1, "Passes over each batch of experience.")
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose rewards are all equal; sample more prompts until the batch is full.")
    max_sampling_rounds: int = arg(4, "DAPO dynamic sampling: most generation rounds per step.")
    overlong_buffer_len: int = arg(0, "DAPO overlong shaping L_cache (0 = off): penalty from max_answer_seq_len - L_cache on.")
    overlong_penalty_factor: float = arg(1.0, "DAPO overlong shaping: penalty at max_answer_seq_len.")
    mask_truncated: bool = arg(False, "Leave truncated responses out of the policy loss (DAPO overlong filtering).")
    enable_ema: bool = arg(False, "Keep an exponential moving average of the actor (written as actor_ema/).")
    ema_beta: float = arg(0.992, "EMA decay.")


@dataclass
class Step3Train(AdamArgs, RunLengthArgs, RuntimeArgs):
    per_device_generation_batch_size: int = arg(4, "Prompts per rank per generation batch.")
    per_device_training_batch_size: int = arg(4, "Samples per rank per PPO mini-batch (one optimiser step each).")
    generation_batches: int = arg(1, "Generation batches collected before training.")
    actor_learning_rate: float = arg(1e-6, "Actor peak learning rate.")
    critic_learning_rate: float = arg(5e-6, "Critic peak learning rate.")
    freezing_actor_steps: int = arg(0, "Critic warm-up (OpenRLHF's flag): for the first N steps only the critic is "
                                       "trained; the actor, still the reference, is not updated. The value head starts "
                                       "from the reward model's score head, on another scale than the returns.")
    actor_weight_decay: float = arg(0.0, "Actor weight decay.")
    critic_weight_decay: float = arg(0.0, "Critic weight decay.")
    lr_scheduler_type: str = arg("constant_with_warmup", "Learning-rate schedule of actor and critic.")
    actor_zero_stage: int = arg(0, "ZeRO stage of the actor (and the reference).")
    critic_zero_stage: int = arg(0, "ZeRO stage of the critic (and the reward model).")
    offload_reference_model: bool = arg(False, "Keep the reference model's parameters in CPU memory (ZeRO-3 offload).")
    offload_reward_model: bool = arg(False, "Keep the reward model's parameters in CPU memory (ZeRO-3 offload).")
    actor_lora_dim: int = arg(0, "Actor LoRA rank (0: off).")
    actor_lora_module_name: str = arg("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "Actor LoRA target modules.")
    critic_lora_dim: int = arg(0, "Critic LoRA rank (0: off).")
    critic_lora_module_name: str = arg("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "Critic LoRA target modules.")
    only_optimize_lora: bool = arg(False, "Train only LoRA weights (and the critic's value head).")


@dataclass
class Step3Config(Step3Models, Step3Data, Step3Generation, Step3Algo, Step3Train, LogArgs):
    """Every flag of step 3. The properties below are the values derived from them, computed here once."""

    def validate(self) -> None:
        require(self, "actor_model_name_or_path", "data_path", "output_dir")
        if isinstance(self.reward_fn, str):  # a config file's single name
            self.reward_fn = [self.reward_fn]
        for flag in ("actor_zero_stage", "critic_zero_stage"):
            if getattr(self, flag) not in (0, 1, 2, 3):
                raise ConfigError(f"--{flag} {getattr(self, flag)} is out of range: use 0, 1, 2 or 3")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"--dtype {self.dtype}: use bf16, fp16 or fp32")
        if self.algo not in ALGOS:
            raise ConfigError(f"--algo {self.algo}: choose one of {', '.join(ALGOS)}")
        if self.kl_placement is not None and self.kl_placement not in KL_PLACEMENTS:
            raise ConfigError(f"--kl_placement {self.kl_placement}: use one of {', '.join(KL_PLACEMENTS)}")
        spec = self.spec
        if spec.needs_critic and not self.critic_model_name_or_path:
            raise ConfigError(f"--algo {self.algo} trains a critic: pass --critic_model_name_or_path (a step-2 reward model)")
        parse_report_to(self.report_to)
        if isinstance(self.reward_url, str):
            self.reward_url = [self.reward_url]
        if isinstance(self.judge, str):
            self.judge = [self.judge]
        if len(set(self.judge)) < len(self.judge):
            raise ConfigError(f"--judge {self.judge}: a judge is given twice; each judge once")
        if not (self.reward_fn or self.reward_url or self.reward_model_name_or_path or self.critic_model_name_or_path):
            raise ConfigError("no reward: pass --reward_model_name_or_path (or --critic_model_name_or_path), --reward_fn "
                              "and/or --reward_url")
        if self.freezing_actor_steps < 0 or (self.freezing_actor_steps and not spec.needs_critic):
            raise ConfigError(f"--freezing_actor_steps {self.freezing_actor_steps}: a critic warm-up, for --algo ppo only "
                              "(>= 0)")
        if spec.needs_groups and self.n_samples_per_prompt < 2:
            raise ConfigError(f"--algo {self.algo} compares samples of a prompt: set --n_samples_per_prompt >= 2")
        self.validate_objective(spec)
        if self.kl_estimator is None:
            self.kl_estimator = spec.kl_estimator
        if self.whiten_advantages is None:
            self.whiten_advantages = spec.whiten_advantages
        if self.empty_reward not in ("min", "keep"):
            try:
                float(self.empty_reward)
            except ValueError:
                raise ConfigError(f"--empty_reward {self.empty_reward}: use min, keep or a number") from None
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"--kl_estimator {self.kl_estimator}: use one of {', '.join(KL_ESTIMATORS)}")
        if spec.kl_in_loss and self.kl_estimator == "k1":
            warnings.warn("--kl_estimator k1 in the loss: on the policy's own samples its gradient is 0 in expectation, so "
                          "it does not keep the actor near the reference; k3 (the default there) does", stacklevel=2)
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ConfigError(f"--rollout_backend {self.rollout_backend}: choose one of {', '.join(ROLLOUT_BACKENDS)}")
        for name in ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches", "ppo_epochs",
                     "max_prompt_seq_len", "max_answer_seq_len", "eval_n_samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1")
        if self.per_device_eval_batch_size is not None and self.per_device_eval_batch_size < 1:
            raise ConfigError("--per_device_eval_batch_size must be >= 1")
        if self.samples_per_rank % self.per_device_training_batch_size:
            raise ConfigError(
                f"--per_device_training_batch_size {self.per_device_training_batch_size} must divide the samples per rank per step "
                f"({self.per_device_generation_batch_size} prompts x {self.generation_batches} batches x {self.n_samples_per_prompt} samples "
                f"= {self.samples_per_rank})")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("--max_steps must be >= 1")

    def validate_objective(self, spec: AlgoSpec) -> None:
        """The loss and advantage settings: the algorithm's defaults filled in, then checked."""
        self.loss_agg = self.loss_agg or spec.loss_agg
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ConfigError(f"--loss_agg {self.loss_agg}: use one of {', '.join(LOSS_AGG_MODES)}")
        if self.loss_norm_constant is None:
            self.loss_norm_constant = float(self.max_answer_seq_len)
        if self.loss_norm_constant <= 0:
            raise ConfigError(f"--loss_norm_constant must be > 0, got {self.loss_norm_constant}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ConfigError(f"--policy_loss {self.policy_loss}: use one of {', '.join(POLICY_LOSSES)}")
        if self.scale_rewards is not None and spec.advantage != "grpo":
            raise ConfigError(f"--scale_rewards applies to group-relative advantages (grpo, dapo, dr_grpo), not --algo {self.algo}")
        self.scale_rewards = self.scale_rewards or spec.scale_rewards
        if self.scale_rewards not in REWARD_SCALES:
            raise ConfigError(f"--scale_rewards {self.scale_rewards}: use one of {', '.join(REWARD_SCALES)}")
        if self.entropy_coef < 0:
            raise ConfigError(f"--entropy_coef must be >= 0 (a bonus), got {self.entropy_coef}")

    @property
    def spec(self) -> AlgoSpec:
        """The algorithm's registry entry (:mod:`rlhfkit.rl`), with the KL where ``--kl_placement`` puts it."""
        return with_kl_placement(ALGOS[self.algo], self.kl_placement)

    @property
    def samples_per_rank(self) -> int:
        """Samples each rank trains on per step."""
        return self.per_device_generation_batch_size * self.generation_batches * self.n_samples_per_prompt

    @property
    def updates_per_step(self) -> int:
        """Optimiser steps of the actor (and critic) per PPO step: one per mini-batch, each epoch."""
        return self.ppo_epochs * self.samples_per_rank // self.per_device_training_batch_size

    @property
    def old_logprobs_from_training(self) -> bool:
        """With one update per batch the policy being trained IS the one that sampled, so that update's
        own forward pass gives the "old" logprobs (detached) and the experience pass skips the actor (as
        TRL and verl do). Not when the KL goes into the reward: the advantages need it before training."""
        return self.updates_per_step == 1 and not self.spec.kl_in_reward

    @property
    def packed_group_size(self) -> int:
        """G when every pass over a batch runs each group of G samples as one row (``--pack_groups``), else 1.

        One layout for the actor's and the reference's passes and the updates makes the first update's
        ratio exactly 1 and the KL to the reference exactly 0 while the policy is the reference (in bf16
        packed and unpacked rows round differently). With several updates a batch, mini-batches then
        hold whole groups, so G must divide them; otherwise nothing is packed."""
        G = self.n_samples_per_prompt
        whole_groups = self.old_logprobs_from_training or self.per_device_training_batch_size % G == 0
        return G if self.pack_groups and whole_groups else 1

    def total_steps(self, prompt_batches_per_epoch: int) -> int:
        """PPO steps of the run: the epochs over the prompts, capped by ``--max_steps``."""
        steps_per_epoch = max(1, prompt_batches_per_epoch // self.generation_batches)
        return min(self.max_steps or 10**12, steps_per_epoch * self.num_train_epochs)

    @property
    def clip_eps(self) -> tuple[float, float]:
        """(low, high) clip range: the flags, else GSPO's sequence-ratio range (3e-4, 4e-4, the paper's), else the
        algorithm's own (DAPO), else --cliprange."""
        gspo = GSPO_CLIP_EPS if self.policy_loss.startswith("gspo") else None
        default_low, default_high = gspo or self.spec.clip_eps or (self.cliprange, self.cliprange)
        return (self.clip_eps_low if self.clip_eps_low is not None else default_low,
                self.clip_eps_high if self.clip_eps_high is not None else default_high)

    @property
    def critic_path(self) -> Optional[str]:
        """The step-2 model the critic starts from, for algorithms that train one."""
        return self.critic_model_name_or_path if self.spec.needs_critic else None

    @property
    def reward_path(self) -> Optional[str]:
        """The frozen reward model: --reward_model_name_or_path, else the critic's step-2 model."""
        return self.reward_model_name_or_path or self.critic_model_name_or_path

    @property
    def rollout_options(self) -> RolloutOptions:
        """The rollout backend's options (each backend reads those it has)."""
        return RolloutOptions(keep_copy=self.keep_inference_copy, inference_tp_size=self.inference_tp_size,
                              release_inference_cache=self.release_inference_cache, pin_parameters=not self.unpin_actor_parameters,
                              tp_gather_partition_size=self.tp_gather_partition_size)

    @property
    def backend(self) -> str:
        """The rollout backend (``--enable_hybrid_engine`` is DeepSpeed-Chat's name for ``deepspeed``)."""
        return "deepspeed" if self.enable_hybrid_engine else self.rollout_backend
