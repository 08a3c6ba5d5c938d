#!/usr/bin/env bash
# Step 1: supervised fine-tuning -> step1_sft/main.py (DeepSpeed-Chat step 1).
#
#   launch/step1_sft.sh [--model BASE_DIR] [--data PATH...] [--output OUT] [--zero_stage 3]
#                       [--dtype bf16] [--run_dir DIR] [PROGRAM FLAGS...]
#
# --model    base checkpoint or HF causal-LM dir (default: `rlhfkit prepare-base --out RUN_DIR/base`,
#            skipped when it exists)                              -> --model_name_or_path
# --data     one or more data paths (default: ../shared/data/hh-rlhf-harmless-base/pairs.jsonl.gz)
#                                                                 -> --data_path
# --output   checkpoint directory (default: RUN_DIR/step1)        -> --output_dir
# --run_dir  where defaults live (default: <repo>/runs/default)
# Every other flag goes to step1_sft/main.py unchanged, e.g. --max_steps 60 --max_seq_len 256
# --per_device_train_batch_size 4 --lora_dim 128 --gradient_checkpointing --offload.
# Launcher settings (NUM_GPUS, HOSTFILE, NO_SSH, MASTER_PORT, DRY_RUN, ...): see launch/common.sh.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rk_supervised_options "$@"

OUTPUT=${OUTPUT:-$RUN_DIR/step1}
if [ -z "$MODEL" ]; then
  MODEL=$RUN_DIR/base
  rk_prepare_base "$MODEL"
fi
rk_run_supervised step1_sft/main.py
