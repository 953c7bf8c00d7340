"""OpenRLHF's two flag dialects -> rlhfkit's flat flags: one table, used by every command's parser and by the
generated porting page (docs/porting.md).

OpenRLHF 0.11 names its flags by section (`--actor.model_name_or_path`, `--algo.kl.init_coef`, `--ds.zpg`); the
seed-era releases used flat names, which rlhfkit keeps (`--pretrain`, `--init_kl_coef`). A row maps an OpenRLHF
name to one of:

- `"flag"`: rlhfkit's `--flag` with the same meaning; the value(s) follow unchanged (a switch stays a switch);
- `"flag=value"`: an OpenRLHF switch that means `--flag value` here (`--vllm.sync_with_ray`);
- `Only(value, reason)`: accepted (and dropped) only with the value that is what rlhfkit does anyway
  (`--data.dataloader_num_workers 0`); any other value is refused with the reason;
- `Refused(reason)`: a DeepSpeed-only knob or something rlhfkit lacks; refused with the reason;
- `BUDGET`: ppo's `--data.max_len L` (prompt + response <= L), rlhfkit's `--max_len L` and the two bounds it
  implies, see `Budget`.

A target flag that the command's parser does not know (yet) is refused as "not yet available": the status of every
row is computed from the live parsers, never stored. A target that rlhfkit itself refuses (`--zpg`) is refused with
rlhfkit's reason. Names that are flags of the command as they are need no row.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.optim_options import TRAINED_ROLES
from rlhfkit.errors import ConfigError


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Only:
    """Accepted only with `value` (True: the switch given), which is what rlhfkit does; refused otherwise."""
    value: Any
    reason: str


@dataclass(frozen=True)
class Budget:
    """ppo's `--data.max_len L` (and the flat `--max_len L`): prompt + response <= L tokens, as in OpenRLHF 0.11,
    whose rollout gives a prompt of p tokens max_tokens = L - p (`--rollout.max_new_tokens` unset) or
    `--rollout.max_new_tokens` N with the prompt cut to its last L - N tokens. rlhfkit sets `--max_len L` (a prompt of
    p tokens gets min(--generate_max_len, L - p) new tokens) and the bounds not given (`budget_flags`):
    `--generate_max_len` L - 1 and `--prompt_max_len` L - 1 (L - N with `--generate_max_len N`, where rlhfkit drops
    and counts the prompt that OpenRLHF would cut)."""


BUDGET = Budget()
Target = str | Refused | Only | Budget

# OpenRLHF's command-line tools -> rlhfkit's commands (None: no counterpart).
OPENRLHF_CLIS: dict[str, str | None] = {
    "train_ppo_ray": "ppo", "train_sft": "sft", "train_rm": "rm", "train_dpo": "dpo", "train_kto": "kto",
    "train_kd": "kd", "train_prm": "prm", "batch_inference": "batch-inference", "serve_rm": "serve-rm",
    "lora_combiner": "lora-merge", "interactive_chat": None,
}
NO_COMMAND = {"interactive_chat": "rlhfkit has no interactive chat command: sample with `rlhfkit batch-inference` "
                                  "or load the saved HF folder in vLLM or transformers"}

PPO_LOGGING = "ppo logs every step (one rollout per step); drop the flag (1 is accepted)"
_OFFLOAD_ROLE = "rlhfkit offloads the reference and reward models together: use --ref_reward_offload"

# OpenRLHF 0.11's dotted names shared by its CLIs (train_sft, train_rm, train_dpo, train_ppo_ray, serve_rm, ...).
COMMON: dict[str, Target] = {
    "ckpt.output_dir": "save_path", "ckpt.save_steps": "save_steps", "ckpt.save_hf": "save_hf_ckpt",
    "ckpt.disable_ds": "disable_ds_ckpt", "ckpt.path": "ckpt_path", "ckpt.max_num": "max_ckpt_num",
    "ckpt.max_mem": "max_ckpt_mem", "ckpt.load_enable": "load_checkpoint", "ckpt.best_metric_key": "best_metric_key",
    "logger.logging_steps": "logging_steps", "logger.wandb.key": "use_wandb", "logger.wandb.org": "wandb_org",
    "logger.wandb.group": "wandb_group", "logger.wandb.project": "wandb_project",
    "logger.wandb.run_name": "wandb_run_name", "logger.tensorboard_dir": "use_tensorboard",
    "eval.steps": "eval_steps", "eval.dataset": "eval_dataset", "eval.split": "eval_split",
    "train.micro_batch_size": "micro_train_batch_size", "train.batch_size": "train_batch_size",
    "train.max_epochs": "max_epochs", "train.seed": "seed", "train.full_determinism_enable": "full_determinism",
    "model.model_name_or_path": "pretrain", "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.aux_loss_coef": "aux_loss_coef", "model.pretrain_mode_enable": "pretrain_mode",
    "ds.use_universal_ckpt": "use_ds_universal_ckpt", "ds.deepcompile": "deepcompile", "ds.zpg": "zpg",
    "ds.use_liger_kernel": "use_liger_kernel", "ds.grad_accum_dtype": "grad_accum_dtype",
    "ds.overlap_comm": "overlap_comm", "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.enable_sleep": "deepspeed_enable_sleep", "ds.zero_stage": "zero_stage", "ds.param_dtype": "param_dtype",
    "ds.adam_offload": "adam_offload", "ds.attn_implementation": "attn_implementation",
    "ds.experts_implementation": Refused("mixture-of-experts layers run transformers' default expert kernels; "
                                         "drop the flag"),
    "ds.ring_attn_size": "ring_attn_size", "ds.ring_attn_head_stride": "ring_head_stride",
    "ds.load_in_4bit": "load_in_4bit", "ds.lora.rank": "lora_rank", "ds.lora.alpha": "lora_alpha",
    "ds.lora.target_modules": "target_modules", "ds.lora.dropout": "lora_dropout",
    "ds.packing_samples": "packing_samples", "ds.value_head_prefix": "value_head_prefix",
    "data.disable_fast_tokenizer": "disable_fast_tokenizer",
    "data.dataloader_num_workers": "dataloader_num_workers",
    "data.dataset": "dataset", "data.dataset_probs": "dataset_probs", "data.dataset_split": "dataset_split",
    "data.max_samples": "max_samples", "data.multiturn": "multiturn", "data.input_key": "input_key",
    "data.output_key": "output_key", "data.input_template": "input_template",
    "data.apply_chat_template": "apply_chat_template", "data.tokenizer_chat_template": "tokenizer_chat_template",
    "data.max_len": "max_len", "data.prompt_key": "prompt_key", "data.chosen_key": "chosen_key",
    "data.rejected_key": "rejected_key", "data.label_key": "label_key",
    "model.compute_fp32_loss_enable": "compute_fp32_loss", "model.margin_loss_enable": "margin_loss",
    "model.loss_type": "loss", "model.beta": "beta", "model.ipo_enable": "ipo",
    "model.label_smoothing": "label_smoothing", "model.nll_loss_coef": "nll_loss_coef",
    "ref.model_name_or_path": "ref_pretrain", "ref.offload": "ref_offload",
    "reward.model_name_or_path": "reward_pretrain", "reward.normalize_enable": "normalize_reward",
    # one optimiser per run (the offline commands)
    "optim": "optim", "muon.lr": "muon_lr", "muon.momentum": "muon_momentum", "muon.ns_steps": "muon_ns_steps",
    "muon.nesterov": "muon_nesterov", "muon.no_nesterov": "no-muon_nesterov", "adam.lr": "learning_rate",
    "adam.betas": "adam_betas", "adam.eps": "adam_eps", "adam.weight_decay": "l2",
}

# train_ppo_ray's own names (and those whose meaning differs there).
PPO: dict[str, Target] = {
    **{f"{role}.{what}": f"{role}_{what}" for role in ("actor", "ref", "critic", "reward")
       for what in ("num_nodes", "num_gpus_per_node")},
    "train.colocate_actor_ref": "colocate_actor_ref", "train.colocate_critic_reward": "colocate_critic_reward",
    "train.colocate_all": "colocate_all_models",
    "vllm.num_engines": "vllm_num_engines", "vllm.tensor_parallel_size": "vllm_tensor_parallel_size",
    "vllm.sync_backend": "vllm_sync_backend", "vllm.sync_with_ray": "vllm_sync_backend=ray",
    "vllm.enable_prefix_caching": "enable_prefix_caching", "vllm.enforce_eager": "enforce_eager",
    "vllm.enable_sleep": "vllm_enable_sleep", "vllm.gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "algo.advantage.is_correction_enable": "enable_vllm_is_correction",
    "algo.advantage.is_correction_threshold": "vllm_is_truncated_threshold",
    "algo.advantage.is_correction_type": "vllm_is_correction_type",
    "algo.advantage.estimator": "advantage_estimator", "algo.advantage.no_std_norm": "no_advantage_std_norm",
    "algo.advantage.lambd": "lambd", "algo.advantage.gamma": "gamma",
    "algo.kl.target": "kl_target", "algo.kl.horizon": "kl_horizon", "algo.kl.init_coef": "init_kl_coef",
    "algo.kl.estimator": "kl_estimator", "algo.kl.use_loss": "use_kl_loss",
    "algo.dynamic_filtering_enable": "dynamic_filtering", "algo.dynamic_filtering_range":
        "dynamic_filtering_reward_range",
    "train.async_enable": "async_train", "train.async_queue_size": "async_queue_size",
    "train.partial_rollout_enable": "partial_rollout",
    "train.enable_ema": "enable_ema", "train.ema_beta": "ema_beta",
    "train.dynamic_batch_enable": "use_dynamic_batch", "train.max_tokens_per_gpu": "train_max_tokens_per_gpu",
    "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu", "train.num_episodes": "num_episodes",
    "train.agent_func_path": "agent_func_path",
    "rollout.batch_size": "rollout_batch_size", "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
    "rollout.micro_batch_size": "micro_rollout_batch_size", "rollout.max_new_tokens": "generate_max_len",
    "rollout.top_p": "top_p", "rollout.temperature": "temperature",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt",
    "data.max_len": BUDGET, "data.prompt_dataset": "prompt_data", "data.prompt_probs": "prompt_data_probs",
    "data.prompt_split": "prompt_split", "eval.temperature": "eval_temperature",
    "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
    "data.image_key": "image_key", "data.max_images_per_prompt": "max_images_per_prompt",
    "actor.freeze_visual_encoder": "freeze_vision_tower",
    "actor.model_name_or_path": "pretrain", "critic.model_name_or_path": "critic_pretrain",
    "reward.remote_url": "remote_rm_url", "reward.clip_range": "reward_clip_range",
    "reward.overlong_buffer_len": "overlong_buffer_len", "reward.overlong_penalty_factor": "overlong_penalty_factor",
    "reward.stop_properly_penalty_coef": "stop_properly_penalty_coef",
    "ref.offload": Refused(_OFFLOAD_ROLE), "reward.offload": Refused(_OFFLOAD_ROLE),
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "actor.eps_clip": "eps_clip", "actor.eps_clip_low_high": "eps_clip_low_high", "actor.dual_clip": "dual_clip",
    "actor.policy_loss_type": "policy_loss_type", "actor.aux_loss_coef": "aux_loss_coef",
    "actor.entropy_coef": "entropy_loss_coef", "critic.value_clip": "value_clip",
    "critic.freezing_steps": "freezing_actor_steps", "critic.save_value_network": "save_value_network",
    # per-role optimiser settings
    **{f"{role}.optim": f"{role}_optim" for role in TRAINED_ROLES},
    **{f"{role}.muon.{what}": f"{role}_muon_{what}" for role in TRAINED_ROLES
       for what in ("lr", "momentum", "ns_steps", "nesterov")},
    **{f"{role}.muon.no_nesterov": f"no-{role}_muon_nesterov" for role in TRAINED_ROLES},
    **{f"{role}.{what}": f"{role}_{flat}" for role in TRAINED_ROLES
       for what, flat in (("adam.lr", "learning_rate"), ("adam.betas", "adam_betas"), ("adam.eps", "adam_eps"),
                          ("adam.weight_decay", "l2"), ("lr_scheduler", "lr_scheduler"),
                          ("lr_warmup_ratio", "lr_warmup_ratio"), ("min_lr_ratio", "min_lr_ratio"),
                          ("max_norm", "max_norm"))},
}

# Seed-era flat names that rlhfkit spells differently or refuses (all commands, then per command).
SEED: dict[str, Target] = {}
SEED_BY_COMMAND: dict[str, dict[str, Target]] = {
    "ppo": {
        "enable_ema": "enable_ema", "ema_beta": "ema_beta",  # not yet available where no such flag exists
        "vllm_sync_with_ray": "vllm_sync_backend=ray", "deepspeed_enable_sleep": "fsdp_enable_offload",
        "max_len": BUDGET, "logging_steps": Only(1, PPO_LOGGING),
        # the seed-era flat names of rollout.max_new_tokens and actor.freeze_visual_encoder (--max_new_tokens,
        # --freeze_visual_encoder) are aliases of --generate_max_len and --freeze_vision_tower in the parser
        "vllm_generate_batch_size": Refused("each step's --rollout_batch_size prompts go to the engines at once "
                                            "(refilled with --dynamic_filtering); there is no separate generation "
                                            "batch; drop the flag"),
        "actor_init_on_gpu": Refused("the workers place their models themselves (FSDP2); drop the flag"),
        "perf": Refused("not implemented: every step's timings are in metrics.jsonl already; drop the flag"),
    },
    "sft": {"train_split": "dataset_split"},
    "lora-merge": {"is_rm": Refused("not needed: the adapter's task_type says whether the model has a score head "
                                    "(a reward model); drop the flag")},
    "batch-inference": {
        "zero_stage": Refused("batch-inference runs vLLM engines and plain reward-model forwards: there is no "
                              "ZeRO/FSDP sharding; drop the flag"),
        "attn_implementation": Refused("the engines and reward models use their default attention kernel; drop "
                                       "the flag"),
        "full_determinism": Refused("not implemented for the engines; runs are seeded by --seed"),
        "value_head_prefix": Only("score", "rlhfkit reward models have the head 'score'; 'score' is accepted"),
        "reward_template": Refused("not implemented: reward models score the formatted prompt + response"),
        "repetition_penalty": Refused("not implemented: sampling uses --temperature, --top_k and --top_p"),
        "max_num_seqs": Refused("the engines use vLLM's default scheduler limits; drop the flag"),
    },
}
# the commands without an OpenRLHF 0.11 counterpart take the shared dotted names
OWN: dict[str, dict[str, Target]] = {"ppo": PPO}


def table(command: str) -> dict[str, Target]:
    """Every OpenRLHF name `rlhfkit command` translates (dotted or flat) -> its target."""
    return {**COMMON, **OWN.get(command, {}), **SEED, **SEED_BY_COMMAND.get(command, {})}


@dataclass(frozen=True)
class Resolved:
    """What an OpenRLHF name means for one command: `flag` (rlhfkit's name, "" when none) and `value` (a fixed
    value, for a switch that means `--flag value`); or a refusal `reason`; or `only` (accepted with that value)."""
    flag: str = ""
    value: Any = None
    negate: bool = False
    reason: str = ""
    only: Only | None = None
    budget: bool = False


def resolve(command: str, name: str, known: set[str], refusal: Callable[[str], str | None]) -> Resolved | None:
    """The meaning of `--name` for `command` (None: not an OpenRLHF name rlhfkit translates, pass it on). `known`:
    the command's flag names (without dashes); `refusal(flag)`: rlhfkit's reason for refusing `--flag`, or None."""
    rows, flat_rows = table(command), {**SEED, **SEED_BY_COMMAND.get(command, {})}
    target = rows.get(name)
    if target is None or name in known and name not in flat_rows:
        return None
    if isinstance(target, str) and "=" not in target and target.removeprefix("no-") in flat_rows \
            and target.removeprefix("no-") != name:
        target = flat_rows[target.removeprefix("no-")]  # a dotted name of a seed-era name rlhfkit translates
    if isinstance(target, Refused):
        return Resolved(reason=target.reason)
    if isinstance(target, Only):
        return Resolved(only=target)
    if isinstance(target, Budget):
        return Resolved(flag="prompt_max_len", budget=True)
    flag, _, value = target.partition("=")
    negate = flag.startswith("no-")
    flag = flag.removeprefix("no-")
    reason = refusal(flag)
    if reason:
        return Resolved(flag=flag, reason=reason)
    if flag not in known:
        return Resolved(flag=flag, reason=f"not yet available: it means rlhfkit's {flag}, which "
                                          f"'rlhfkit {command}' does not have in this version")
    return Resolved(flag=flag, value=value or None, negate=negate)


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flag names (without dashes) of a parser."""
    return {opt[2:] for action in parser._actions for opt in action.option_strings if opt.startswith("--")}


