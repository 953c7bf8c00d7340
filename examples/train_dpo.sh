#!/usr/bin/env bash
# DPO on synthetic preference pairs (add --ipo for IPO, --label_smoothing 0.1 for cDPO, --nll_loss_coef 0.2 for an
# NLL term on the chosen answers). Reference log-probs are precomputed once before training (--ref_mode precompute,
# the default; --ref_mode live runs the reference beside the policy). MODEL=tiny: a 2-layer random-init model.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/dpo-example}
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
.venv/bin/rlhfkit dpo \
  --pretrain "$MODEL" --dataset runs/data/pairs_train.jsonl --eval_dataset runs/data/pairs_eval.jsonl \
  --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template --max_len 128 \
  --beta 0.1 --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 5e-6 \
  --run_dir "$RUN" --save_path "$RUN/model" "$@"
