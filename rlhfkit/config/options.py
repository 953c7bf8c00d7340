"""Option groups shared by the commands. Field names are OpenRLHF's flag names (see ../shared/FLAGS.md).

Each group's first docstring line is its heading in `--help` and in docs/commands/*.md.
Differences from OpenRLHF defaults are noted in the help text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def opt(default, help: str, *, command_help: dict[str, str] | None = None, **extra):  # noqa: A002 - argparse's
    """A dataclass field carrying its help text (and optional choices, aliases) for the CLI and the docs.

    `command_help`: command -> its own help text, where the flag means something different there (e.g. --max_len
    of rm counts the tokens of one side of a pair); `command_choices` likewise narrows `choices` for a command. The
    command's class (rlhfkit.config.commands) resolves both, with its default (COMMAND_DEFAULTS).
    """
    metadata = {"help": help, **extra}
    if command_help:
        metadata["command_help"] = dict(command_help)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelLoadOptions:
    """Model loading"""

    param_dtype: str = opt("auto", "compute dtype (fp32 master weights): auto = bf16 mixed precision where the "
                                   "hardware computes bf16 natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX), "
                                   "fp32 elsewhere; the choice and why are in the manifest (docs/engine.md)",
                           choices=["auto", "bf16", "fp16", "fp32"],
                           command_help={"batch-inference": "engine dtype: auto = bf16 where the hardware computes it "
                                                            "natively (CUDA with bf16, AVX512-BF16/AMX CPUs), fp32 "
                                                            "elsewhere",
                                         "serve-rm": "the reward model's dtype (OpenRLHF default: bf16)"},
                           command_choices={"serve-rm": ["bf16", "fp16", "fp32"]})
    disable_fast_tokenizer: bool = opt(False, "use the slow (Python) tokenizer")


@dataclass
class AttentionOptions:
    """Attention"""

    attn_implementation: str = opt("sdpa", "attention kernel (OpenRLHF default flash_attention_2; sdpa runs on CPU)")


@dataclass
class PretrainOptions:
    """Model"""

    pretrain: str | None = opt(None, "model to train: local HF folder, hub name, .gguf file or "
                                     "embedded:smollm2-135m-instruct",
                               command_help={"batch-inference": "policy to sample from (generate tasks) or reward "
                                                                "model (--eval_task rm without --remote_rm_url / "
                                                                "--reward_pretrain): HF folder, hub name, .gguf or "
                                                                "embedded:..."})



@dataclass
class SeedOptions:
    """Seed"""

    seed: int = opt(42, "random seed (data order, init, sampling)",
                    command_help={"batch-inference": "sampling seed (sample j of prompt i uses seed + i * best_of_n "
                                                     "+ j)"})


@dataclass
class ModelOptions:
    """Model (training)"""

    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    gradient_checkpointing_use_reentrant: bool = opt(False, "use the reentrant checkpointing implementation")
    lora_rank: int = opt(0, "LoRA rank; 0 trains all weights")
    lora_alpha: int = opt(16, "LoRA alpha")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    target_modules: list[str] = opt(["all-linear"], "modules LoRA adapts")
    load_in_4bit: bool = opt(False, "QLoRA: load the frozen base in bitsandbytes NF4 4-bit (needs --lora_rank; one "
                                    "rank; docs/models.md)")
    aux_loss_coef: float = opt(0.0, "mixture-of-experts models: add this x the router load-balancing loss to the "
                                    "training loss (0: off; refused on a dense model)")


@dataclass
class InputOptions:
    """Input rows"""

    max_samples: int = opt(1_000_000, "use at most this many rows (training samples, prompts)")
    input_key: str = opt("input", "key of the prompt (string or list of chat messages)")
    input_template: str | None = opt(None, "template with one {} for the prompt, e.g. 'User: {}\\nAssistant: ' "
                                           "(ignored with --apply_chat_template)",
                                     command_help={"prm": "template with one {} for the input text"})
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "override the tokenizer's chat template (Jinja string)")


@dataclass
class MaxLenOptions:
    """Sequence length"""

    max_len: int = opt(2048, "maximum tokens per sample (over-long samples: see docs/data.md)",
                       command_help={"rm": "maximum tokens per side of a pair",
                                     "dpo": "maximum tokens per side of a pair",
                                     "batch-inference": "reward models: most tokens of prompt + response scored "
                                                        "(longer: left-truncated, counted)",
                                     "serve-rm": "keep the last max_len tokens of each query",
                                     "ppo": "prompt + response <= this many tokens (OpenRLHF's --data.max_len, which "
                                            "also sets the bounds not given: --generate_max_len and "
                                            "--prompt_max_len this - 1): a prompt of p tokens gets "
                                            "min(--generate_max_len, this - p) new tokens, a prompt with no room "
                                            "left is dropped and counted; 0: no total bound (the engines' context "
                                            "is --prompt_max_len + --generate_max_len)"})


@dataclass
class DataOptions:
    """Data"""

    dataset: str | None = opt(None, "training data: comma-separated files (json/jsonl/parquet/csv), "
                                    "save_to_disk folders or hub names",
                              command_help={"batch-inference": "prompts (generate) or input/output rows (rm): "
                                                               "json/jsonl/parquet/csv files, folders or hub names, "
                                                               "comma-separated"})
    dataset_probs: str | None = opt(None, "comma-separated mixing probabilities, one per --dataset entry")
    dataset_split: str = opt("train", "split to read from folders/hub datasets")
    output_key: str | None = opt(None, "key of the response",
                                 command_help={"batch-inference": "key of the response (--eval_task rm)"})


@dataclass
class EvalDataOptions:
    """Evaluation data"""

    eval_dataset: str | None = opt(None, "held-out data, same formats as --dataset",
                                   command_help={"ppo": "held-out prompts (pass@k)"})
    eval_split: str = opt("train", "split of --eval_dataset")


@dataclass
class LabelKeyOptions:
    """Labels"""

    label_key: str | None = opt(None, "key of the row's label",
                                command_help={
                                    "kto": "key of the boolean label (true: desirable)",
                                    "prm": "key of the per-step labels: a list with one entry per placeholder, each "
                                           "a reward token string (hard), a bool (true = the first reward token) or "
                                           "a probability that the step is good (soft)",
                                    "ppo": "key of the label passed to the reward function",
                                    "batch-inference": "key of a label, passed to reward functions and copied to "
                                                       "the output rows"})


@dataclass
class PretrainModeOptions:
    """Pretraining mode"""

    pretrain_mode: bool = opt(False, "loss on all tokens (continued pretraining)")
@dataclass
class TrainOptions:
    """Training engine (FSDP2)"""

    train_batch_size: int = opt(128, "global batch size (samples per optimizer step, all ranks)")
    micro_train_batch_size: int = opt(8, "samples per forward/backward per rank; accumulation is derived",
                                      command_help={"rm": "pairs per forward/backward per rank (each pair is 2 "
                                                          "sequences)"})
    max_epochs: int = opt(1, "passes over the training data",
                          command_help={"ppo": "PPO epochs over each rollout buffer"})
    learning_rate: float = opt(5e-6, "peak learning rate")
    lr_warmup_ratio: float = opt(0.03, "fraction of steps of linear warmup")
    lr_scheduler: str = opt("cosine_with_min_lr", "schedule after warmup",
                            choices=["cosine_with_min_lr", "cosine", "constant", "linear"])
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak (cosine_with_min_lr)")
    adam_betas: list[float] = opt([0.9, 0.95], "AdamW betas")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    l2: float = opt(0.0, "weight decay (AdamW's matrices; with --optim muon also Muon's, decoupled)")
    max_norm: float = opt(1.0, "gradient clipping norm (0 disables)")
    optim: str = opt("adam", "adam: AdamW for every parameter; muon: torch.optim.Muon (Newton-Schulz orthogonalised "
                             "momentum) for the 2-D hidden weight matrices, AdamW (--learning_rate) for embeddings, "
                             "lm_head, the value head, norms and biases (docs/engine.md)", choices=["adam", "muon"])
    muon_lr: float = opt(0.02, "--optim muon: peak learning rate of the Muon matrices (same schedule)")
    muon_momentum: float = opt(0.95, "--optim muon: Muon momentum")
    muon_ns_steps: int = opt(5, "--optim muon: Newton-Schulz iterations")
    muon_nesterov: bool = opt(True, "--optim muon: Nesterov momentum (--no-muon_nesterov: plain momentum)")
    zero_stage: int = opt(2, "2: keep gathered params between forward and backward (FSDP2 "
                             "reshard_after_forward=False); 3: reshard after forward", choices=[2, 3])
    adam_offload: bool = opt(False, "FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state on CPU "
                                    "(CUDA only; on CPU everything already lives in host memory)")
    master_weights_rounding: str = opt("stochastic", "bf16 on one rank (fp32 master weights beside a bf16 compute "
                                                     "copy): how the masters are rounded into the copy the forward "
                                                     "and the rollout engines use after each step; stochastic is "
                                                     "unbiased, so updates below bf16's resolution still reach the "
                                                     "policy (docs/engine.md)", choices=["stochastic", "nearest"])
    full_determinism: bool = opt(False, "torch.use_deterministic_algorithms(True)")
    dataloader_num_workers: int = opt(0, "accepted for OpenRLHF scripts (--data.dataloader_num_workers), changes "
                                         "nothing: rlhfkit tokenizes the data once, up front, in the training "
                                         "process, and batches are slices of those tensors: there are no loader "
                                         "workers to start")
    eval_steps: int = opt(-1, "evaluate every N steps (-1: at the end of each epoch)",
                          command_help={"ppo": "evaluate every N steps (-1: at the start and the end)"})
    packing_samples: bool = opt(False, "pack several samples per row (per-sample position ids and attention)",
                                command_help={"ppo": "each micro-batch is one packed row with no padding, and a "
                                                     "prompt shared by several samples (--n_samples_per_prompt) is "
                                                     "computed once for all of them (block mask: a response sees its "
                                                     "prompt and itself); same log-probs and gradients as padded "
                                                     "rows, fewer tokens through the model (docs/rl.md)"})
    ring_attn_size: int = opt(1, "context parallel: split every sequence across this many ranks (a ring group; "
                                 "world = data parallel x ring size); all-gather (llama3) attention in pure torch, "
                                 "padded or packed; sft, rm, dpo, kto, kd, and ppo's actor, reference and critic "
                                 "(docs/parallelism.md)")
    ring_head_stride: int = opt(1, "with --ring_attn_size > 1: key/value heads gathered and attended per step "
                                   "(must divide the model's KV heads); same result, trades message count for "
                                   "buffer size")
    ds_tensor_parallel_size: int = opt(1, "tensor parallel training (alias --tp_size): split every attention and "
                                          "MLP weight of the Llama/Qwen family over this many ranks (DTensor, "
                                          "world = data parallel x N, FSDP2 on the data-parallel dimension; must "
                                          "divide the attention and key/value heads); sft, rm, dpo, kto "
                                          "(docs/parallelism.md)", aliases=["--tp_size"])


@dataclass
class CheckpointOptions:
    """Checkpoints"""

    save_path: str = opt("./ckpt", "final HF model folder (weights + tokenizer), loadable with from_pretrained")
    save_steps: int = opt(-1, "write a full-state checkpoint every N steps (-1: never)")
    ckpt_path: str = opt("./ckpt/checkpoints", "folder of full-state checkpoints (model, optimizer, scheduler, "
                                               "data position, RNG)")
    max_ckpt_num: int = opt(3, "keep at most this many full-state checkpoints")
    load_checkpoint: bool = opt(False, "resume from the newest checkpoint in --ckpt_path")
    save_hf_ckpt: bool = opt(False, "also write an HF folder inside each checkpoint")
    best_metric_key: str | None = opt(None, "after each evaluation where this eval metric (as logged, e.g. "
                                            "eval/pass@1, eval/loss) is the best so far, write the model to "
                                            "<ckpt_path>/best (HF folder + best_metric.json: key, value, step); lower "
                                            "is better for a key containing 'loss', higher otherwise; 'auto': "
                                            "eval/pass@1 (ppo) or eval/loss; needs --eval_dataset")


@dataclass
class LoggingOptions:
    """Logging"""

    run_dir: str | None = opt(None, "run folder for logs, metrics.jsonl, manifest and report "
                                    "(default runs/<command>-<time>)")
    logging_steps: int = opt(1, "log every N steps")
    use_tensorboard: str | None = opt(None, "TensorBoard log folder")
    use_wandb: str | None = opt(None, "Weights & Biases: API key or 'offline'/'online' (WANDB_MODE decides)")
    wandb_org: str | None = opt(None, "W&B entity")
    wandb_group: str | None = opt(None, "W&B group")
    wandb_project: str = opt("rlhfkit", "W&B project")
    wandb_run_name: str | None = opt(None, "W&B run name (default: the run folder's name)")


@dataclass
class SFTOptions:
    """SFT"""

    multiturn: bool = opt(False, "loss on every assistant turn of a message list")
    csft_keys: list[str] | None = opt(None, "conditional SFT: row keys of attribute values (e.g. rm_score) put before "
                                            "the prompt as '<rm_score>: 5.00' lines (a system message with "
                                            "--apply_chat_template); see docs/methods.md")


@dataclass
class RemoteRewardOptions:
    """Reward servers (http(s) URLs in --remote_rm_url)"""

    remote_rm_timeout: float | None = opt(None, "seconds of wall time one request to a reward server may take, "
                                                "connecting to the last byte of the answer (each attempt gets as "
                                                "long); default: --reward_timeout (60 when that is 0)")
    remote_rm_retries: int = opt(3, "rounds of retries of a request that failed on the network, timed out or got "
                                    "HTTP 5xx, 408 or 429 (other 4xx answers are not retried): each round tries "
                                    "every server URL, a failed one fails over to the next; 0: one round")
    remote_rm_backoff: float = opt(1.0, "seconds before the second round, doubled before each next one, each wait "
                                        "drawn between 1 and 1.5 times that (jitter)")
    remote_rm_max_response_mb: float = opt(64.0, "largest answer of a reward server in MiB; a larger one fails the "
                                                 "attempt (not read further) and is retried on another server")
    remote_rm_token: str | None = opt(None, "bearer token sent to the reward servers (rlhfkit serve-rm "
                                            "--auth_token); default: the RLHFKIT_RM_TOKEN environment variable, "
                                            "which keeps it out of the process list")