def _equal(given: Any, wanted: Any) -> bool:
    if wanted is True:
        return given is True
    try:
        return type(wanted)(given) == wanted
    except (TypeError, ValueError):
        return False


def _refuse(name: str, meaning: Resolved, source: str) -> ConfigError:
    via = f" (rlhfkit's --{meaning.flag})" if meaning.flag and meaning.flag != name else ""
    return ConfigError(f"{source}: --{name}{via} is not supported: {meaning.reason}")


def _refuse_value(command: str, name: str, value: Any, only: Only, source: str) -> ConfigError:
    return ConfigError(f"{source}: --{name} is not supported by 'rlhfkit {command}' ({value} given): {only.reason}")


def rewrite_argv(command: str, argv: list[str], parser: argparse.ArgumentParser,
                 refusal: Callable[[str], str | None]) -> list[str]:
    """argv with OpenRLHF's names (`--a.b v`, `--a.b=v`, switches) replaced by rlhfkit's flat flags; ConfigError
    naming the flag and the reason for a refused one."""
    known, out, budget, i = parser_flags(parser), [], None, 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, eq, inline = token[2:].partition("=")
        meaning = resolve(command, name, known, refusal) if token.startswith("--") else None
        if meaning is None:
            out.append(token)
            continue
        if meaning.reason:
            raise _refuse(name, meaning, "command line")
        if meaning.budget or meaning.only is not None:
            switch = meaning.only is not None and meaning.only.value is True
            value, i = (inline, i) if eq else (True, i) if switch or i >= len(argv) else (argv[i], i + 1)
            if meaning.only is not None and not _equal(value, meaning.only.value):
                raise _refuse_value(command, name, value, meaning.only, "command line")
            budget = (name, value) if meaning.budget else budget
            continue
        flag = f"--no-{meaning.flag}" if meaning.negate else f"--{meaning.flag}"
        out += [flag, meaning.value] if meaning.value is not None else [flag + (f"={inline}" if eq else "")]
    if budget is not None:
        out = [*_budget_argv(budget, out, parser), *out]
    return out


