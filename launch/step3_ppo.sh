#!/usr/bin/env bash
# Step 3: PPO (or --algo grpo/dapo/rloo/reinforce++ ...) -> step3_ppo/main.py (DeepSpeed-Chat step 3).
#
#   launch/step3_ppo.sh [--actor SFT_DIR] [--critic RM_DIR] [--data PATH...] [--output OUT]
#                       [--algo ppo] [--actor_zero_stage 3] [--critic_zero_stage 3]
#                       [--dtype bf16] [--run_dir DIR] [PROGRAM FLAGS...]
#
# --actor    step-1 checkpoint (default: RUN_DIR/step1)           -> --actor_model_name_or_path
# --critic   step-2 reward model (default: RUN_DIR/step2)         -> --critic_model_name_or_path
# --data     one or more data paths (default: ../shared/data/hh-rlhf-harmless-base/pairs.jsonl.gz)
#                                                                 -> --data_path
# --output   run directory; actor/ and critic/ go under it (default: RUN_DIR/step3) -> --output_dir
# --algo     ppo (default) or another algorithm of step3_ppo     -> --algo
# --actor_zero_stage / --critic_zero_stage  ZeRO stages (default 3 / 3)
# --run_dir  where defaults live (default: <repo>/runs/default)
# Every other flag goes to step3_ppo/main.py unchanged, e.g. --per_device_generation_batch_size 2
# --max_prompt_seq_len 128 --max_answer_seq_len 64 --actor_lora_dim 128 --offload_reference_model.
# Launcher settings (NUM_GPUS, HOSTFILE, NO_SSH, MASTER_PORT, DRY_RUN, ...): see launch/common.sh.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rk_option actor ""
rk_option critic ""
rk_option data "$RK_DEFAULT_DATA" list
rk_option output ""
rk_option algo ppo
rk_option actor_zero_stage 3
rk_option critic_zero_stage 3
rk_option dtype bf16
rk_option run_dir "$RK_DEFAULT_RUN_DIR"
rk_parse "$@"

ACTOR=${ACTOR:-$RUN_DIR/step1}
CRITIC=${CRITIC:-$RUN_DIR/step2}
OUTPUT=${OUTPUT:-$RUN_DIR/step3}
run_stage step3_ppo/main.py \
  --actor_model_name_or_path "$ACTOR" \
  --critic_model_name_or_path "$CRITIC" \
  --data_path "${DATA[@]}" \
  --output_dir "$OUTPUT" \
  --algo "$ALGO" \
  --actor_zero_stage "$ACTOR_ZERO_STAGE" \
  --critic_zero_stage "$CRITIC_ZERO_STAGE" \
  --dtype "$DTYPE" \
  "${RK_PASSTHROUGH[@]}"
