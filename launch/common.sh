#!/usr/bin/env bash
# Shared code of the rlhfkit launchers; `source` it from a stage script, never run it.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#   rk_option model ""                  # --model VALUE        -> $MODEL
#   rk_option data "$RK_DEFAULT_DATA" list   # --data P1 [P2 ...] -> ${DATA[@]}
#   rk_parse "$@"                       # everything else     -> ${RK_PASSTHROUGH[@]}
#   run_stage step1_sft/main.py --model_name_or_path "$MODEL" ... "${RK_PASSTHROUGH[@]}"
#
# Launcher settings (environment variables, or the same names as options: --num_gpus 8 ...):
#   NUM_GPUS     ranks per node. Default: every GPU nvidia-smi finds (or CUDA_VISIBLE_DEVICES
#                lists); with no GPU, CPU mode with NUM_RANKS ranks.
#   NUM_RANKS    ranks on a CPU machine (default 2).
#   RLHFKIT_CPU=1  force CPU mode even where GPUs exist (DS_ACCELERATOR=cpu, no visible GPUs).
#   HOSTFILE     multi-node: `deepspeed --hostfile $HOSTFILE` (lines `host slots=N`, launched over ssh/pdsh).
#   NO_SSH=1     DeepSpeed's per-node mode: run the same command on every node with its NODE_RANK
#                (0..N-1) and node 0's MASTER_ADDR; needs HOSTFILE or NUM_NODES (a hostfile of
#                NUM_NODES x NUM_GPUS is then written to /tmp; in this mode host names are not used).
#   NUM_NODES    number of nodes (with HOSTFILE: use its first NUM_NODES hosts).
#   MASTER_ADDR  node 0's address (multi-node).
#   MASTER_PORT  rendezvous port. Default: a free port on one node; 29500 across nodes (all nodes
#                must agree).
#   DEEPSPEED_ARGS  extra launcher flags, word-split (e.g. "--include localhost:0,1" or "--launcher slurm").
#   OMP_NUM_THREADS  CPU mode sets it to cores / ranks per node unless already set.
#   DRY_RUN=1    print the commands, run nothing.
#   RLHFKIT_NO_SETUP=1  do not source launch/setup_env.sh (use the deepspeed already on PATH or in $VENV).
# The training dtype is never changed: --dtype bf16 runs on CPU too.
set -euo pipefail

RK_LAUNCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$RK_LAUNCH/.." && pwd)"
# shellcheck disable=SC2034  # used by the scripts that source this file
RK_DEFAULT_DATA="$(realpath -m "$REPO/../shared/data/hh-rlhf-harmless-base/pairs.jsonl.gz")"
# shellcheck disable=SC2034
RK_DEFAULT_RUN_DIR="$REPO/runs/default"

rk_log() { echo "[launch] $*"; }
rk_die() { echo "[launch] error: $*" >&2; exit 2; }

# ---------------------------------------------------------------------------------------------
# Options: `--name value`, `--name=value`; a list option takes every value up to the next `--flag`.

declare -A RK_OPT_VAR=() RK_OPT_LIST=()
RK_PASSTHROUGH=()

# rk_option NAME DEFAULT [list]: declare --NAME, stored in the upper-case variable (--zero_stage -> ZERO_STAGE).
rk_option() {
  local name=$1 default=$2 var
  var=$(tr '[:lower:]-' '[:upper:]_' <<<"$name")
  RK_OPT_VAR[$name]=$var
  if [ "${3:-}" = list ]; then
    RK_OPT_LIST[$name]=1
    declare -ga "$var"
    local -n rk_list_ref=$var
    rk_list_ref=()
    if [ -n "$default" ]; then rk_list_ref=("$default"); fi
  else
    printf -v "$var" '%s' "$default"
  fi
}

