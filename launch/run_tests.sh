#!/usr/bin/env bash
# The test suite (what CI runs): sets up the venv if needed, then pytest on everything.
# GPU-only tests skip on CPU machines. Extra arguments go to pytest (e.g. -k sft, -m "not smoke").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source launch/setup_env.sh
export RLHFKIT_TEST_CACHE="${RLHFKIT_TEST_CACHE:-$REPO/.cache/tests}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q -ra --durations=30 "$@"
