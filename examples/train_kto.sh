#!/usr/bin/env bash
# KTO on synthetic unpaired completions with boolean labels (true: desirable). MODEL=tiny: a 2-layer random-init model.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/kto-example}
MODEL=${MODEL:-embedded:smollm2-135m-instruct}
.venv/bin/python - "$MODEL" <<'PY'
import sys
from rlhfkit.data.synthetic import unpaired_rows, write_jsonl
write_jsonl(unpaired_rows(256, seed=1), "runs/data/kto_train.jsonl")
write_jsonl(unpaired_rows(64, seed=2), "runs/data/kto_eval.jsonl")
if sys.argv[1] == "tiny":
    from rlhfkit.models.tiny import build_tiny_causal_lm
    build_tiny_causal_lm("runs/data/tiny_lm")
PY
[ "$MODEL" = tiny ] && MODEL=runs/data/tiny_lm
.venv/bin/rlhfkit kto \
  --pretrain "$MODEL" --dataset runs/data/kto_train.jsonl --eval_dataset runs/data/kto_eval.jsonl \
  --input_key input --output_key output --label_key label --apply_chat_template --max_len 128 \
  --beta 0.1 --desirable_loss_weight 1.0 --undesirable_loss_weight 1.0 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 5e-6 \
  --run_dir "$RUN" --save_path "$RUN/model" "$@"
