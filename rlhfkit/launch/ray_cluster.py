"""Start or join the Ray cluster of a run (`rlhfkit ppo`, `rlhfkit batch-inference`), and what its workers need."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from rlhfkit.config.commands import BatchInferenceConfig, PPOConfig
from rlhfkit.engine.precision import cpu_matmul_rates

# What every Ray worker of a run needs (vLLM in the actor's own process, no tokenizer fork warnings) ...
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
# ... and what only a cluster rlhfkit starts itself gets: a laptop's loopback and offline settings. A joined cluster
# (--ray_address / RAY_ADDRESS / `ray job submit`) keeps the user's environment and each node's own address.
WORKER_ENV = {**ENGINE_ENV, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_ray(cfg: PPOConfig | BatchInferenceConfig) -> bool:
    """Join --ray_address / RAY_ADDRESS (e.g. under `ray job submit`), else start a local cluster on loopback.
    Returns True when this process started the cluster."""
    import ray

    if not cfg.verbose:
        quiet_driver_libraries()
    if ray.is_initialized():
        return False
    if not torch.cuda.is_available():
        cpu_matmul_rates()  # the precision probe, before Ray's start-up processes compete for the cores (cached)
    # Without --verbose the actors' output stays off the console: each model rank and engine writes it to a file
    # of its own under the run folder (`redirect_output`), and Ray's own start-up notices are errors-only.
    ray.init(**ray_init_kwargs(cfg.ray_address, os.environ), log_to_driver=cfg.verbose,
             logging_level=logging.INFO if cfg.verbose else logging.ERROR)
    return True


def quiet_driver_libraries() -> None:
    """The driver's console keeps rlhfkit's lines: no datasets / transformers progress bars or info notices."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def ray_init_kwargs(ray_address: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """`ray.init` arguments for a run.

    Own cluster (no --ray_address, no RAY_ADDRESS): started on 127.0.0.1, workers get `WORKER_ENV` (loopback for
    vLLM, HF offline). Joined cluster: only `ENGINE_ENV`, leaving out any variable the user's runtime_env sets
    (under `ray job submit` Ray merges the job's runtime_env, working_dir, pip, env_vars, with this one and fails
    on a variable set in both); no loopback, no offline switch: each node uses its own address and environment."""
    address = ray_address or environ.get("RAY_ADDRESS")
    if not address:
        return {"num_cpus": max(8, os.cpu_count() or 1), "include_dashboard": False,
                "_node_ip_address": "127.0.0.1", "runtime_env": {"env_vars": dict(WORKER_ENV)}}
    job_env = _job_runtime_env(environ).get("env_vars") or {}
    return {"address": address, "runtime_env": {"env_vars": {k: v for k, v in ENGINE_ENV.items() if k not in job_env}}}


def _job_runtime_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The runtime_env of the Ray job this driver runs in (`ray job submit --runtime-env-json`), else {}."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    raw = environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
