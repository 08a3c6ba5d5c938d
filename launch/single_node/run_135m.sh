#!/usr/bin/env bash
# Steps 1 -> 2 -> 3 on one node with 8 GPUs, ZeRO-3 (DeepSpeed-Chat's single_node/run_1.3b.sh).
#   bash launch/single_node/run_135m.sh [RUN_DIR] [ZERO_STAGE]
# NUM_GPUS=4 for a 4-GPU node; BASE=/path/to/hf_model for another base model.
set -euo pipefail
L="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN=${1:-$L/../runs/single_node}
ZERO=${2:-3}
export NUM_GPUS=${NUM_GPUS:-8}
BASE_OPT=(); [ -z "${BASE:-}" ] || BASE_OPT=(--model "$BASE")

bash "$L/step1_sft.sh" --run_dir "$RUN" "${BASE_OPT[@]}" --zero_stage "$ZERO" \
  --per_device_train_batch_size 8 --max_seq_len 512 --learning_rate 9.65e-6 --num_train_epochs 1 --enable_tensorboard

bash "$L/step2_reward.sh" --run_dir "$RUN" --zero_stage "$ZERO" \
  --per_device_train_batch_size 8 --max_seq_len 512 --learning_rate 5e-6 --enable_tensorboard

bash "$L/step3_ppo.sh" --run_dir "$RUN" --actor_zero_stage "$ZERO" --critic_zero_stage "$ZERO" \
  --per_device_generation_batch_size 8 --per_device_training_batch_size 8 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 --enable_tensorboard
  # faster rollouts on CUDA with DeepSpeed's hybrid engine: --enable_hybrid_engine
