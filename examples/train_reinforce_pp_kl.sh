#!/usr/bin/env bash
# REINFORCE++-baseline with a reference model and a k3 KL loss (GRPO-style KL), dynamic filtering of groups
# whose samples all score the same, and pass@k evaluation. Run examples/train_grpo.sh once first for the data.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/reinforce-pp-example}
.venv/bin/rlhfkit ppo \
  --pretrain embedded:smollm2-135m-instruct \
  --prompt_data runs/data/arith_train.jsonl --eval_dataset runs/data/arith_eval.jsonl \
  --input_key input --label_key label --apply_chat_template --remote_rm_url builtin:math \
  --advantage_estimator reinforce_baseline --n_samples_per_prompt 8 --rollout_batch_size 4 \
  --dynamic_filtering --dynamic_filtering_reward_range 0 1 \
  --init_kl_coef 0.001 --use_kl_loss --kl_estimator k3 \
  --train_batch_size 32 --micro_train_batch_size 8 --generate_max_len 24 --temperature 0.7 \
  --actor_learning_rate 3e-6 --enable_vllm_is_correction \
  --vllm_kv_cache_mb 1024 --enforce_eager --run_dir "$RUN" --save_path "$RUN/model" "$@"
