"""Ray gives an actor that asks for a fraction of a CPU one thread; rlhfkit's workers and engines use the node's
cores split among the processes that compute at the same time."""

from __future__ import annotations

import pytest
from ray.util.placement_group import remove_placement_group

from rlhfkit.config.parse import parse_config
from rlhfkit.engine import cpu_threads
from rlhfkit.rl.group import ModelGroup, make_placement_group
from rlhfkit.rl.worker import ModelWorker

pytestmark = pytest.mark.slow


def test_threads_split_the_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads, "node_cores", lambda: 8)
    assert [cpu_threads.cpu_threads(share) for share in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_ray_alone_gives_one_thread_and_the_workers_take_the_cores(ray_cluster):
    @ray_cluster.remote(num_cpus=0.25)
    def ray_default() -> int:
        import torch

        return torch.get_num_threads()

    cores = cpu_threads.node_cores()
    assert ray_cluster.get(ray_default.remote()) == 1  # what every model worker computed on before
    for ranks, requested, expected in ((1, 0, cores), (2, 0, max(1, cores // 2)), (1, 1, 1)):
        cfg = parse_config("ppo", None, ["--torch_threads_per_worker", str(requested)])
        pg = make_placement_group(1, ranks, 1.0)
        group = ModelGroup("actor", cfg, pg, ranks)
        try:
            assert group.call(ModelWorker.compute_threads) == [expected] * ranks, (ranks, requested)
        finally:
            group.shutdown()
            remove_placement_group(pg)


def test_the_session_engine_computes_on_every_core(vllm_engine_session, ray_cluster):
    assert ray_cluster.get(vllm_engine_session.compute_threads.remote()) == cpu_threads.node_cores()
