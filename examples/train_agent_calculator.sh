#!/usr/bin/env bash
# Tool-use agent RL on the embedded SmolLM2-135M-Instruct: the model may write <calc>EXPRESSION</calc>, reads the
# <result>, then answers (examples/agents/calculator_env.py; reward 1 for a right answer, minus 0.05 per call).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/agent-calculator}
.venv/bin/python - <<'PY'
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
system = ("You can use a calculator: write <calc>EXPRESSION</calc> and stop; the result comes back as "
          "<result>VALUE</result>. Then reply with only the number.")
write_jsonl(arithmetic_rows(256, seed=1, low=100, high=999, system=system), "runs/data/calc_train.jsonl")
write_jsonl(arithmetic_rows(64, seed=1000, low=100, high=999, system=system), "runs/data/calc_eval.jsonl")
PY
.venv/bin/rlhfkit ppo \
  --pretrain embedded:smollm2-135m-instruct \
  --prompt_data runs/data/calc_train.jsonl --eval_dataset runs/data/calc_eval.jsonl \
  --input_key input --label_key label --apply_chat_template \
  --agent_func_path examples/agents/calculator_env.py --agent_action_max_len 32 --generate_max_len 160 \
  --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 4 \
  --train_batch_size 32 --micro_train_batch_size 8 --temperature 0.7 \
  --actor_learning_rate 3e-6 --lr_warmup_ratio 0 --init_kl_coef 0 \
  --enable_vllm_is_correction --vllm_kv_cache_mb 1024 --enforce_eager \
  --save_steps 8 --ckpt_path "$RUN/ckpt" --run_dir "$RUN" --save_path "$RUN/model" "$@"
