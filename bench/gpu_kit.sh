#!/usr/bin/env bash
# Wheels for issue 24's GPU run, built here (where the package registry is) into .whl/, and the prompts
# of bench/gpu_step3.py into .gpu/: the GPU machine's image has torch 2.11 (Python 3.12), transformers 5.17
# and peft, but no deepspeed (nor its pydantic) and no registry. Both folders are git-ignored; the device
# run carries them (bench/gpu_run.sh says how). Run from a checkout whose .venv is set up
# (launch/setup_env.sh) and that has run the pipeline once (its base model's tokenizer is read).
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
rm -rf .whl .gpu && mkdir -p .whl .gpu
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# DeepSpeed publishes a source archive only: build a pure-Python wheel (its CUDA ops compile on first use)
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(ver deepspeed)"
py312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in transformers hjson pydantic pydantic_core annotated_types typing_inspection; do
  pip download -q --no-deps "${py312[@]}" -d .whl "$pkg==$(ver "$pkg")"
done
TOKENIZER=${TOKENIZER:-runs/pipeline-small/base}
mkdir -p .gpu/tokenizer
cp "$TOKENIZER"/tokenizer*.json "$TOKENIZER"/chat_template.jinja "$TOKENIZER"/special_tokens_map.json .gpu/tokenizer/ 2>/dev/null || true
cp "$TOKENIZER"/config.json .gpu/tokenizer/  # AutoTokenizer reads the model type from it
python bench/gpu_step3.py --tokenizer .gpu/tokenizer --prepare_prompts .gpu/prompts256.jsonl --prompt 256 --batch 8 --steps 3
du -sh .whl .gpu
ls .whl
