#!/usr/bin/env bash
# Rejection sampling (best-of-n) fine-tuning on the embedded SmolLM2-135M-Instruct: sample 8 answers per prompt,
# keep the best-scored one per prompt (math verifier), then SFT on the kept answers.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/rejection-sampling}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
write_jsonl(arithmetic_rows(256, seed=1, system="You are a helpful assistant."), "runs/data/arith_train.jsonl")
PY
.venv/bin/rlhfkit batch-inference \
  --eval_task generate_vllm --pretrain embedded:smollm2-135m-instruct --vllm_kv_cache_mb 1024 \
  --dataset runs/data/arith_train.jsonl --input_key input --label_key label --apply_chat_template --enforce_eager \
  --best_of_n 8 --temperature 1.0 --max_new_tokens 24 \
  --remote_rm_url builtin:math --post_processor rs --output_path "$RUN/best_of_8.jsonl"
.venv/bin/rlhfkit sft \
  --pretrain embedded:smollm2-135m-instruct --dataset "$RUN/best_of_8.jsonl" \
  --input_key input --output_key output --input_template "{}" --max_len 256 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 5e-6 \
  --run_dir "$RUN/sft" --save_path "$RUN/model" "$@"
