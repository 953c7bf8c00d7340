"""A model group: N `ModelWorker` ranks placed by a Ray placement group, forming one torch process group.

Bundles come from `--<role>_num_nodes x --<role>_num_gpus_per_node`; on a cluster without GPUs each bundle asks
for a fraction of a CPU (Ray resources are logical: real threads are set by torch). Colocated roles pass the
same placement group, so their ranks share bundles (the hybrid engine layout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan
from rlhfkit.launch.ray_cluster import cluster_has_gpus
from rlhfkit.rl.ring import rank_rows, ring_size_of
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.heartbeat import Heartbeats, heartbeat_board
from rlhfkit.rollout.remote import Pending, RemoteMethod, method_name, remote_call_timeout

P = ParamSpec("P")
R = TypeVar("R")
Batch = dict[str, torch.Tensor]


def placement_bundles(num_nodes: int, gpus_per_node: int, cpus_per_bundle: float,
                      gpus: bool) -> tuple[list[dict[str, float]], str]:
    """(bundles, strategy) for a role of `num_nodes x gpus_per_node` ranks.

    GPU clusters: one {GPU: 1, CPU: 1} bundle per rank, PACK (as OpenRLHF: a node's GPUs fill before the next).
    CPU clusters, one node: one {CPU: cpus_per_bundle} bundle per rank, PACK. CPU clusters, several nodes: logical
    CPUs do not say how many ranks a node holds, so PACK would put every rank on one node; instead one bundle per
    node ({CPU: gpus_per_node x cpus_per_bundle}), STRICT_SPREAD (each on a different node), and rank r runs in
    bundle r // gpus_per_node (`bundle_index`)."""
    if gpus:
        return [{"GPU": 1, "CPU": 1} for _ in range(num_nodes * gpus_per_node)], "PACK"
    if num_nodes == 1:
        return [{"CPU": cpus_per_bundle} for _ in range(gpus_per_node)], "PACK"
    return [{"CPU": gpus_per_node * cpus_per_bundle} for _ in range(num_nodes)], "STRICT_SPREAD"


def make_placement_group(num_nodes: int, gpus_per_node: int, cpus_per_bundle: float) -> Any:
    """The placement group of one role (`placement_bundles`), once Ray has reserved it."""
    import ray
    from ray.util.placement_group import placement_group

    bundles, strategy = placement_bundles(num_nodes, gpus_per_node, cpus_per_bundle, cluster_has_gpus())
    alive = sum(node["Alive"] for node in ray.nodes())
    if strategy == "STRICT_SPREAD" and alive < num_nodes:  # Ray would wait for the nodes forever
        from rlhfkit.errors import ConfigError

        raise ConfigError(f"{num_nodes} nodes asked for (--*_num_nodes) but this Ray cluster has {alive}: on one "
                          f"node use --*_num_nodes 1 --*_num_gpus_per_node {num_nodes * gpus_per_node} (same ranks)")
    group = placement_group(bundles, strategy=strategy)
    if not group.wait(timeout_seconds=remote_call_timeout()):
        from rlhfkit.errors import RemoteCallTimeout

        raise RemoteCallTimeout(f"placement group of {len(bundles)} bundles {bundles} ({strategy}) not ready within "
                                f"{remote_call_timeout():g} s (--remote_call_timeout): the cluster lacks the "
                                "resources, or a node is gone", role="placement", ranks=[], method="ready",
                                waited_s=remote_call_timeout())
    return group


def bundle_index(placement_group: Any, rank: int, world_size: int) -> int:
    """The bundle rank `rank` of `world_size` runs in: its own bundle, or its node's (CPU multi-node groups)."""
    return rank * len(placement_group.bundle_specs) // world_size


class ModelGroup:
    """Creates the ranks, initialises their models, and splits batches across them. Each rank beats to the job's
    heartbeat board (`rlhfkit.rollout.heartbeat`), and every wait on the ranks checks the beats: a rank silent for
    `--trainer_hang_timeout` seconds (0: not checked) is killed and named hung (`heartbeats`)."""

    def __init__(self, role: str, cfg: PPOConfig, placement_group: Any, world_size: int, num_nodes: int = 1,
                 share_bundles: float = 1.0, cpu_threads_share: int = 0, *, plan: RunPlan | None = None) -> None:
        """`cfg`: the run's typed config, sent to every rank as it is, with `plan`, the run's plan (ModelWorker);
        `cpu_threads_share`: the model ranks that split a node's cores on CPU (0: this role's ranks per node)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role = role
        self.placement_group = placement_group
        self.params = 0  # the model's parameter count, once init_model has run (rl.setup)
        self.ring = ring_size_of(role, cfg)  # --ring_attn_size: a ring group's ranks take the same rows
        board = heartbeat_board() if cfg.trainer_hang_timeout > 0 else None
        self.heartbeats = Heartbeats(board, cfg.trainer_hang_timeout) if board is not None else None
        gpus = cluster_has_gpus()
        remote_cls = ray.remote(ModelWorker)
        self.workers: list[Any] = []
        master_addr, master_port = "127.0.0.1", 0
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index(placement_group, rank,
                                                                                           world_size))
            resources = {"num_gpus": share_bundles, "num_cpus": 0} if gpus else {"num_cpus": share_bundles * 0.25}
            worker = remote_cls.options(scheduling_strategy=strategy, **resources, name=None)
            if rank == 0:
                node_ip, master_port = ray.get(ray.remote(_rendezvous_address).options(
                    scheduling_strategy=strategy, num_cpus=0).remote(), timeout=remote_call_timeout())
                # One node: rendezvous on loopback; several: on rank 0's node address.
                master_addr = "127.0.0.1" if num_nodes == 1 else node_ip
            self.workers.append(worker.remote(role, cfg, rank, world_size, master_addr, master_port,
                                             cpu_threads_share, board, plan))

    def shutdown(self) -> None:
        """Kill the ranks (their process group goes with them)."""
        import ray

        for worker in self.workers:
            ray.kill(worker)
        if self.heartbeats is not None:
            self.heartbeats.board.forget.remote([w._actor_id.hex() for w in self.workers])
        self.workers = []

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: Callable[Concatenate[ModelWorker, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call `method` (a `ModelWorker` method: `group.call(ModelWorker.save_hf, path, spec)`) on every rank with
        the same arguments; return every rank's result, typed from the method."""
        return self._call_async(method, *args, **kwargs).get()

    def call_async(self, method: Callable[Concatenate[ModelWorker, P], R], *args: P.args,
                   **kwargs: P.kwargs) -> Pending[list[R]]:
        """`call` without waiting: `.get()` every rank's result."""
        return self._call_async(method, *args, **kwargs)

    def _call_async(self, method: RemoteMethod, *args: Any, **kwargs: Any) -> Pending[list[Any]]:
        name = worker_method(method)
        return Pending([getattr(w, name).remote(*args, **kwargs) for w in self.workers], list,
                       (self.role, name, self.workers), self.heartbeats)

    def rank_rows(self, rows: int) -> list[list[int]]:
        """The rows of a `rows`-row batch each rank takes: split over the data-parallel ranks, the same rows for the
        ranks of one ring group (--ring_attn_size, rlhfkit.rl.ring)."""
        return rank_rows(rows, self.world_size, self.ring)

    def map_rows(self, method: Callable[Concatenate[ModelWorker, Batch, P], torch.Tensor], batch: Batch,
                 *args: P.args, **kwargs: P.kwargs) -> torch.Tensor:
        """Split `batch` by rows across the data-parallel ranks (contiguous, balanced), call `method`, concatenate
        the results (of each ring group's first rank).

        Every rank gets at least one row so that FSDP2's collectives line up; with fewer rows than ranks the
        first row is repeated and its extra results dropped.
        """
        return self.map_rows_async(method, batch, *args, **kwargs).get()

    def map_rows_async(self, method: Callable[Concatenate[ModelWorker, Batch, P], torch.Tensor], batch: Batch,
                       *args: P.args, **kwargs: P.kwargs) -> Pending[torch.Tensor]:
        """`map_rows` without waiting: `.get()` the result."""
        name = worker_method(method)
        parts = self.rank_rows(batch["sequences"].shape[0])
        refs = []
        for worker, part in zip(self.workers, parts):
            index = torch.tensor(part or [0], dtype=torch.long)
            refs.append(getattr(worker, name).remote({k: v[index] for k, v in batch.items()}, *args, **kwargs))
        ring = self.ring
        return Pending(refs, lambda outputs: torch.cat([out[:len(part)] for out, part in
                                                        zip(outputs[::ring], parts[::ring])]),
                       (self.role, name, self.workers), self.heartbeats)

    def scatter(self, method: Callable[Concatenate[ModelWorker, Batch, ...], R], shards: Sequence[Batch],
                *args: Any, per_rank: Sequence[Sequence[Any]] | None = None) -> list[R]:
        """Call `method(shards[r], *args, *per_rank[r])` on rank r; return every rank's result (typed from the
        method's return type; the per-rank arguments are not checked)."""
        return self.scatter_async(method, shards, *args, per_rank=per_rank).get()

    def scatter_async(self, method: Callable[Concatenate[ModelWorker, Batch, ...], R], shards: Sequence[Batch],
                      *args: Any, per_rank: Sequence[Sequence[Any]] | None = None, **kwargs: Any) -> Pending[list[R]]:
        """`scatter` without waiting: `.get()` the results."""
        name = worker_method(method)
        extras = per_rank if per_rank is not None else [()] * len(self.workers)
        return Pending([getattr(w, name).remote(s, *args, *extra, **kwargs)
                        for w, s, extra in zip(self.workers, shards, extras)], list, (self.role, name, self.workers),
                       self.heartbeats)


def run_side_by_side(calls: Sequence[tuple[ModelGroup, Callable[[], Pending[Any]]]]) -> list[Any]:
    """Run calls on several groups: groups on different placement groups at the same time, groups that share
    bundles (colocated) one after another, in the given order. `calls`: (group, start) with `start()` sending the
    work and returning its `Pending`. Returns the results in order."""
    results: list[Any] = [None] * len(calls)
    buckets: dict[int, list[int]] = {}
    for i, (group, _) in enumerate(calls):
        buckets.setdefault(id(group.placement_group), []).append(i)
    first = {indices[0]: calls[indices[0]][1]() for indices in buckets.values()}
    for indices in buckets.values():
        results[indices[0]] = first[indices[0]].get()
        for i in indices[1:]:
            results[i] = calls[i][1]().get()
    return results


def worker_method(method: RemoteMethod) -> str:
    """The name of a `ModelWorker` method given as the method itself (`ModelWorker.log_probs`); a method of another
    class is refused (it would reach a same-named worker method, or none), and so is a name as a string."""
    name = method_name(method)
    if getattr(ModelWorker, name, None) is not method:
        raise TypeError(f"{getattr(method, '__qualname__', name)} is not a ModelWorker method: a model group's ranks "
                        f"are ModelWorkers (pass e.g. ModelWorker.{name})")
    return name


def _rendezvous_address() -> tuple[str, int]:
    """(node IP, free port) on the node where it runs: rank 0's node."""
    import ray

    from rlhfkit.engine.distributed import free_port

    return ray.util.get_node_ip_address(), free_port()
