#!/usr/bin/env bash
# Issue 24's device run, in one command on the GPU machine (the device tool's run, with carry .whl and .gpu
# built by bench/gpu_kit.sh here first): installs the carried wheels into the image's Python, runs the
# gpu-marked tests and bench/gpu_step3.py, and leaves their output in $OUT (or ./gpu_out without it).
# The device call: command "bash bench/gpu_run.sh", carry [".whl", ".gpu"], timeout_s 600 (tests at most
# 200 s, the bench at most 330 s; the bench's JSON is written after each backend). Extra arguments go to
# the bench (e.g. --batch 16). Dry run here: OUT=/tmp/gout bash bench/gpu_run.sh --size tiny --answer 16 --batch 2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl 2>&1 | tail -3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout 200 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
timeout 330 python3 bench/gpu_step3.py --tokenizer .gpu/tokenizer --data .gpu/prompts256.jsonl --out "$OUT/bench_gpu_step3.json" \
  "$@" 2>&1 | tee "$OUT/bench_gpu_step3.txt" | grep -v "^\[20" | tail -30
