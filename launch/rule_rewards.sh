#!/usr/bin/env bash
# A rule-rewarded run: GRPO from the base model with the gsm8k reward (exact final answer, plus a
# bonus for stating it as "#### n"), judged on held-out problems before and after: accuracy and
# format rate, each with its paired 95% CI (step 3's summary, and actor/rlhfkit.json).
#
#   launch/rule_rewards.sh [--task gsm8k|arithmetic] [--out RUN_DIR] [--model BASE_DIR]
#                          [--steps N] [--step3_args "..."]
#
# --task   gsm8k (default): ../shared/data/gsm8k/test_first1000.jsonl (mgsm/mgsm_en.tsv adds
#          nothing: its 250 problems are GSM8K's first 250; given both, they are read once);
#          arithmetic: `rlhfkit make-arithmetic --level easy` problems (seeded, one operation)
# --out    run directory (default: <repo>/runs/rules-TASK): base/, data/, grpo/
# --model  start from this checkpoint instead of `rlhfkit prepare-base`
# --steps  GRPO steps (default: the task's preset below)
# --step3_args  extra step3_ppo/main.py flags, word-split; they come last and win
# Launcher settings (NUM_GPUS, HOSTFILE, NO_SSH, MASTER_PORT, DRY_RUN, ...): see launch/common.sh.

# ---- task presets: tune here --------------------------------------------------------------------
# 2 ranks x 2 prompts x 8 samples a step, rollouts at temperature 0.7, actor lr 3e-5; the held-out
# problems (20% of the file, at most 256) get one greedy answer each (pass@1), before and after.
# Why: SmolLM2-135M's temperature-1 samples ramble (70% of GSM8K answers cut at 192 tokens) and solved
# 0 of 24 arithmetic problems (at 0.7: 5 of 96); at lr 1e-5 (and 3e-5 at temperature 1) GSM8K's format
# rate stayed at 0-9% of training samples for 9-11 steps. Gradient checkpointing: a packed group of 8
# responses of 256 tokens took 11 GB a rank without it, 5.6 GB with it.
# arithmetic: `make-arithmetic --level easy` (one operation, numbers up to 20) and a one-line answer.
# On 96 problems of another seed (never the run's), the base model's samples at 0.7 were right 6% of
# the time on the mixed level (28% of problems had a right one in 8) and 21% on easy (70%), and the
# step-by-step suffix halved its greedy accuracy on mixed (6 vs 14 of 96) against the one-line one.
COT="Let's think step by step and output the final answer after \"####\"."
ONE_LINE="Show the calculation in one line, then the final answer after \"####\"."
preset() {
  case "$1" in
    gsm8k)
      DATA=("$(realpath -m "$REPO/../shared/data/gsm8k/test_first1000.jsonl")")
      PRESET_STEPS=40  ANSWER_SEQ=192  LR=3e-5  SUFFIX=$COT ;;
    arithmetic)
      DATA=("$RUN/data/arithmetic-easy.jsonl")
      PRESET_STEPS=60  ANSWER_SEQ=96  LR=3e-5  SUFFIX=$ONE_LINE ;;
    *) rk_die "--task $1: use gsm8k or arithmetic" ;;
  esac
}
# -------------------------------------------------------------------------------------------------

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rk_option task gsm8k
rk_option out ""
rk_option model ""
rk_option steps ""
rk_option step3_args ""
rk_parse "$@"
[ ${#RK_PASSTHROUGH[@]} -eq 0 ] || rk_die "unknown argument(s): ${RK_PASSTHROUGH[*]} (use --step3_args for program flags)"
RUN=${OUT:-$REPO/runs/rules-$TASK}
mkdir -p "$RUN"
RUN=$(cd "$RUN" && pwd)
preset "$TASK"
STEPS=${STEPS:-$PRESET_STEPS}
read -r -a STEP3_EXTRA <<<"$STEP3_ARGS"
rk_log "rule-rewarded run: task=$TASK run=$RUN"

if [ -z "$MODEL" ]; then
  MODEL=$RUN/base
  rk_prepare_base "$MODEL"
fi
if [ "$TASK" = arithmetic ] && [ ! -f "${DATA[0]}" ]; then
  rk_exec "$RK_RLHFKIT" make-arithmetic --out "${DATA[0]}" --n 2000 --seed 0 --level easy
fi

run_stage step3_ppo/main.py \
  --algo grpo --actor_model_name_or_path "$MODEL" --data_path "${DATA[@]}" --data_split 0,0,1 \
  --output_dir "$RUN/grpo" --actor_zero_stage 3 --dtype bf16 \
  --reward_fn gsm8k --format_bonus 0.5 \
  --prompt_suffix "$SUFFIX" \
  --n_samples_per_prompt 8 --per_device_generation_batch_size 2 --per_device_training_batch_size 16 \
  --max_answer_seq_len "$ANSWER_SEQ" --actor_learning_rate "$LR" --kl_ctl 0.04 --max_steps "$STEPS" \
  --temperature 0.7 --eval_fraction 0.2 --max_eval_samples 256 --eval_greedy --actor_gradient_checkpointing \
  "${STEP3_EXTRA[@]}"
rk_log "done: actor = $RUN/grpo/actor; held-out accuracy and format before/after: the summary above, $RUN/grpo/actor/rlhfkit.json"
