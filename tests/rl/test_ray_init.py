"""A cluster is not a laptop: only a cluster rlhfkit starts itself gets loopback and offline settings; a joined one
(--ray_address, RAY_ADDRESS, `ray job submit`) keeps the user's environment and runtime_env. And how a role's
--*_num_nodes x --*_num_gpus_per_node become placement-group bundles."""

from __future__ import annotations

import json

import pytest
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
from ray.runtime_env.runtime_env import _merge_runtime_env

from rlhfkit.errors import ConfigError
from rlhfkit.launch.ray_cluster import ENGINE_ENV, WORKER_ENV, ray_init_kwargs
from rlhfkit.rl.group import bundle_index, make_placement_group, placement_bundles

LAPTOP_ONLY = ("VLLM_HOST_IP", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def test_own_cluster_is_a_laptop_on_loopback_and_offline():
    kwargs = ray_init_kwargs(None, {})
    assert "address" not in kwargs and kwargs["_node_ip_address"] == "127.0.0.1"
    assert kwargs["include_dashboard"] is False
    env = kwargs["runtime_env"]["env_vars"]
    assert env == WORKER_ENV and env["VLLM_HOST_IP"] == "127.0.0.1" and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("flag, environ", [("10.1.2.3:6379", {}), (None, {"RAY_ADDRESS": "10.1.2.3:6379"})])
def test_joined_cluster_keeps_the_nodes_own_address_and_environment(flag, environ):
    kwargs = ray_init_kwargs(flag, environ)
    assert kwargs == {"address": "10.1.2.3:6379", "runtime_env": {"env_vars": ENGINE_ENV}}
    assert not set(LAPTOP_ONLY) & set(kwargs["runtime_env"]["env_vars"])  # no loopback, no offline switch
    assert "_node_ip_address" not in kwargs and "num_cpus" not in kwargs


def test_joined_under_ray_job_submit_passes_the_jobs_runtime_env_through():
    """Ray merges the job's runtime_env with the driver's ray.init one and refuses a variable set in both: rlhfkit
    leaves out what the job sets, so the job's value, working_dir and pip reach every worker."""
    job_env = {"working_dir": "gcs://_ray_pkg_abc.zip", "pip": ["rlhfkit"],
               "env_vars": {"TOKENIZERS_PARALLELISM": "true", "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0"}}
    environ = {"RAY_ADDRESS": "http://10.1.2.3:8265", RAY_JOB_CONFIG_JSON_ENV_VAR: json.dumps({"runtime_env": job_env})}
    kwargs = ray_init_kwargs(None, environ)
    ours = kwargs["runtime_env"]
    assert ours == {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    merged = _merge_runtime_env(job_env, ours)  # what ray.init does inside the job (None = a conflict)
    assert merged is not None
    assert merged["working_dir"] == job_env["working_dir"] and merged["pip"] == ["rlhfkit"]
    assert merged["env_vars"] == {**job_env["env_vars"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # the old behaviour, WORKER_ENV on every cluster, made such a job fail in ray.init
    assert _merge_runtime_env(job_env, {"env_vars": WORKER_ENV}) is None


def test_bundles_per_role():
    # one node: a bundle per rank, packed
    assert placement_bundles(1, 2, 1.0, gpus=False) == ([{"CPU": 1.0}, {"CPU": 1.0}], "PACK")
    # several CPU nodes: a bundle per node, each on a different node; rank r in bundle r // ranks_per_node
    assert placement_bundles(2, 3, 0.5, gpus=False) == ([{"CPU": 1.5}, {"CPU": 1.5}], "STRICT_SPREAD")
    # GPU clusters as OpenRLHF: a {GPU, CPU} bundle per rank, packed (a node's GPUs fill first)
    bundles, strategy = placement_bundles(2, 4, 1.0, gpus=True)
    assert bundles == [{"GPU": 1, "CPU": 1}] * 8 and strategy == "PACK"


class _Group:
    def __init__(self, bundles: int) -> None:
        self.bundle_specs = [{"CPU": 1}] * bundles


def test_bundle_index_maps_ranks_to_their_nodes_bundle():
    assert [bundle_index(_Group(4), r, 4) for r in range(4)] == [0, 1, 2, 3]  # a bundle per rank
    assert [bundle_index(_Group(2), r, 6) for r in range(6)] == [0, 0, 0, 1, 1, 1]  # 2 nodes x 3 ranks


def test_more_nodes_than_the_cluster_has_fails_fast(ray_cluster):
    """The suite's cluster has one node: a STRICT_SPREAD group over 2 would wait forever."""
    with pytest.raises(ConfigError, match="2 nodes asked for .* this Ray cluster has 1"):
        make_placement_group(2, 1, 1.0)


def test_engines_spread_over_cpu_nodes_or_sit_where_their_rank_does():
    from rlhfkit.rollout.vllm_engine import _actor_options

    assert _actor_options(0, False, 1, 0.5, None)["scheduling_strategy"] == "SPREAD"  # not colocated, CPU
    assert "scheduling_strategy" not in _actor_options(0, True, 1, 0.5, None)       # GPUs: Ray's default
    # --colocate_all_models on 2 CPU nodes x 2 ranks: engine k in the bundle of actor rank k's node
    bundles = [_actor_options(k, False, 1, 0.5, _Group(2), 1.0, 4)["scheduling_strategy"].placement_group_bundle_index
               for k in range(4)]
    assert bundles == [0, 0, 1, 1]
