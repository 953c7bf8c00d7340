#!/usr/bin/env bash
# Tool-use agent RL through an OpenAI-compatible endpoint: examples/agents/openai_calculator_agent.py defines
# `async def run_agent(base_url, prompt, label)`, talks to the policy with the `openai` client (the calculator is
# a `tool` message), and returns the reward; rlhfkit trains on the sampled tokens of every call (docs/agents.md).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/agent-openai}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
write_jsonl(arithmetic_rows(256, seed=1, low=100, high=999), "runs/data/calc_openai_train.jsonl")
PY
.venv/bin/rlhfkit ppo \
  --pretrain embedded:smollm2-135m-instruct \
  --prompt_data runs/data/calc_openai_train.jsonl --input_key input --label_key label \
  --agent_func_path examples/agents/openai_calculator_agent.py --agent_action_max_len 32 --generate_max_len 160 \
  --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 4 \
  --train_batch_size 32 --micro_train_batch_size 8 --temperature 0.7 \
  --actor_learning_rate 3e-6 --lr_warmup_ratio 0 --init_kl_coef 0 \
  --vllm_kv_cache_mb 1024 --enforce_eager \
  --ckpt_path "$RUN/ckpt" --run_dir "$RUN" --save_path "$RUN/model" "$@"
