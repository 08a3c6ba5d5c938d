#!/usr/bin/env bash
# Steps 1 -> 2 -> 3 on several nodes, ZeRO-3, launched from one node over ssh/pdsh
# (DeepSpeed-Chat's multi_node/run_66b.sh).
#   HOSTFILE=launch/multi_node/hostfile bash launch/multi_node/run_135m.sh [RUN_DIR] [ZERO_STAGE]
# Needs passwordless ssh to every host and a shared file system (see ./hostfile).
# Without ssh: run_135m_no_ssh.sh on every node.
set -euo pipefail
L="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN=${1:-$L/../runs/multi_node}
ZERO=${2:-3}
export HOSTFILE=${HOSTFILE:-$L/multi_node/hostfile}
# export MASTER_ADDR=10.0.0.1   # node 0's address, when `ssh FIRST_HOST hostname -I` is not the right one
BASE_OPT=(); [ -z "${BASE:-}" ] || BASE_OPT=(--model "$BASE")

bash "$L/step1_sft.sh" --run_dir "$RUN" "${BASE_OPT[@]}" --zero_stage "$ZERO" \
  --per_device_train_batch_size 4 --max_seq_len 512 --enable_tensorboard
bash "$L/step2_reward.sh" --run_dir "$RUN" --zero_stage "$ZERO" \
  --per_device_train_batch_size 4 --max_seq_len 512 --enable_tensorboard
bash "$L/step3_ppo.sh" --run_dir "$RUN" --actor_zero_stage "$ZERO" --critic_zero_stage "$ZERO" \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 --enable_tensorboard
