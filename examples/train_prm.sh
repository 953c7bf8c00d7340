#!/usr/bin/env bash
# Process reward model: every step of the synthetic processes ends with the placeholder "§" (one token for SmolLM2's
# tokenizer); the model learns to put "+" (good step) or "-" (bad step) there. Afterwards, score steps with
#   from rlhfkit.trainers.prm import prm_step_scores
#   prm_step_scores(model, tokenizer, ["red sun is right§\nmud ash is wrong§"], placeholder_token="§",
#                   reward_tokens=["+", "-"])   # -> [[p_good_step1, p_good_step2]]
# MODEL=tiny: a 2-layer random-init model.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/prm-example}
MODEL=${MODEL:-embedded:smollm2-135m-instruct}
.venv/bin/python - "$MODEL" <<'PY'
import sys
from rlhfkit.data.synthetic import process_rows, write_jsonl
write_jsonl(process_rows(256, seed=1), "runs/data/prm_train.jsonl")
write_jsonl(process_rows(64, seed=2), "runs/data/prm_eval.jsonl")
if sys.argv[1] == "tiny":
    from rlhfkit.models.tiny import build_tiny_causal_lm
    build_tiny_causal_lm("runs/data/tiny_lm")
PY
[ "$MODEL" = tiny ] && MODEL=runs/data/tiny_lm
.venv/bin/rlhfkit prm \
  --pretrain "$MODEL" --dataset runs/data/prm_train.jsonl --eval_dataset runs/data/prm_eval.jsonl \
  --input_key input --label_key label --placeholder_token "§" --reward_tokens + - --max_len 128 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 2e-5 \
  --run_dir "$RUN" --save_path "$RUN/model" "$@"
