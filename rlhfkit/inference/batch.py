"""`rlhfkit batch-inference`: sample from a policy on the rollout engines, score with any reward source, and turn
the scored samples into training data. OpenRLHF's `batch_inference` (`--eval_task generate_vllm|generate|rm`,
`--best_of_n`, `--post_processor rs|csft|iter_dpo`, `--iter`).

    prompts --(engines: vLLM actors on Ray, or the transformers engine)--> {"input", "output"} x best_of_n
            --(reward models, reward_func files, builtin verifiers, HTTP servers)--> + "reward"
            --(post-processor)--> SFT rows (rs), conditional-SFT rows (csft) or DPO pairs (iter_dpo)

Generated rows: `{"input": the formatted prompt text, "output": the response text (special tokens stripped),
"prompt_index", "sample_index", "finish_reason"}` plus `"label"` with `--label_key` and `"reward"` when a reward
is given. Sample j of prompt i is drawn with seed `--seed + i * best_of_n + j` (the whole file, not the --iter
slice, counts i), so a run is reproducible and independent of the number of engines.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhfkit.config.commands import BatchInferenceConfig
from rlhfkit.config.validate import need
from rlhfkit.data.csft import condition_row
from rlhfkit.data.errors import row_error
from rlhfkit.data.formatting import get_field
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import blend_datasets
from rlhfkit.errors import ConfigError
from rlhfkit.inference.postprocess import get_post_processor
from rlhfkit.launch.engine_spec import sampling_config, vllm_engine_spec
from rlhfkit.models.loading import load_tokenizer, resolve_pretrain, stop_token_ids
from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.vllm_engine import ENGINE_DTYPES

if TYPE_CHECKING:
    from rlhfkit.engine.precision import Precision

log = logging.getLogger("rlhfkit")


def validate(cfg: BatchInferenceConfig) -> None:
    """Contradicting or missing flags -> ConfigError naming them."""
    has_reward = bool(cfg.reward_pretrain or cfg.remote_rm_url)
    if not cfg.dataset:
        raise ConfigError("--dataset is required (prompts to sample from, or input/output rows to score)")
    if not cfg.output_path:
        raise ConfigError("--output_path is required (a .jsonl file for the rows)")
    if cfg.eval_task != "rm" and not cfg.pretrain:
        raise ConfigError(f"--eval_task {cfg.eval_task} needs --pretrain (the policy to sample from)")
    if cfg.eval_task == "rm" and not (has_reward or cfg.pretrain):
        raise ConfigError("--eval_task rm needs a reward: --pretrain (a reward model, as in OpenRLHF), "
                          "--reward_pretrain or --remote_rm_url")
    if cfg.post_processor and cfg.eval_task != "rm" and not has_reward:
        raise ConfigError(f"--post_processor {cfg.post_processor} needs rewards: add --reward_pretrain or "
                          "--remote_rm_url, or run --eval_task rm on the generated file")
    if cfg.post_processor == "iter_dpo" and cfg.eval_task != "rm" and cfg.best_of_n < 2:
        raise ConfigError("--post_processor iter_dpo pairs the best and worst sample of a prompt: set --best_of_n >= 2")
    if cfg.best_of_n < 1 or cfg.max_new_tokens < 1 or cfg.rollout_batch_size < 1:
        raise ConfigError("--best_of_n, --max_new_tokens and --rollout_batch_size must be >= 1")
    if cfg.iter is not None and cfg.iter < 0:
        raise ConfigError(f"--iter {cfg.iter} must be >= 0")
    if cfg.eval_task == "generate_vllm" and cfg.tp_size < 1:
        raise ConfigError(f"--tp_size {cfg.tp_size} must be >= 1")


def run_batch_inference(cfg: BatchInferenceConfig, engines: list[Any] | None = None) -> dict[str, Any]:
    """Do the task, write `--output_path` (atomically), return the stats. `engines`: running rollout engine actors
    to reuse (tests, notebooks); otherwise they are started (and stopped) here."""
    validate(cfg)
    from rlhfkit.launch.preflight import preflight_batch_inference

    preflight_batch_inference(cfg, engines)  # the model's context, the host, reward files: before Ray starts
    began = time.perf_counter()
    stats: dict[str, Any] = {"task": cfg.eval_task}
    if cfg.eval_task == "rm":
        rows = read_scoring_rows(cfg)
    else:
        rows = generate(cfg, engines, stats)
    if cfg.eval_task == "rm" or cfg.reward_pretrain or cfg.remote_rm_url:
        score(cfg, rows, stats)
    if cfg.post_processor:
        rows, post = get_post_processor(cfg.post_processor)(rows)
        stats[cfg.post_processor] = post
    stats["rows_written"] = len(rows)
    stats["seconds"] = round(time.perf_counter() - began, 3)
    write_rows(rows, need(cfg.output_path, "--output_path"))
    return stats


def prompt_slice(cfg: BatchInferenceConfig, tokenizer: Any) -> tuple[list[dict], int]:
    """The prompts of this run (the --iter slice) and the index of the first one in the whole file."""
    rows = blend_datasets(need(cfg.dataset, "--dataset"), cfg.dataset_probs, split=cfg.dataset_split, seed=cfg.seed,
                          max_samples=cfg.max_samples)
    if cfg.iter is not None:
        start = cfg.iter * cfg.rollout_batch_size
        if start >= len(rows):
            raise ConfigError(f"--iter {cfg.iter} x --rollout_batch_size {cfg.rollout_batch_size} = {start} is past "
                              f"the {len(rows)} rows of --dataset {cfg.dataset}")
        rows = rows.select(range(start, min(len(rows), start + cfg.rollout_batch_size)))
    else:
        start = 0
    if cfg.enable_csft:
        rows = [{**row, cfg.input_key: _csft(row, cfg)} for row in rows]
    prompts, data_stats = build_prompt_samples(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                                               input_template=cfg.input_template,
                                               apply_chat_template=cfg.apply_chat_template,
                                               prompt_max_len=cfg.prompt_max_len)
    if not prompts:
        raise ConfigError(f"no usable prompts in --dataset {cfg.dataset} ({data_stats}): check --input_key and "
                          "--prompt_max_len")
    return prompts, start


def _csft(row: dict, cfg: BatchInferenceConfig) -> Any:
    """--enable_csft: the condition before the prompt, as `rlhfkit sft --csft_keys` trained it."""
    key = cfg.csft_prompt.split(">", 1)[0].lstrip("<") or "rm_score"
    value = cfg.csft_prompt.split(":", 1)[1].strip() if ":" in cfg.csft_prompt else cfg.csft_prompt
    return condition_row({**row, key: value}, [key], cfg.input_key, cfg.apply_chat_template)[cfg.input_key]


def generate(cfg: BatchInferenceConfig, engines: list[Any] | None, stats: dict[str, Any]) -> list[dict[str, Any]]:
    """best_of_n samples per prompt on the engines -> rows, prompt-major."""
    path = resolve_pretrain(need(cfg.pretrain, "--pretrain"))
    tokenizer = load_tokenizer(path, use_fast=not cfg.disable_fast_tokenizer)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    prompts, first = prompt_slice(cfg, tokenizer)
    sampling = sampling_config(cfg, cfg.seed, stop_token_ids=stop_token_ids(tokenizer)).shifted(first)
    owned = engines is None
    if engines is None:
        engines, owns_ray, precision = start_engines(cfg, path)
        stats["precision"] = precision.summary()  # --param_dtype resolved, and why
    began = time.perf_counter()
    try:
        samples = generate_on_engines(engines, [p["prompt_ids"] for p in prompts], sampling)
    finally:
        if owned:
            stop_engines(engines, owns_ray)
    seconds = time.perf_counter() - began
    tokens = sum(len(s.response_ids) for s in samples)
    stats.update(prompts=len(prompts), samples=len(samples), generated_tokens=tokens,
                 generation_tokens_per_s=round(tokens / max(seconds, 1e-9), 1))
    rows = []
    for s in samples:
        prompt = prompts[s.prompt_index]
        row = {"input": prompt["prompt"], "output": tokenizer.decode(s.response_ids, skip_special_tokens=True),
               "prompt_index": first + s.prompt_index, "sample_index": s.sample_index,
               "finish_reason": s.finish_reason}
        if cfg.label_key:
            row["label"] = prompt["label"]
        rows.append(row)
    return rows


def start_engines(cfg: BatchInferenceConfig, path: str) -> tuple[list[Any], bool, Precision]:
    """The engines (--param_dtype resolved on this cluster), whether this call started Ray, and the precision
    decision."""
    from rlhfkit.engine.precision import apply_precision
    from rlhfkit.launch.ray_cluster import cluster_has_gpus, start_ray

    owns_ray = start_ray(cfg)
    precision = apply_precision(cfg, "cuda" if cluster_has_gpus() else "cpu", touch_device=False)
    dtype = precision.dtype
    log_dir = None if cfg.verbose or not cfg.output_path else f"{cfg.output_path}.logs"  # the engines' logs
    if cfg.eval_task == "generate":
        from rlhfkit.rollout.hf_engine import create_hf_engines

        return create_hf_engines(cfg.vllm_num_engines, path, dtype=ENGINE_DTYPES[dtype],
                                 log_dir=log_dir), owns_ray, precision
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    options = vllm_engine_spec(cfg, dtype=dtype, seed=cfg.seed).kwargs()  # the builder `ppo` uses too
    engines = create_vllm_engines(cfg.vllm_num_engines, path, log_dir=log_dir, **options)
    return engines, owns_ray, precision


def stop_engines(engines: list[Any], owns_ray: bool) -> None:
    import ray

    for engine in engines:
        ray.kill(engine)
    if owns_ray:
        ray.shutdown()


def read_scoring_rows(cfg: BatchInferenceConfig) -> list[dict[str, Any]]:
    """--eval_task rm: `{"input", "output"}` (+ "label") rows from --dataset (--input_key, --output_key)."""
    rows = []
    for row in blend_datasets(need(cfg.dataset, "--dataset"), cfg.dataset_probs, split=cfg.dataset_split, seed=cfg.seed,
                              max_samples=cfg.max_samples):
        out = {"input": get_field(row, cfg.input_key, "--input_key"),
               "output": get_field(row, need(cfg.output_key, "--output_key"), "--output_key")}
        if not (isinstance(out["input"], str) and isinstance(out["output"], str)):
            raise row_error(row, f"--eval_task rm scores text: --input_key {cfg.input_key!r} and --output_key "
                                 f"{cfg.output_key!r} must be strings (the prompt as the policy saw it, formatted)")
        if cfg.label_key:
            out["label"] = get_field(row, cfg.label_key, "--label_key")
        rows.append(out)
    if not rows:
        raise ConfigError(f"--dataset {cfg.dataset} has no rows")
    return rows


def score(cfg: BatchInferenceConfig, rows: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Add "reward" to every row: the reward of `input + output` from the configured source(s)."""
    from rlhfkit.rewards.sources import RewardSpec, reward_source_from_config

    has_reward = bool(cfg.reward_pretrain or cfg.remote_rm_url)  # else --eval_task rm with --pretrain: OpenRLHF's RM
    specs = RewardSpec(reward_pretrain=cfg.reward_pretrain if has_reward else cfg.pretrain,
                       remote_rm_url=cfg.remote_rm_url, normalize_reward=cfg.normalize_reward,
                       reward_timeout=cfg.reward_timeout, max_len=cfg.max_len, remote_rm_timeout=cfg.remote_rm_timeout,
                       remote_rm_retries=cfg.remote_rm_retries, remote_rm_backoff=cfg.remote_rm_backoff,
                       remote_rm_token=cfg.remote_rm_token,
                       remote_rm_max_response_mb=cfg.remote_rm_max_response_mb, code_sandbox=cfg.code_sandbox,
                       code_memory_mb=cfg.code_memory_mb, code_max_procs=cfg.code_max_procs,
                       code_max_open_files=cfg.code_max_open_files, code_max_file_mb=cfg.code_max_file_mb,
                       code_max_output_kb=cfg.code_max_output_kb)
    source = reward_source_from_config(specs, micro_batch_size=cfg.micro_batch_size)
    prompts = [str(r["input"]) for r in rows]
    labels = [r.get("label") for r in rows] if cfg.label_key else None
    began = time.perf_counter()
    out = source([p + str(r["output"]) for p, r in zip(prompts, rows)], prompts, labels)
    for row, reward in zip(rows, out.rewards.tolist()):
        row["reward"] = reward
    stats.update(reward_source=source.name, reward_mean=round(float(out.rewards.mean()), 6),
                 reward_seconds=round(time.perf_counter() - began, 3))


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """JSON lines, written to a temporary file and renamed: a crash never leaves half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, target)
    log.info("wrote %d rows to %s", len(rows), target)
