"""Option groups of the online RL command (`rlhfkit ppo`, OpenRLHF's `train_ppo_ray`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import CheckpointOptions, LoggingOptions, ModelOptions, TrainOptions, opt


@dataclass
class PlacementOptions:
    """Ray placement"""

    ray_address: str | None = opt(None, "join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    actor_num_nodes: int = opt(1, "nodes of the policy (actor) group")
    actor_num_gpus_per_node: int = opt(1, "ranks per node of the actor group (GPUs; CPU bundles without GPUs)")
    ref_num_nodes: int = opt(1, "nodes of the reference group")
    ref_num_gpus_per_node: int = opt(1, "ranks per node of the reference group")
    critic_num_nodes: int = opt(1, "nodes of the critic group")
    critic_num_gpus_per_node: int = opt(1, "ranks per node of the critic group")
    reward_num_nodes: int = opt(1, "nodes of the reward-model group")
    reward_num_gpus_per_node: int = opt(1, "ranks per node of the reward-model group")
    colocate_actor_ref: bool = opt(False, "actor and reference share bundles")
    colocate_critic_reward: bool = opt(False, "critic and reward model share bundles")
    colocate_all_models: bool = opt(False, "every model and the vLLM engines share the same bundles")
    torch_threads_per_worker: int = opt(0, "torch threads in each model worker (0: torch's default)")


@dataclass
class RolloutOptions:
    """Rollout (vLLM)"""

    rollout_backend: str = opt("vllm", "generation backend", choices=["vllm", "hf"])
    vllm_num_engines: int = opt(1, "rollout engines")
    vllm_tensor_parallel_size: int = opt(1, "tensor parallel size of each engine")
    vllm_gpu_memory_utilization: float = opt(0.9, "GPU memory fraction for vLLM (on CPU: see "
                                                  "--vllm_kv_cache_mb)")
    vllm_kv_cache_mb: int = opt(256, "CPU only: host RAM for each engine's KV cache, in MiB")
    vllm_dtype: str = opt("auto", "engine dtype; auto = the trainer's (--param_dtype). On CPU, bf16 generates about "
                                  "2x faster than fp32; pair it with --enable_vllm_is_correction",
                          choices=["auto", "bf16", "fp16", "fp32"])
    vllm_sync_backend: str = opt("ray", "weight transport to the engines (ray object store)", choices=["ray", "nccl"])
    vllm_enable_sleep: bool = opt(False, "put colocated engines to sleep while training (CUDA only)")
    enforce_eager: bool = opt(False, "disable CUDA graphs in vLLM")
    enable_prefix_caching: bool = opt(False, "vLLM prefix caching")
    weight_sync_bucket_mb: int = opt(64, "weight sync bucket size in MiB")
    prompt_max_len: int = opt(1024, "prompts longer than this (tokens) are dropped and counted")
    generate_max_len: int = opt(1024, "maximum new tokens per response")
    temperature: float = opt(1.0, "sampling temperature (trainer log-probs use the same)")
    top_p: float = opt(1.0, "nucleus sampling (keep 1.0 for on-policy log-probs)")
    n_samples_per_prompt: int = opt(1, "responses per prompt (a group)")
    rollout_batch_size: int = opt(1024, "prompts per step")
    micro_rollout_batch_size: int = opt(8, "rows per forward when computing log-probs/values")
    eval_temperature: float = opt(0.6, "sampling temperature for --eval_dataset")
    eval_n_samples_per_prompt: int = opt(4, "samples per eval prompt (pass@k for k up to this)")


@dataclass
class RLAlgorithmOptions:
    """Algorithm"""

    advantage_estimator: str = opt("gae", "advantage estimator", choices=["gae", "reinforce", "reinforce_baseline",
                                                                          "group_norm", "dr_grpo", "rloo"])
    num_episodes: int = opt(1, "passes over the prompt set")
    max_epochs: int = opt(1, "PPO epochs over each rollout buffer")
    train_batch_size: int = opt(128, "samples per optimizer step (global)")
    micro_train_batch_size: int = opt(4, "samples per forward/backward per rank")
    actor_learning_rate: float = opt(1e-6, "policy learning rate")
    critic_learning_rate: float = opt(9e-6, "critic learning rate")
    eps_clip: float = opt(0.2, "PPO clip range")
    eps_clip_low_high: list[float] | None = opt(None, "asymmetric clip (low high), overrides --eps_clip")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1")
    value_clip: float | None = opt(0.5, "value clipping range")
    gamma: float = opt(1.0, "discount")
    lambd: float = opt(1.0, "GAE lambda")
    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss)")
    kl_estimator: str = opt("k1", "KL estimator", choices=["k1", "k2", "k3"])
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty")
    entropy_loss_coef: float | None = opt(None, "entropy bonus coefficient")
    reward_clip_range: list[float] = opt([-10.0, 10.0], "clip sequence rewards to (low high)")
    no_advantage_std_norm: bool = opt(False, "do not divide advantages by their std")
    dynamic_filtering: bool = opt(False, "drop groups whose mean score is outside the range (all equal), refill")
    dynamic_filtering_reward_range: list[float] = opt([0.0, 1.0], "keep groups with low < mean score < high")
    enable_vllm_is_correction: bool = opt(False, "importance-sampling correction of rollout/trainer mismatch")
    vllm_is_truncated_threshold: list[float] = opt([0.5, 5.0], "IS weight range (low high)")
    vllm_is_correction_type: str = opt("tis", "tis: clamp; icepop: zero outside", choices=["tis", "icepop"])
    use_dynamic_batch: bool = opt(False, "training micro-batches by token budget instead of row count")
    train_max_tokens_per_gpu: int = opt(16192, "token budget per micro-batch with --use_dynamic_batch")
    freezing_actor_steps: int = opt(-1, "train only the critic for the first N steps")


@dataclass
class RewardOptions:
    """Rewards"""

    reward_pretrain: str | None = opt(None, "reward model(s), comma-separated")
    remote_rm_url: str | None = opt(None, "reward source(s): http(s) URLs, a reward_func .py file, or builtin:NAME")
    reward_timeout: float = opt(60.0, "seconds a reward function / remote RM may take per batch")
    reward_error_policy: str = opt("raise", "raise: stop on a failing reward; zero: score it 0 and count it",
                                   choices=["raise", "zero"])
    critic_pretrain: str | None = opt(None, "critic initialisation (default: the reward model, else --pretrain)")
    ref_pretrain: str | None = opt(None, "reference model (default: --pretrain)")


@dataclass
class PromptDataOptions:
    """Data"""

    prompt_data: str | None = opt(None, "prompt datasets, comma-separated")
    prompt_data_probs: str | None = opt(None, "mixing probabilities for --prompt_data")
    prompt_split: str = opt("train", "split of --prompt_data")
    eval_dataset: str | None = opt(None, "held-out prompts (pass@k)")
    eval_split: str = opt("train", "split of --eval_dataset")
    max_samples: int = opt(100_000_000, "use at most this many prompts")
    input_key: str = opt("input", "key of the prompt")
    label_key: str | None = opt(None, "key of the label passed to the reward function")
    input_template: str | None = opt(None, "template with one {} for the prompt")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "override the tokenizer's chat template")
    eval_steps: int = opt(-1, "evaluate every N steps (-1: at the start and the end)")


RL_GROUPS: list[type] = [PlacementOptions, RolloutOptions, RLAlgorithmOptions, RewardOptions, PromptDataOptions,
                         ModelOptions, TrainOptions, CheckpointOptions, LoggingOptions]