# Launcher settings: the environment gives the default, an option overrides it.
rk_launcher_option() {
  local name=$1 var
  var=$(tr '[:lower:]' '[:upper:]' <<<"$name")
  RK_OPT_VAR[$name]=$var
  printf -v "$var" '%s' "${!var:-}"
}
for _rk in num_gpus num_ranks num_nodes node_rank hostfile master_addr master_port; do rk_launcher_option "$_rk"; done
unset _rk
NO_SSH="${NO_SSH:-0}"
DRY_RUN="${DRY_RUN:-0}"
RLHFKIT_CPU="${RLHFKIT_CPU:-0}"

rk_usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

rk_parse() {
  local arg name value var
  while [ $# -gt 0 ]; do
    arg=$1
    case "$arg" in
      -h|--help) rk_usage; exit 0 ;;
      --no_ssh) NO_SSH=1; shift; continue ;;
      --cpu) RLHFKIT_CPU=1; shift; continue ;;
      --dry_run) DRY_RUN=1; shift; continue ;;
      --*) ;;
      *) RK_PASSTHROUGH+=("$arg"); shift; continue ;;
    esac
    name=${arg#--}; value=""
    local has_value=0
    if [[ $name == *=* ]]; then value=${name#*=}; name=${name%%=*}; has_value=1; fi
    if [ -z "${RK_OPT_VAR[$name]+x}" ]; then
      RK_PASSTHROUGH+=("$arg"); shift; continue      # not ours: the program's (its value follows as a plain word)
    fi
    var=${RK_OPT_VAR[$name]}
    shift
    if [ -n "${RK_OPT_LIST[$name]+x}" ]; then
      # shellcheck disable=SC2178  # a nameref to the list variable
      local -n rk_list_ref=$var
      rk_list_ref=()
      if [ $has_value = 1 ]; then rk_list_ref+=("$value"); fi
      while [ $# -gt 0 ] && [[ $1 != --* ]]; do rk_list_ref+=("$1"); shift; done
      [ ${#rk_list_ref[@]} -gt 0 ] || rk_die "--$name needs at least one value"
      unset -n rk_list_ref
    else
      if [ $has_value = 0 ]; then
        [ $# -gt 0 ] || rk_die "--$name needs a value"
        value=$1; shift
      fi
      printf -v "$var" '%s' "$value"
    fi
  done
  # Child launchers (pipeline -> stage scripts) inherit the launcher settings given as options.
  for name in num_gpus num_ranks num_nodes node_rank hostfile master_addr master_port; do
    var=${RK_OPT_VAR[$name]}
    if [ -n "${!var}" ]; then export "${var?}"; fi
  done
  export NO_SSH DRY_RUN RLHFKIT_CPU
  rk_setup
}

# ---------------------------------------------------------------------------------------------
# Environment: the venv (launch/setup_env.sh) unless RLHFKIT_NO_SETUP=1.

rk_setup() {
  if [ "${RLHFKIT_NO_SETUP:-0}" != 1 ] && [ "${RK_SETUP_DONE:-0}" != 1 ]; then
    # shellcheck source=launch/setup_env.sh
    source "$RK_LAUNCH/setup_env.sh"
    export RK_SETUP_DONE=1     # children of this launcher (pipeline stages) reuse it
  fi
  if [ -n "${VENV:-}" ] && [ -x "$VENV/bin/deepspeed" ]; then
    RK_DEEPSPEED="$VENV/bin/deepspeed"; RK_RLHFKIT="$VENV/bin/rlhfkit"
  else
    RK_DEEPSPEED=deepspeed; RK_RLHFKIT=rlhfkit
  fi
  RK_DEEPSPEED="${DEEPSPEED:-$RK_DEEPSPEED}"
}

# ---------------------------------------------------------------------------------------------
# Topology.

rk_count_gpus() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  if [ "$n" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
  fi
  echo "$n"
}

rk_cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN; }

# Slots of the first host of a hostfile (ranks per node when NUM_GPUS is not given).
rk_hostfile_slots() {
  awk '{sub(/#.*/, "")} NF { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { sub(/^slots=/, "", $i); print $i; exit } print 1; exit }' "$1"
}

rk_free_port() {
  "${RK_PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# Sets RK_ENV (VAR=VALUE words for the command) and RK_LAUNCHER (deepspeed's own flags).
rk_resolve_launcher() {
  RK_ENV=(); RK_LAUNCHER=()
  if [ -n "${VENV:-}" ] && [ -x "$VENV/bin/python" ]; then RK_PYTHON="$VENV/bin/python"; else RK_PYTHON=python3; fi
  local gpus cpu=0 local_ranks multi=0
  [ -z "$HOSTFILE" ] || [ -f "$HOSTFILE" ] || rk_die "HOSTFILE $HOSTFILE does not exist"
  if [ "$RLHFKIT_CPU" = 1 ]; then
    cpu=1
    export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
  else
    gpus=$(rk_count_gpus)
    [ "$gpus" -gt 0 ] || cpu=1
  fi
  if [ -n "$NUM_GPUS" ]; then
    local_ranks=$NUM_GPUS
  elif [ -n "$HOSTFILE" ]; then
    local_ranks=$(rk_hostfile_slots "$HOSTFILE")
  elif [ $cpu = 1 ]; then
    local_ranks=${NUM_RANKS:-2}
  else
    local_ranks=$gpus
  fi
  [[ $local_ranks =~ ^[1-9][0-9]*$ ]] || rk_die "ranks per node must be a positive integer (got '$local_ranks')"

  if [ $cpu = 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
    local cores; cores=$(rk_cores)
    RK_ENV+=("OMP_NUM_THREADS=$(( cores / local_ranks > 0 ? cores / local_ranks : 1 ))")
  fi

  if [ "$NO_SSH" = 1 ]; then
    multi=1
    [ -n "$NODE_RANK" ] || rk_die "NO_SSH=1 needs NODE_RANK (this node's index, 0..N-1)"
    [ -n "$MASTER_ADDR" ] || rk_die "NO_SSH=1 needs MASTER_ADDR (node 0's address, the same on every node)"
    local hostfile=$HOSTFILE
    if [ -z "$hostfile" ]; then
      [ -n "$NUM_NODES" ] || rk_die "NO_SSH=1 needs HOSTFILE or NUM_NODES"
      hostfile="${TMPDIR:-/tmp}/rlhfkit-$(id -u)-hostfile-${NUM_NODES}x${local_ranks}"
      local i tmp="$hostfile.$$"
      for (( i = 0; i < NUM_NODES; i++ )); do echo "node$i slots=$local_ranks"; done >"$tmp"
      mv -f "$tmp" "$hostfile"
    fi
    RK_LAUNCHER+=(--hostfile "$hostfile" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR")
    [ -z "$NUM_NODES" ] || RK_LAUNCHER+=(--num_nodes "$NUM_NODES")
    RK_LAUNCHER+=(--num_gpus "$local_ranks")
  elif [ -n "$HOSTFILE" ]; then
    multi=1
    RK_LAUNCHER+=(--hostfile "$HOSTFILE")
    [ -z "$NUM_NODES" ] || RK_LAUNCHER+=(--num_nodes "$NUM_NODES")
    [ -z "$NUM_GPUS" ] || RK_LAUNCHER+=(--num_gpus "$NUM_GPUS")
    [ -z "$MASTER_ADDR" ] || RK_LAUNCHER+=(--master_addr "$MASTER_ADDR")
  elif [ $cpu = 0 ] && [ -z "$NUM_GPUS" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    # deepspeed --num_gpus would ignore CUDA_VISIBLE_DEVICES and take GPUs 0..N-1
    RK_LAUNCHER+=(--include "localhost:$CUDA_VISIBLE_DEVICES")
  else
    RK_LAUNCHER+=(--num_gpus "$local_ranks")
  fi
  local port=$MASTER_PORT
  if [ -z "$port" ]; then
    if [ $multi = 1 ]; then port=29500; else port=$(rk_free_port); fi
  fi
  RK_LAUNCHER+=(--master_port "$port")
  if [ -n "${DEEPSPEED_ARGS:-}" ]; then
    local extra; read -r -a extra <<<"$DEEPSPEED_ARGS"
    RK_LAUNCHER+=("${extra[@]}")
  fi
}

# ---------------------------------------------------------------------------------------------
# Running.

# rk_show CMD...: the command as one copy-pasteable line.
rk_quote() {
  if [[ -n $1 && $1 != *[!A-Za-z0-9_./:=,+@%-]* ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
rk_show() {
  local s="[launch]" a
  for a in "$@"; do s+=" $(rk_quote "$a")"; done
  echo "$s"
}

# rk_exec CMD...: print, then run unless DRY_RUN=1.
rk_exec() {
  rk_show "$@"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# run_stage SCRIPT ARGS...: `deepspeed [launcher flags] $REPO/SCRIPT ARGS...`, printed first, then
# run with its output also appended to OUTPUT_DIR/logs/train.log (OUTPUT_DIR from --output_dir;
# logs/ is kept when the program renames its finished checkpoint into place; nodes other than
# node 0 of a NO_SSH run write logs/train.nodeR.log).
run_stage() {
  local script=$1; shift
  [ -f "$REPO/$script" ] || [ "$DRY_RUN" = 1 ] || rk_die "$REPO/$script does not exist"
  rk_resolve_launcher
  local cmd=()
  [ ${#RK_ENV[@]} -eq 0 ] || cmd+=(env "${RK_ENV[@]}")
  cmd+=("$RK_DEEPSPEED" "${RK_LAUNCHER[@]}" "$REPO/$script" "$@")
  local shown; shown=$(rk_show "${cmd[@]}")
  shown=${shown/\[launch\] env /[launch] }     # show `VAR=value deepspeed ...`, as one would type it
  echo "$shown"
  [ "$DRY_RUN" = 1 ] && return 0
  command -v "$RK_DEEPSPEED" >/dev/null 2>&1 || rk_die "'$RK_DEEPSPEED' not found: source launch/setup_env.sh (or unset RLHFKIT_NO_SETUP)"

  local out="" i
  for (( i = 1; i <= $#; i++ )); do
    case "${!i}" in
      --output_dir) local j=$(( i + 1 )); out=${!j:-} ;;
      --output_dir=*) out=${!i#--output_dir=} ;;
    esac
  done
  if [ -z "$out" ]; then
    rk_run_passing_signals "" "${cmd[@]}"
    return
  fi
  local log="$out/logs/train.log"
  if [ "$NO_SSH" = 1 ] && [ "${NODE_RANK:-0}" != 0 ]; then log="$out/logs/train.node$NODE_RANK.log"; fi
  mkdir -p "$out/logs"
  { echo "=== $(date '+%F %T') $(hostname)"; echo "$shown"; } >>"$log"
  rk_log "log: $log"
  rk_run_passing_signals "$log" "${cmd[@]}"
}

# ---- preemption: a signal to this shell reaches the ranks ---------------------------------------
# `sbatch --signal=B:USR1@120` (and any kill of this script's pid) signals the batch shell only, and
# DeepSpeed's launcher passes neither SIGUSR1 nor, on one node, SIGTERM on. So the stage runs in the
# background while this shell waits; SIGTERM or SIGUSR1 to it goes to this node's ranks (the outermost
# processes below the launcher with LOCAL_RANK in their environment), which save a training state at the
# end of their step (the ranks agree, so one node's ranks are enough) and exit 75. The shell waits for
# them, and returns 75 when the log names the saved state. A signal to the whole job (srun, scancel)
# reaches the ranks directly as well; they ignore the repeats.
RK_PREEMPT_RANKS=()

# rk_rank_pids ROOT: the ranks among ROOT's descendants.
rk_rank_pids() {
  local p
  for p in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^LOCAL_RANK='; then echo "$p"; else rk_rank_pids "$p"; fi
  done
}

rk_pass_signal() {  # SIG ROOT
  local p
  mapfile -t RK_PREEMPT_RANKS < <(rk_rank_pids "$2")
  rk_log "SIG$1 received: passing it to the ranks (pids ${RK_PREEMPT_RANKS[*]:-none found})"
  for p in "${RK_PREEMPT_RANKS[@]}"; do kill -s "$1" "$p" 2>/dev/null || true; done
}

# rk_run_passing_signals LOG CMD...: run CMD (output also appended to LOG unless LOG is "") and return its
# status, or 75 after a passed-on signal whose save the log confirms.
rk_run_passing_signals() {
  local log=$1; shift
  RK_PREEMPT_RANKS=()
  if [ -n "$log" ]; then  # tee ignores the signals, so it outlives a signal to the whole job and logs the save
    ( trap - INT QUIT; exec "$@" > >(trap '' TERM USR1; exec tee -a "$log") 2>&1 ) &
  else
    ( trap - INT QUIT; exec "$@" ) &
  fi
  local pid=$! rc
  trap 'rk_pass_signal TERM '"$pid" TERM
  trap 'rk_pass_signal USR1 '"$pid" USR1
  while :; do
    rc=0; wait "$pid" || rc=$?
    if [ "$rc" -le 128 ] || ! kill -0 "$pid" 2>/dev/null; then break; fi  # else a trap ended the wait
  done
  trap - TERM USR1
  local p waited=0
  for p in "${RK_PREEMPT_RANKS[@]}"; do  # the launcher may go first; the ranks finish their save
    while kill -0 "$p" 2>/dev/null && [ $waited -lt 600 ]; do sleep 1; waited=$(( waited + 1 )); done
  done
  sleep 0.2  # tee's last lines
  if [ ${#RK_PREEMPT_RANKS[@]} -gt 0 ] && [ "$rc" != 0 ] && [ -n "$log" ] \
     && grep -q 'training state saved in' < <(tail -n 50 "$log"); then
    rk_log "preempted: the training state is saved; rerun with --resume auto (a requeued SLURM job does this itself)"
    return 75
  fi
  return "$rc"
}

# rk_prepare_base DIR: `rlhfkit prepare-base --out DIR` unless DIR already holds a checkpoint.
rk_prepare_base() {
  local dir=$1
  if [ -f "$dir/rlhfkit.json" ]; then
    rk_log "base model: $dir (exists)"
  elif [ "$NO_SSH" = 1 ] && [ "${NODE_RANK:-0}" != 0 ]; then
    # per-node launches share the run directory: node 0 writes the base, the others wait for it
    rk_log "waiting for node 0 to write $dir"
    [ "$DRY_RUN" = 1 ] && return 0
    local waited=0
    until [ -f "$dir/rlhfkit.json" ]; do
      [ $waited -lt "${RK_WAIT_S:-3600}" ] || rk_die "$dir/rlhfkit.json did not appear (is node 0 running?)"
      sleep 5; waited=$(( waited + 5 ))
    done
  else
    rk_exec "$RK_RLHFKIT" prepare-base --out "$dir"
  fi
}

# The options and the launch shared by the supervised stages (step 1, step 2, DPO):
#   rk_supervised_options "$@"   --model --data --output --zero_stage --dtype --run_dir, the rest passes through
#   rk_run_supervised SCRIPT     run SCRIPT with the DeepSpeed-Chat flag names
rk_supervised_options() {
  rk_option model ""
  rk_option data "$RK_DEFAULT_DATA" list
  rk_option output ""
  rk_option zero_stage 3
  rk_option dtype bf16
  rk_option run_dir "$RK_DEFAULT_RUN_DIR"
  rk_parse "$@"
}
rk_run_supervised() {
  run_stage "$1" \
    --model_name_or_path "$MODEL" \
    --data_path "${DATA[@]}" \
    --output_dir "$OUTPUT" \
    --zero_stage "$ZERO_STAGE" \
    --dtype "$DTYPE" \
    "${RK_PASSTHROUGH[@]}"
}
