#!/usr/bin/env bash
# CPU smoke test of the whole pipeline: the `tiny` preset (a handful of steps per stage) with the
# default model, 2 CPU ranks (NUM_RANKS to change), GPUs ignored even where present.
#
#   launch/cpu_smoke.sh [--out RUN_DIR] [pipeline.sh options...]
# Default RUN_DIR: <repo>/runs/cpu-smoke (delete it to start over; finished stages are skipped).
LAUNCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RLHFKIT_CPU=1 NUM_GPUS="${NUM_RANKS:-2}"
exec bash "$LAUNCH/pipeline.sh" --size tiny --out "$LAUNCH/../runs/cpu-smoke" "$@"
