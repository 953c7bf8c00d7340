"""Option groups of the online RL command (`rlhfkit ppo`, OpenRLHF's `train_ppo_ray`): the flags only ppo has.

ppo also composes the shared groups: the Ray cluster, vLLM engines and sampling (rlhfkit.config.engine_options,
with batch-inference), the reward sources (rlhfkit.config.reward_options, with batch-inference and serve-rm), the
reference model (rlhfkit.config.method_options, with dpo and kto) and the training groups (rlhfkit.config.options).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt


@dataclass
class PlacementOptions:
    """Ray placement"""

    actor_num_nodes: int = opt(1, "nodes of the policy (actor) group")
    actor_num_gpus_per_node: int = opt(1, "ranks per node of the actor group (GPUs; CPU bundles without GPUs)")
    ref_num_nodes: int = opt(1, "nodes of the reference group")
    ref_num_gpus_per_node: int = opt(1, "ranks per node of the reference group")
    critic_num_nodes: int = opt(1, "nodes of the critic group")
    critic_num_gpus_per_node: int = opt(1, "ranks per node of the critic group")
    reward_num_nodes: int = opt(1, "nodes of the reward-model group")
    reward_num_gpus_per_node: int = opt(1, "ranks per node of the reward-model group")
    colocate_actor_ref: bool = opt(False, "actor and reference share bundles (needs equal rank counts)")
    colocate_critic_reward: bool = opt(False, "critic and reward model(s) share bundles (needs equal rank counts)")
    colocate_all_models: bool = opt(False, "every model and the vLLM engines share the actor's bundles (hybrid "
                                           "engine; needs equal rank counts and vllm_num_engines x TP = actor ranks)")
    fsdp_enable_offload: bool = opt(False, "move the actor's and critic's parameters, gradients and optimizer state "
                                           "to host RAM while the engines generate, back for their own phases "
                                           "(OpenRLHF's --deepspeed_enable_sleep; CUDA only, a no-op on CPU)")
    ref_reward_offload: bool = opt(False, "keep the reference and reward models' parameters in host RAM, on the "
                                          "device only during their forwards (CUDA only, a no-op on CPU)")
    torch_threads_per_worker: int = opt(0, "torch threads in each model worker (0: on CPU, the node's cores "
                                                 "divided by the model ranks per node; Ray alone would give 1)")
    remote_call_timeout: float = opt(1800.0, "deadline in seconds of every Ray remote call of the loop (model "
                                             "groups, engines, weight sync, reward models): past it the run stops "
                                             "with an error naming the role, rank, node and method; engines also "
                                             "get a health check (ping, min(30 s, this)) before each step")
    max_engine_restarts: int = opt(3, "a rollout engine that dies or hangs is restarted (same options), given the "
                                      "actor's current weights, and the run goes on, at most this many times per "
                                      "run (0: stop at the first engine fault); only for engines the run created")
    engine_hang_timeout: float = opt(60.0, "seconds a rollout engine may leave its liveness probe unanswered while "
                                           "a call (generation, weight sync, scoring) runs before it is declared "
                                           "hung and handled like a dead one (restarted, or the run stops naming "
                                           "it). The probe runs on a thread of its own, so a long but live "
                                           "generation is never interrupted; a stopped or frozen engine is found "
                                           "within this + 5 s. 0: no probes (--remote_call_timeout alone)")
    trainer_hang_timeout: float = opt(60.0, "seconds a model-group rank (actor, reference, critic, reward model) "
                                            "may go without a heartbeat while a call to it runs before it is "
                                            "declared hung: killed, and the run stops with an error naming role, "
                                            "rank, node and method (resume with --load_checkpoint). Each rank beats "
                                            "every min(5 s, this / 4) from a thread of its own, so a long but live "
                                            "step is never interrupted; a stopped or frozen rank is found within "
                                            "this + 5 s. 0: no heartbeats (--remote_call_timeout alone)")


@dataclass
class RolloutOptions:
    """Rollout (vLLM)"""

    rollout_backend: str = opt("vllm", "generation backend", choices=["vllm", "hf"])
    vllm_tensor_parallel_size: int = opt(1, "tensor parallel size of each engine")
    vllm_dtype: str = opt("auto", "engine dtype; auto = the trainer's (--param_dtype, itself auto: bf16 where the "
                                  "hardware computes it natively, fp32 elsewhere). A bf16 engine beside an fp32 "
                                  "trainer: pair it with --enable_vllm_is_correction",
                          choices=["auto", "bf16", "fp16", "fp32"])
    vllm_sync_backend: str = opt("auto", "weight transport trainer -> engines: ray (object store, via the driver), "
                                         "gloo or nccl (torch.distributed broadcast from actor rank 0 into every "
                                         "engine worker; nccl needs GPUs, gloo is used without them, with a "
                                         "warning, and nccl cannot share a GPU: not with "
                                         "--colocate_all_models); auto = gloo on CPU (2.7x faster than ray in the RL "
                                         "loop there), nccl on GPU, ray on GPU with --colocate_all_models",
                                 choices=["auto", "ray", "gloo", "nccl"])
    vllm_enable_sleep: bool = opt(False, "put the engines to sleep (weights to host RAM, KV cache freed) outside "
                                         "generation; for --colocate_all_models (CUDA only, ignored on CPU)")
    weight_sync_bucket_mb: int = opt(64, "weight sync bucket size in MiB")
    lora_sync: str = opt("merged", "with --lora_rank: what a weight sync sends. merged: the full weights with the "
                                   "adapters merged in; adapter: only the LoRA A/B tensors, the vLLM engines serve "
                                   "the base model plus the adapter (vLLM LoRA: generation pays for the LoRA ops, see "
                                   "docs/models.md); auto = adapter where the engines can serve it, else merged "
                                   "(the reason logged)",
                         choices=["auto", "adapter", "merged"])
    sync_logprob_tolerance: float | None = opt(None, "after weights reach the engines (start and every sync), the "
                                                     "mean |engine - trainer| log-prob on a fixed probe must stay "
                                                     "under this, or the run stops naming the engine; default: 1e-3 "
                                                     "in fp32; with bf16/fp16 0.25 at start, then max(0.01, 4 x "
                                                     "the diff measured at start); 0 = off")
    logprobs_truncation: str = opt("auto", "with --top_k / --top_p: auto = the trainer's log-probs (old, current, "
                                           "reference) are those of the truncated, renormalised distribution the "
                                           "engines sample from and report, so the PPO ratio and the "
                                           "engine/trainer mismatch compare like with like (docs/rollout.md); "
                                           "off = the whole tempered softmax (the bias every ratio then carries)",
                                   choices=["auto", "off"])
    generate_max_len: int = opt(1024, "maximum new tokens per response (alias --max_new_tokens, OpenRLHF's "
                                      "--rollout.max_new_tokens); with --max_len a prompt of p tokens gets "
                                      "min(this, max_len - p)", aliases=["--max_new_tokens"])
    generate_min_len: int = opt(0, "at least this many new tokens per response: EOS and the stop tokens are masked "
                                   "until then (vLLM's min_tokens, HF generate's min_new_tokens), capped by what "
                                   "--generate_max_len and --max_len allow; 0: off. For runs at a forced length "
                                   "(make bench-peers's forced-256/512 workloads): the sampler then draws from a "
                                   "distribution without EOS, which the trainer's log-probs do not model")
    n_samples_per_prompt: int = opt(1, "responses per prompt (a group)")
    micro_rollout_batch_size: int = opt(8, "rows per forward when computing log-probs/values")
    eval_temperature: float = opt(0.6, "sampling temperature for --eval_dataset")
    eval_n_samples_per_prompt: int = opt(4, "samples per eval prompt (pass@k for k up to this)")


@dataclass
class AdvantageOptions:
    """Algorithm"""

    advantage_estimator: str = opt("gae", "advantage estimator; on_policy_distill: on-policy distillation, the "
                                          "advantage of each sampled token is --opd_kl_coef x (log pi_teacher - log "
                                          "pi_student) (the negative sampled reverse KL to --teacher_model) plus "
                                          "--opd_reward_weight x the task advantage; no critic; flash_reinforce "
                                          "(FlashREINFORCE, Molt): r - the mean reward of the whole batch, no std, "
                                          "no whitening, for one sample per prompt (docs/algorithms.md)",
                                   choices=["gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo",
                                            "flash_reinforce", "on_policy_distill"])
    opd_kl_coef: float = opt(1.0, "on_policy_distill: weight of the per-token reverse-KL term (slime's "
                                  "opd-kl-coef setting); > 0")
    opd_reward_weight: float = opt(0.0, "on_policy_distill: weight of the task advantage added to every token "
                                        "(the clipped sequence reward, minus its group mean with "
                                        "--n_samples_per_prompt >= 2); 0: pure distillation, the reward is only "
                                        "logged")
    num_episodes: int = opt(1, "passes over the prompt set")
    gamma: float = opt(1.0, "discount (gae and reinforce only: the group estimators need 1)")
    lambd: float = opt(1.0, "GAE lambda")
    reward_clip_range: list[float] = opt([-10.0, 10.0], "clip sequence rewards to (low high)")
    no_advantage_std_norm: bool = opt(False, "do not divide advantages by their std")
    dynamic_filtering: bool = opt(False, "drop groups whose mean score is outside the range (all equal), refill")
    dynamic_filtering_reward_range: list[float] = opt([0.0, 1.0], "keep groups with low < mean score < high")
    freezing_actor_steps: int = opt(-1, "train only the critic for the first N steps")


@dataclass
class PolicyLossOptions:
    """Policy and value loss"""

    policy_loss_type: str = opt("ppo", "ppo: one importance ratio per token; gspo (GSPO): one per sequence, "
                                       "exp(mean over its tokens of log pi - log pi_old), clipped as a whole and "
                                       "the loss averaged per sequence (the paper clips at 3e-4 / 4e-4: set "
                                       "--eps_clip_low_high; OpenRLHF keeps --eps_clip); cispo (CISPO, MiniMax-M1): "
                                       "-sg[clip(ratio, 1 - eps_low, 1 + eps_high)] x A x log pi, token mean, the "
                                       "range from --eps_clip / --eps_clip_low_high (as verl; the paper has no lower "
                                       "bound: --eps_clip_low_high 1 EPS_HIGH); not with --dual_clip",
                                choices=["ppo", "gspo", "cispo"])
    eps_clip: float = opt(0.2, "PPO clip range")
    eps_clip_low_high: list[float] | None = opt(None, "asymmetric clip (low high), overrides --eps_clip")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1")
    value_clip: float | None = opt(0.5, "value clipping range")
    entropy_loss_coef: float | None = opt(None, "entropy bonus coefficient")
    ptx_coef: float = opt(0.05, "weight of the auxiliary LM loss on --pretrain_data added to every policy step")
    recompute_old_log_probs: bool = opt(False, "always compute the PPO ratio's old log-probs in a separate forward "
                                               "pass; by default, when a rollout makes exactly one optimizer step "
                                               "(one mini-batch, --max_epochs 1, no reward-side KL), they are the "
                                               "training pass's own (detached), which saves that pass")


@dataclass
class KLOptions:
    """KL to the reference model"""

    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss)")
    kl_target: float | None = opt(None, "adaptive KL (Ziegler et al.): after each step the coefficient becomes "
                                        "beta (1 + clip(KL / kl_target - 1, +-0.2) x rows / --kl_horizon), from "
                                        "--init_kl_coef; logged as train/kl_coef. Unset: fixed")
    kl_horizon: int = opt(10000, "horizon of the adaptive KL controller (--kl_target), in samples")
    kl_estimator: str = opt("k1", "KL estimator", choices=["k1", "k2", "k3"])
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty")
    use_unbiased_kl: bool = opt(False, "with --use_kl_loss: weight each token's KL estimate by the differentiable "
                                       "ratio pi / pi_old (DeepSeek-V3.2), which makes the k3 loss's gradient "
                                       "unbiased for grad KL(pi || pi_ref)")


@dataclass
class ISCorrectionOptions:
    """Rollout/trainer mismatch correction (importance sampling)"""

    enable_vllm_is_correction: bool = opt(False, "importance-sampling correction of rollout/trainer mismatch")
    vllm_is_truncated_threshold: list[float] = opt([0.5, 5.0], "IS weight range (low high)")
    vllm_is_correction_type: str = opt("tis", "tis: clamp each token's weight; icepop: zero the tokens outside "
                                              "the range; seq-mask-tis: zero whole sequences whose geometric-mean "
                                              "weight is outside it (each a cell of the grid below: token x clip, "
                                              "token x mask, geo x mask)", choices=["tis", "icepop", "seq-mask-tis"])
    is_correction_level: str | None = opt(None, "with --enable_vllm_is_correction and --is_correction_mode: the unit "
                                                "whose weight is bounded: token (w_t = pi_train / pi_rollout), seq "
                                                "(a sequence's product of w_t), geo (their geometric mean); overrides "
                                                "--vllm_is_correction_type (docs/algorithms.md; alias: Molt's "
                                                "--algo.advantage.is_correction_level)",
                                          choices=["token", "seq", "geo"],
                                          aliases=["--algo.advantage.is_correction_level"])
    is_correction_mode: str | None = opt(None, "with --is_correction_level: what a unit weight u outside "
                                               "--vllm_is_truncated_threshold (low high) gets: trunc: min(u, high); "
                                               "clip: clamp(u, low, high); mask: the unit is dropped (weight 0), a "
                                               "kept unit's tokens carry clamp(w_t, low, high) (alias: Molt's "
                                               "--algo.advantage.is_correction_mode)",
                                         choices=["mask", "clip", "trunc"],
                                         aliases=["--algo.advantage.is_correction_mode"])
    is_correction_gating: str = opt("ratio", "with --enable_vllm_is_correction: what is bounded: ratio (the IS "
                                             "weight, the grid above); binary_kl / tv (Molt's divergence gates, a "
                                             "trust region): per token the KL / total variation between "
                                             "Bernoulli(p_rollout) and Bernoulli(p_train) of the sampled token "
                                             "(at seq level their mean over the row); a token (seq: a row) whose "
                                             "divergence exceeds DELTA of --vllm_is_truncated_threshold 0 DELTA is "
                                             "dropped, the others keep their IS weight; needs mode mask at level "
                                             "token (--vllm_is_correction_type icepop) or seq (alias: Molt's "
                                             "--algo.advantage.is_correction_gating)",
                                    choices=["ratio", "binary_kl", "tv"],
                                    aliases=["--algo.advantage.is_correction_gating"])


@dataclass
class DynamicBatchOptions:
    """Dynamic batching (token budgets)"""

    use_dynamic_batch: bool = opt(False, "training micro-batches by token budget instead of row count")
    train_max_tokens_per_gpu: int = opt(16192, "token budget per micro-batch with --use_dynamic_batch")
    rollout_max_tokens_per_gpu: int | None = opt(None, "token budget per forward micro-batch of the log-prob, value "
                                                       "and reward passes with --use_dynamic_batch (unset: "
                                                       "--train_max_tokens_per_gpu)")


@dataclass
class AsyncOptions:
    """Asynchronous training"""

    async_train: bool = opt(False, "generate step t+1's rollout while step t trains (one step off-policy; pair "
                                   "with --enable_vllm_is_correction); not with --colocate_all_models")
    async_queue_size: int = opt(1, "rollouts generated ahead with --async_train: the rollout of step t+N is "
                                   "submitted before step t trains, so a sample is at most N policy versions stale "
                                   "(1: the one-step pipeline); the staleness is logged (async/staleness_max)")
    partial_rollout: bool = opt(False, "with --async_train: the engines generate in chunks of "
                                       "--partial_rollout_chunk_tokens and a weight sync pauses them between two "
                                       "chunks instead of waiting for the rollout; the requests resume with the new "
                                       "weights, each token records its policy version (docs/rl.md)")
    partial_rollout_chunk_tokens: int = opt(64, "new tokens per generation chunk with --partial_rollout (a weight "
                                                "sync waits for at most one chunk)")


@dataclass
class EMAOptions:
    """Weight averaging (EMA)"""

    enable_ema: bool = opt(False, "keep an exponential moving average of the actor's weights, ema = beta * ema + "
                                  "(1 - beta) * theta after every optimizer step (float32, starting from the "
                                  "initial weights, part of the resume checkpoint); the saved models (--save_path, "
                                  "--save_hf_ckpt, --best_metric_key) are the EMA, generation uses the live actor")
    ema_beta: float | None = opt(None, "decay beta of --enable_ema, in (0, 1) (default 0.992)")


@dataclass
class RunModeOptions:
    """Debugging, replay and evaluation-only runs"""

    debug_dump_steps: list[str] | None = opt(None, "write these global steps' tensors (or 'all') to "
                                                   "<run_dir>/debug/step_<N>.pt: the experience (sequences, masks, "
                                                   "rewards, values, old/ref/rollout log-probs, KL, advantages, "
                                                   "returns) and each training micro-batch's new log-probs, ratios, "
                                                   "per-token policy/value losses, entropy, IS weights, clip "
                                                   "fractions, grad norms before and after clipping, update size; "
                                                   "for checking a run by hand (docs/rl.md). Off by default")
    rollout_dump_dir: str | None = opt(None, "write each step's rollouts (prompts, token ids, engine log-probs, "
                                             "rewards, scores, sample metadata) to DIR/step_<N>.pt, with the "
                                             "settings a replay must share in DIR/rollout_manifest.json "
                                             "(docs/rl.md)")
    rollout_replay_dir: str | None = opt(None, "train from the rollouts a --rollout_dump_dir run wrote to DIR "
                                               "instead of generating: no rollout engines, no weight syncs, no "
                                               "evaluation; refused when the dump's settings differ (docs/rl.md)")
    eval_only: bool = opt(False, "load the model (and the checkpoint with --load_checkpoint), evaluate "
                                 "--eval_dataset as the run's evaluation does (eval/* metrics, samples, report), "
                                 "and exit without training or saving")


@dataclass
class RewardOptions:
    """Rewards"""

    agent_func_path: str | None = opt(None, "multi-turn agent environment: a .py file defining class AgentInstance "
                                            "with reset/step, or async def run_agent(base_url, prompt, label) "
                                            "calling an OpenAI-compatible endpoint (docs/agents.md); its rewards "
                                            "replace --remote_rm_url and --reward_pretrain")
    agent_action_max_len: int | None = opt(None, "agents: most tokens one action (turn) may generate; default: "
                                                 "what is left of --generate_max_len, the budget of a whole episode")
    overlong_buffer_len: float | None = opt(None, "DAPO overlong penalty: responses longer than "
                                                  "--generate_max_len - this lose up to --overlong_penalty_factor, "
                                                  "linearly over these last tokens, before the advantages")
    overlong_penalty_factor: float = opt(1.0, "largest overlong penalty (at --generate_max_len tokens)")
    stop_properly_penalty_coef: float | None = opt(None, "ProRL: responses cut at the length limit (finish reason "
                                                         "'length') get their reward times this (0..1), or this "
                                                         "fixed reward when < 0")
    critic_pretrain: str | None = opt(None, "critic initialisation (default: the first reward model, else "
                                            "--pretrain)")
    save_value_network: bool = opt(False, "also save the critic as an HF folder, <save_path>_critic")


@dataclass
class PromptDataOptions:
    """Data"""

    prompt_data: str | None = opt(None, "prompt datasets, comma-separated")
    prompt_data_probs: str | None = opt(None, "mixing probabilities for --prompt_data")
    prompt_split: str = opt("train", "split of --prompt_data")
    pretrain_data: str | None = opt(None, "SFT / pretraining data for the auxiliary loss (--ptx_coef), "
                                          "comma-separated")
    pretrain_data_probs: str | None = opt(None, "mixing probabilities for --pretrain_data")
    pretrain_split: str = opt("train", "split of --pretrain_data")
    pretrain_input_key: str | None = opt(None, "text key of --pretrain_data (default: --input_key)")
    pretrain_output_key: str | None = opt(None, "response key of --pretrain_data: loss on the response only "
                                                "(formatted like the prompts); unset: loss on every token")


@dataclass
class VisionOptions:
    """Vision-language models (docs/multimodal.md)"""

    image_key: str | None = opt(None, "key of the prompt rows' images (a path, base64 string or data URL, or a list "
                                      "of them); unset: text-only prompts. The model folder must be a "
                                      "vision-language model (AutoModelForImageTextToText)")
    max_images_per_prompt: int = opt(1, "most images one prompt row may hold (a row with more is an error naming it)")
    freeze_vision_tower: bool = opt(True, "a vision-language actor's vision encoder does not train and is not sent "
                                          "at weight sync (the engines keep theirs); --no-freeze_vision_tower "
                                          "trains and syncs it too (alias --freeze_visual_encoder, OpenRLHF's "
                                          "--actor.freeze_visual_encoder)", aliases=["--freeze_visual_encoder"])


def prompt_bound(prompt_max_len: int, max_len: int) -> int:
    """The longest prompt ppo keeps: --prompt_max_len, and with --max_len one that leaves room for a new token."""
    return min(prompt_max_len, max_len - 1) if max_len else prompt_max_len


def context_len(prompt_max_len: int, generate_max_len: int, max_len: int) -> int:
    """The most tokens of prompt + response ppo samples: --prompt_max_len + --generate_max_len, at most --max_len."""
    total = prompt_max_len + generate_max_len
    return min(total, max_len) if max_len else total