# spellings of the two bounds a `--max_len` budget fills in when they are not given
_BOUNDS = {"prompt_max_len": ("prompt_max_len",), "generate_max_len": ("generate_max_len", "max_new_tokens")}


def _budget_argv(budget: tuple[str, Any], argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    given = {}
    for j, token in enumerate(argv):
        for flag, names in _BOUNDS.items():
            for spelled in names:
                if token == f"--{spelled}" and j + 1 < len(argv):
                    given[flag] = argv[j + 1]
                elif token.startswith(f"--{spelled}="):
                    given[flag] = token.partition("=")[2]
    return [item for flag, value in budget_flags(*budget, given).items() for item in (f"--{flag}", str(value))]


def budget_flags(name: str, total: Any, given: dict[str, Any]) -> dict[str, int]:
    """ppo's `--data.max_len L` (or `--max_len L`) as rlhfkit's flags, as OpenRLHF 0.11 bounds a rollout: `--max_len
    L` (a prompt of p tokens gets min(--generate_max_len, L - p) new tokens), and of the two bounds those not in
    `given`: `--generate_max_len` L - 1 (what is left after the prompt, OpenRLHF's default) and `--prompt_max_len`
    L - `--generate_max_len` when that is given (OpenRLHF cuts a longer prompt to fit; rlhfkit drops and counts it),
    else L - 1 (at least one new token). Returns the flags to set."""
    try:
        total = int(total)
        given = {flag: int(value) for flag, value in given.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} {total}: expected integers") from None
    if total < 2:
        raise ConfigError(f"--{name} {total}: the budget of prompt + response must be at least 2 tokens")
    out = {"max_len": total}
    if "generate_max_len" in given:
        if total - given["generate_max_len"] < 1:
            raise ConfigError(f"--{name} {total} leaves no room beside --generate_max_len {given['generate_max_len']}: "
                              f"raise --{name}")
    else:
        out["generate_max_len"] = total - 1
    if "prompt_max_len" not in given:
        out["prompt_max_len"] = total - given.get("generate_max_len", 1)
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested YAML (`actor: {model_name_or_path: m}`) -> dotted keys (`actor.model_name_or_path: m`)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{str(key).lstrip('-')}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def rewrite_mapping(command: str, data: dict[str, Any], parser: argparse.ArgumentParser,
                    refusal: Callable[[str], str | None], source: str) -> dict[str, Any]:
    """`--config` keys (flattened) with OpenRLHF's names replaced by rlhfkit's, as `rewrite_argv` does."""
    known, out, budget = parser_flags(parser), {}, None
    for key, value in flatten(data).items():
        meaning = resolve(command, key, known, refusal)
        if meaning is None:
            out[key] = value
        elif meaning.reason:
            raise _refuse(key, meaning, source)
        elif meaning.budget:
            budget = (key, value)
        elif meaning.only:
            if not _equal(value, meaning.only.value):
                raise _refuse_value(command, key, value, meaning.only, source)
        elif meaning.value is not None:
            if value:
                out[meaning.flag] = meaning.value
        else:
            out[meaning.flag] = (not value) if meaning.negate else value
    if budget is not None:
        given = {flag: out[spelled] for flag, names in _BOUNDS.items() for spelled in names if spelled in out}
        out.update(budget_flags(*budget, given))
    return out
