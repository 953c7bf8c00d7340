#!/usr/bin/env bash
# Iterative DPO on the embedded SmolLM2-135M-Instruct: each round samples 4 answers per prompt from the current
# policy, scores them with the math verifier, pairs the best against the worst, and trains DPO on the pairs; the
# next round samples from the new policy. ROUNDS (default 2) rounds of PROMPTS (default 64) prompts each.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/iterative-dpo}
ROUNDS=${ROUNDS:-2}
PROMPTS=${PROMPTS:-64}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
write_jsonl(arithmetic_rows(1024, seed=1, system="You are a helpful assistant."), "runs/data/arith_train.jsonl")
PY
POLICY=embedded:smollm2-135m-instruct
for ((round = 0; round < ROUNDS; round++)); do
  .venv/bin/rlhfkit batch-inference \
    --eval_task generate_vllm --pretrain "$POLICY" --vllm_kv_cache_mb 1024 --enforce_eager \
    --dataset runs/data/arith_train.jsonl --input_key input --label_key label --apply_chat_template \
    --best_of_n 4 --temperature 1.0 --max_new_tokens 24 --iter "$round" --rollout_batch_size "$PROMPTS" \
    --remote_rm_url builtin:math --post_processor iter_dpo --output_path "$RUN/round$round/pairs.jsonl"
  .venv/bin/rlhfkit dpo \
    --pretrain "$POLICY" --dataset "$RUN/round$round/pairs.jsonl" \
    --prompt_key prompt --chosen_key chosen --rejected_key rejected --max_len 256 \
    --beta 0.1 --train_batch_size 4 --micro_train_batch_size 2 --max_epochs 1 --learning_rate 5e-7 \
    --run_dir "$RUN/round$round/dpo" --save_path "$RUN/round$round/model" "$@"
  POLICY="$RUN/round$round/model"
done
