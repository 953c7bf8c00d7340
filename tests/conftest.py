"""Session-wide fixtures: tiny random-init models (built once) and one Ray cluster for the whole suite."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# `--param_dtype auto` means fp32 in the suite on every CPU (bf16 on AVX512-BF16 CPUs otherwise), so tolerances
# hold on both machine kinds; bf16 paths are tested with explicit flags, auto itself in tests/engine/test_precision.
os.environ.setdefault("RLHFKIT_AUTO_DTYPE", "fp32")


GPU_ONLY_SKIP_WORDS = ("CUDA", "GPU")


def pytest_configure(config):
    """Register tests/option_record.py: the per-test record of the options each test sets (read by
    tools/check_option_claims.py) and the forced defaults of tools/revert_check.py."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("rlhfkit_option_record", Path(__file__).with_name("option_record.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config.pluginmanager.register(module, "rlhfkit-option-record")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (`CI` set) a skip is allowed only for GPU-only paths: any other skip (a missing browser, a missing
    package) fails, so CI cannot go green without the check the test makes."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if not any(word in reason for word in GPU_ONLY_SKIP_WORDS):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where only GPU-only tests may skip: {reason}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Llama-family causal LM (2 layers, hidden 64, head_dim 32) with SmolLM2's tokenizer and template."""
    from rlhfkit.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("tiny_lm")))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> str:
    """The same tiny architecture with a scalar `score` head (AutoModelForSequenceClassification, num_labels=1)."""
    from rlhfkit.models.tiny import build_tiny_scalar_model

    return build_tiny_scalar_model(str(tmp_path_factory.mktemp("tiny_rm")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from rlhfkit.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def echo_prompt_file(tmp_path_factory) -> str:
    """The prompt set of the online RL tests: 48 "Repeat: <two words>" rows (`echo_rows(48, seed=3)`)."""
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    return write_jsonl(echo_rows(48, seed=3), tmp_path_factory.mktemp("echo_prompts") / "prompts.jsonl")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs it (logical CPUs > cores so all roles fit)."""
    import ray

    if not ray.is_initialized():
        from rlhfkit.launch.ray_cluster import WORKER_ENV

        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": WORKER_ENV})
    yield ray
    ray.shutdown()


ROLLOUT_MAX_MODEL_LEN = 512
ROLLOUT_KV_CACHE_BYTES = 64 * 2**20  # the tiny model needs 1 KiB of KV per token: ~64k tokens


@pytest.fixture(scope="session")
def vllm_engine_session(ray_cluster, tiny_model_dir):
    """The session's one `VLLMEngine` Ray actor on the tiny fp32 model (prefix caching on, eager, seed 0)."""
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    start = time.perf_counter()
    [engine] = create_vllm_engines(
        1,
        tiny_model_dir,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=ROLLOUT_MAX_MODEL_LEN,
        cpu_kv_cache_bytes=ROLLOUT_KV_CACHE_BYTES,
        dtype="float32",
        seed=0,
        num_cpus_per_engine=0.5,
    )
    print(f"\n[rollout] vLLM engine actor ready in {time.perf_counter() - start:.1f} s")
    yield engine
    ray_cluster.kill(engine)


@pytest.fixture(scope="session")
def tiny_model_weights(tiny_model_dir) -> list:
    """The tiny model's original weights, as the weight sync sends them."""
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.rollout.weight_sync import named_weights_for_sync

    return list(named_weights_for_sync(load_causal_lm(tiny_model_dir)))


@pytest.fixture
def rollout_vllm_engine(vllm_engine_session, tiny_model_weights):
    """The session's vLLM engine holding the tiny model's original weights at the start of every test
    (RL tests train and sync new weights into it)."""
    from rlhfkit.rollout.weight_sync import sync_weights

    sync_weights([vllm_engine_session], tiny_model_weights)
    return vllm_engine_session


@pytest.fixture(scope="session")
def rollout_hf_engine(ray_cluster, tiny_model_dir):
    """An `HFEngine` Ray actor on the tiny fp32 model (the `--rollout_backend hf` fallback)."""
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="float32", num_cpus_per_engine=0.5)
    yield engine
    ray_cluster.kill(engine)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> str:
    """A tiny random Idefics3 vision-language model + processor (rlhfkit/models/tiny_vlm.py)."""
    from rlhfkit.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="session")
def vlm_engine_session(ray_cluster, tiny_vlm_dir):
    """The session's one vLLM engine on the tiny VLM (fp32, 256 tokens of context)."""
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    start = time.perf_counter()
    [engine] = create_vllm_engines(1, tiny_vlm_dir, max_model_len=256, cpu_kv_cache_bytes=16 * 2**20,
                                   dtype="float32", num_cpus_per_engine=0.5)
    print(f"\n[rollout] vLLM VLM engine actor ready in {time.perf_counter() - start:.1f} s")
    yield engine
    ray_cluster.kill(engine)


@pytest.fixture
def vlm_engine(vlm_engine_session, tiny_vlm_dir):
    """The session's VLM engine holding the tiny VLM's original weights (vision tower included) at the start."""
    from rlhfkit.models.vision import load_vlm
    from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

    sync_weights([vlm_engine_session], list(named_weights_for_sync(load_vlm(tiny_vlm_dir))))
    return vlm_engine_session
