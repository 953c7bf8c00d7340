#!/usr/bin/env bash
# Multi-turn agent RL on the embedded SmolLM2-135M-Instruct: GRPO where a wrong answer hears "That is not right. Try
# again" and may answer again (at most 3 attempts; reward 1/attempt). The environment is examples/agents/retry_env.py.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/agent-retry}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
write_jsonl(arithmetic_rows(256, seed=1, system="You are a helpful assistant."), "runs/data/arith_train.jsonl")
write_jsonl(arithmetic_rows(64, seed=1000, system="You are a helpful assistant."), "runs/data/arith_eval.jsonl")
PY
.venv/bin/rlhfkit ppo \
  --pretrain embedded:smollm2-135m-instruct \
  --prompt_data runs/data/arith_train.jsonl --eval_dataset runs/data/arith_eval.jsonl \
  --input_key input --label_key label --apply_chat_template \
  --agent_func_path examples/agents/retry_env.py --agent_action_max_len 16 --generate_max_len 96 \
  --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 4 \
  --train_batch_size 32 --micro_train_batch_size 8 --temperature 0.7 \
  --actor_learning_rate 3e-6 --lr_warmup_ratio 0 --init_kl_coef 0 \
  --enable_vllm_is_correction --vllm_kv_cache_mb 1024 --enforce_eager \
  --save_steps 8 --ckpt_path "$RUN/ckpt" --run_dir "$RUN" --save_path "$RUN/model" "$@"
