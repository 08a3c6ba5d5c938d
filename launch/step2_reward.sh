#!/usr/bin/env bash
# Step 2: pairwise reward model -> step2_reward/main.py (DeepSpeed-Chat step 2).
#
#   launch/step2_reward.sh [--model SFT_DIR] [--data PATH...] [--output OUT] [--zero_stage 3]
#                          [--dtype bf16] [--run_dir DIR] [PROGRAM FLAGS...]
#
# --model    step-1 checkpoint (default: RUN_DIR/step1)           -> --model_name_or_path
# --data     one or more data paths (default: ../shared/data/hh-rlhf-harmless-base/pairs.jsonl.gz)
#                                                                 -> --data_path
# --output   checkpoint directory (default: RUN_DIR/step2)        -> --output_dir
# --run_dir  where defaults live (default: <repo>/runs/default)
# Every other flag goes to step2_reward/main.py unchanged.
# Launcher settings (NUM_GPUS, HOSTFILE, NO_SSH, MASTER_PORT, DRY_RUN, ...): see launch/common.sh.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rk_supervised_options "$@"

MODEL=${MODEL:-$RUN_DIR/step1}
OUTPUT=${OUTPUT:-$RUN_DIR/step2}
rk_run_supervised step2_reward/main.py
