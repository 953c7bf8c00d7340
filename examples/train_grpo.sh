#!/usr/bin/env bash
# GRPO on the embedded SmolLM2-135M-Instruct with a rule reward (what `make demo` runs), on a CPU laptop.
# Swap --advantage_estimator for reinforce | reinforce_baseline | dr_grpo | rloo to try the other critic-free methods.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/grpo-example}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
write_jsonl(arithmetic_rows(256, seed=1, system="You are a helpful assistant."), "runs/data/arith_train.jsonl")
write_jsonl(arithmetic_rows(64, seed=1000, system="You are a helpful assistant."), "runs/data/arith_eval.jsonl")
PY
.venv/bin/rlhfkit ppo \
  --pretrain embedded:smollm2-135m-instruct \
  --prompt_data runs/data/arith_train.jsonl --eval_dataset runs/data/arith_eval.jsonl \
  --input_key input --label_key label --apply_chat_template \
  --remote_rm_url examples/reward_funcs/math_reward.py \
  --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 4 \
  --train_batch_size 32 --micro_train_batch_size 8 --generate_max_len 24 --temperature 0.7 \
  --actor_learning_rate 3e-6 --lr_warmup_ratio 0 --init_kl_coef 0 \
  --enable_vllm_is_correction --vllm_kv_cache_mb 1024 --enforce_eager \
  --save_steps 8 --ckpt_path "$RUN/ckpt" --run_dir "$RUN" --save_path "$RUN/model" "$@"
