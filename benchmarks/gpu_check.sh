#!/usr/bin/env bash
# The trainers on a lent GPU machine (issue #32), in one call of the device tool. Prepare here first:
#   .venv/bin/python benchmarks/gpu_check.py prepare .gpucheck     # tokenizer files + data
#   benchmarks/gpu_wheels.sh                                       # what the GPU image lacks, as wheels
# then, on the GPU machine (carry .gpucheck):  bash benchmarks/gpu_check.sh [--only sft,dpo] [--steps 8]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpucheck/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! python3 -c "import datasets" 2>"$OUT/datasets_import.txt"; then  # the image's pyarrow/fsspec too old for it
  echo "datasets (newest) does not import here; the older set:"; tail -2 "$OUT/datasets_import.txt"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 \
    .gpucheck/whl/alt/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site2:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|datasets|trl|pyarrow|fsspec|huggingface.hub) '
python3 benchmarks/gpu_check.py run .gpucheck "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
RLHFKIT_GPU_CHECK_TOKENIZER=$PWD/.gpucheck/tok timeout 400 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" | tail -25
exit $(( status || PIPESTATUS[0] ))
