#!/usr/bin/env bash
# Bradley-Terry reward model on synthetic preference pairs, with the chat template. MODEL defaults to the embedded
# SmolLM2-135M-Instruct (a fresh `score` head is put on it); MODEL=tiny builds a 2-layer random-init model instead.
# The saved folder loads with AutoModelForSequenceClassification and carries reward_mean/reward_std in config.json.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/rm-example}
MODEL=${MODEL:-embedded:smollm2-135m-instruct}
.venv/bin/python - "$MODEL" <<'PY'
import sys
from rlhfkit.data.synthetic import preference_rows, write_jsonl
write_jsonl(preference_rows(256, seed=1), "runs/data/pairs_train.jsonl")
write_jsonl(preference_rows(64, seed=2), "runs/data/pairs_eval.jsonl")
if sys.argv[1] == "tiny":
    from rlhfkit.models.tiny import build_tiny_causal_lm
    build_tiny_causal_lm("runs/data/tiny_lm")
PY
[ "$MODEL" = tiny ] && MODEL=runs/data/tiny_lm
.venv/bin/rlhfkit rm \
  --pretrain "$MODEL" --dataset runs/data/pairs_train.jsonl --eval_dataset runs/data/pairs_eval.jsonl \
  --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template --max_len 128 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 2e-5 \
  --run_dir "$RUN" --save_path "$RUN/model" "$@"
