#!/usr/bin/env bash
# Steps 1 -> 2 -> 3 on several nodes WITHOUT ssh (deepspeed --no_ssh): run this same command on
# every node at about the same time, each with its own NODE_RANK:
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 NUM_NODES=2 bash launch/multi_node/run_135m_no_ssh.sh RUN_DIR   # node 0
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 NUM_NODES=2 bash launch/multi_node/run_135m_no_ssh.sh RUN_DIR   # node 1
# MASTER_ADDR is node 0's address (the same everywhere); MASTER_PORT defaults to 29500 and must be
# free on node 0. NUM_GPUS: GPUs per node (default: all). HOSTFILE may replace NUM_NODES.
# RUN_DIR must be on a shared file system: node 0 writes the checkpoints, every node reads them.
set -euo pipefail
L="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN=${1:?usage: NODE_RANK=R MASTER_ADDR=ADDR NUM_NODES=N $0 RUN_DIR [ZERO_STAGE]}
ZERO=${2:-3}
export NO_SSH=1
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
BASE_OPT=(); [ -z "${BASE:-}" ] || BASE_OPT=(--model "$BASE")

bash "$L/step1_sft.sh" --run_dir "$RUN" "${BASE_OPT[@]}" --zero_stage "$ZERO" \
  --per_device_train_batch_size 4 --max_seq_len 512
bash "$L/step2_reward.sh" --run_dir "$RUN" --zero_stage "$ZERO" \
  --per_device_train_batch_size 4 --max_seq_len 512
bash "$L/step3_ppo.sh" --run_dir "$RUN" --actor_zero_stage "$ZERO" --critic_zero_stage "$ZERO" \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256
