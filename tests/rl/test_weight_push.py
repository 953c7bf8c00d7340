"""The online loop's weight sync transport (`--vllm_sync_backend`): flag resolution, and a short RL run over the
gloo broadcast that matches the same run over the Ray object store (the engines get identical weights)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from ppo_helpers import run

from rlhfkit.config.plan import resolve_sync_backend
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import ConfigError

HERE = Path(__file__).parent


@pytest.mark.parametrize(("requested", "gpus", "colocated", "want"), [
    ("auto", False, False, "gloo"), ("auto", False, True, "gloo"), ("auto", True, False, "nccl"),
    ("auto", True, True, "ray"), ("ray", True, True, "ray"), ("gloo", True, True, "gloo"),
    ("gloo", False, False, "gloo"), ("nccl", True, False, "nccl"),
])
def test_resolve_sync_backend(requested, gpus, colocated, want):
    assert resolve_sync_backend(requested, gpus, colocated) == want


def test_nccl_without_gpus_falls_back_to_gloo_with_one_warning(caplog):
    """One launch script (`--vllm_sync_backend nccl`) runs on a CPU machine and on a GPU cluster (#13): the run's
    plan (resolve_plan on ppo's parsed flags) sends the weights over gloo on a cluster without GPUs, with one
    warning that the default (auto) does not give; on GPUs the flag's transport is the plan's where auto would pick
    another."""
    from rlhfkit.config.parse import flags_to_argv, parse_config
    from rlhfkit.config.plan import resolve_plan

    def ppo(**flags):
        return parse_config("ppo", None, flags_to_argv({"pretrain": "m", "prompt_data": "p",
                                                        "remote_rm_url": "builtin:format", **flags}))

    warning = ("--vllm_sync_backend nccl: this Ray cluster has no GPUs, so the weights go over gloo, the same "
               "broadcast on CPU")
    with caplog.at_level(logging.WARNING, logger="rlhfkit.config.plan"):
        assert resolve_plan(ppo(vllm_sync_backend="nccl"), has_gpus=False).sync_transport == "gloo"
    assert [r.getMessage() for r in caplog.records] == [warning]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhfkit.config.plan"):
        assert resolve_plan(ppo(), has_gpus=False).sync_transport == "gloo"  # auto: gloo, silently
        assert resolve_plan(ppo(vllm_sync_backend="nccl"), has_gpus=True).sync_transport == "nccl"
    assert caplog.records == []
    assert resolve_plan(ppo(), has_gpus=True).sync_transport == "nccl"  # auto, engines apart
    assert resolve_plan(ppo(vllm_sync_backend="gloo"), has_gpus=True).sync_transport == "gloo"
    assert resolve_plan(ppo(vllm_sync_backend="ray"), has_gpus=True).sync_transport == "ray"


def test_nccl_with_colocation_or_an_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="--vllm_sync_backend nccl cannot be used with --colocate_all_models"):
        resolve_sync_backend("nccl", has_gpus=True, colocated=True)
    with pytest.raises(ConfigError, match="--vllm_sync_backend 'mpi'"):
        resolve_sync_backend("mpi", has_gpus=False, colocated=False)


def test_nccl_on_a_cpu_cluster_resolves_to_gloo(ray_cluster, tmp_path):
    from rlhfkit.config.parse import parse_config
    from rlhfkit.config.plan import resolve_plan
    from rlhfkit.launch.ray_cluster import cluster_has_gpus

    if ray_cluster.cluster_resources().get("GPU", 0) > 0:
        pytest.skip("the Ray cluster has GPUs")
    cfg = parse_config("ppo", None, ["--pretrain", "m", "--vllm.sync_backend", "nccl"])  # 0.11's name
    assert cfg.vllm_sync_backend == "nccl"
    assert resolve_plan(cfg, cluster_has_gpus()).sync_transport == "gloo"


@pytest.mark.slow
def test_gloo_broadcast_run_matches_the_ray_run(tiny_model_dir, rollout_vllm_engine, tmp_path):
    """Two steps each on 2 FSDP actor ranks (every rank gathers, rank 0 sends); the second step's rollout uses the
    weights synced after the first update."""
    prompts = write_jsonl(echo_rows(8, seed=3), tmp_path / "prompts.jsonl")
    rows = {backend: run(tiny_model_dir, prompts, tmp_path / backend, rollout_vllm_engine, max_samples=8,
                         vllm_sync_backend=backend, weight_sync_bucket_mb=1, actor_num_gpus_per_node=2)
            for backend in ("ray", "gloo")}
    assert [r["step"] for r in rows["gloo"]] == [1, 2]
    for ray_row, gloo_row in zip(rows["ray"], rows["gloo"]):
        assert gloo_row["sync/bytes"] == ray_row["sync/bytes"] > 0
        assert gloo_row["sync/buckets"] == ray_row["sync/buckets"] > 1
        assert gloo_row["time/weight_sync"] > 0
        for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/grad_norm", "train/entropy",
                    "rollout/logprob_abs_diff_mean"):
            assert gloo_row[key] == pytest.approx(ray_row[key], rel=1e-5, abs=1e-6), key
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows["gloo"]) < 1e-3
