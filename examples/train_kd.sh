#!/usr/bin/env bash
# Knowledge distillation: the embedded SmolLM2-135M-Instruct teaches a 2-layer random-init student that shares its
# tokenizer; loss = (1 - kd_coef) * SFT NLL + kd_coef * KL(teacher || student) on the response tokens.
# Watch eval/kd_kl fall in "$RUN/metrics.jsonl".
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/kd-example}
TEACHER=${TEACHER:-embedded:smollm2-135m-instruct}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.models.tiny import build_tiny_causal_lm
write_jsonl(echo_rows(256, seed=1), "runs/data/echo_train.jsonl")
write_jsonl(echo_rows(64, seed=2), "runs/data/echo_eval.jsonl")
build_tiny_causal_lm("runs/data/tiny_student")
PY
.venv/bin/rlhfkit kd \
  --pretrain runs/data/tiny_student --teacher_model "$TEACHER" \
  --dataset runs/data/echo_train.jsonl --eval_dataset runs/data/echo_eval.jsonl \
  --input_key input --output_key output --apply_chat_template --max_len 96 --kd_coef 0.5 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 2 --learning_rate 3e-3 \
  --run_dir "$RUN" --save_path "$RUN/model" "$@"
