#!/usr/bin/env bash
# Steps 1 -> 2 -> 3 on ONE GPU (DeepSpeed-Chat's single_gpu/run_1.3b.sh).
#   bash launch/single_gpu/run_135m.sh [RUN_DIR] [ZERO_STAGE]
# Base model: SmolLM2-135M via `rlhfkit prepare-base` (or BASE=/path/to/hf_model for another one).
# A model that does not fit: ZERO_STAGE=2 with --offload, and LoRA (the commented hints below).
set -euo pipefail
L="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN=${1:-$L/../runs/single_gpu}
ZERO=${2:-0}
export NUM_GPUS=1
BASE_OPT=(); [ -z "${BASE:-}" ] || BASE_OPT=(--model "$BASE")

bash "$L/step1_sft.sh" --run_dir "$RUN" "${BASE_OPT[@]}" --zero_stage "$ZERO" \
  --per_device_train_batch_size 8 --gradient_accumulation_steps 8 --max_seq_len 512 --enable_tensorboard
  # LoRA for a big model: --lora_dim 128 --only_optimize_lora --gradient_checkpointing

bash "$L/step2_reward.sh" --run_dir "$RUN" --zero_stage "$ZERO" \
  --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --max_seq_len 512 --enable_tensorboard

bash "$L/step3_ppo.sh" --run_dir "$RUN" --actor_zero_stage "$ZERO" --critic_zero_stage "$ZERO" \
  --per_device_generation_batch_size 8 --per_device_training_batch_size 8 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 --enable_tensorboard
  # LoRA / memory for a big model: --actor_lora_dim 128 --only_optimize_lora --actor_gradient_checkpointing
