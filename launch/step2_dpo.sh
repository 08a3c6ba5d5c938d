#!/usr/bin/env bash
# Step 2 (alternative): DPO on preference pairs -> step2_dpo/main.py; its output is an actor, no step 3.
#
#   launch/step2_dpo.sh [--model SFT_DIR] [--data PATH...] [--output OUT] [--zero_stage 3]
#                       [--dtype bf16] [--run_dir DIR] [PROGRAM FLAGS...]
#
# --model    step-1 checkpoint, also the frozen reference (default: RUN_DIR/step1)
#                                                                 -> --model_name_or_path
# --data     one or more data paths (default: ../shared/data/hh-rlhf-harmless-base/pairs.jsonl.gz)
#                                                                 -> --data_path
# --output   checkpoint directory (default: RUN_DIR/step2_dpo)    -> --output_dir
# --run_dir  where defaults live (default: <repo>/runs/default)
# Every other flag goes to step2_dpo/main.py unchanged (e.g. --beta 0.1).
# Launcher settings (NUM_GPUS, HOSTFILE, NO_SSH, MASTER_PORT, DRY_RUN, ...): see launch/common.sh.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rk_supervised_options "$@"

MODEL=${MODEL:-$RUN_DIR/step1}
OUTPUT=${OUTPUT:-$RUN_DIR/step2_dpo}
rk_run_supervised step2_dpo/main.py
