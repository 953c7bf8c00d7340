"""Weight sync over a torch.distributed broadcast (`--vllm_sync_backend gloo|nccl`), as OpenRLHF does on GPU.

One process group spans the sender (rank 0: trainer rank 0, or any process holding full weights) and every engine
worker (engine k's tensor-parallel rank r is `1 + sum(workers of engines < k) + r`). It is *not* the default
process group of any side (the trainer has its FSDP group, vLLM its own): it is built from a `TCPStore` whose
server lives in the sender, by constructing the backend object directly (`ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on CUDA). Building it is a rendezvous: the engines' join calls are launched with `.remote()`
while the sender builds its side, then awaited. The group is built once and reused for every sync.

Each bucket travels as one flat byte buffer: the sender packs the bucket's tensors (at 64-byte aligned offsets),
sends the metadata (name, shape, dtype per tensor) to every engine through Ray, and broadcasts the buffer; each
engine worker allocates a buffer of the same size, receives it, cuts it back into named tensors
(`WeightGroupMember.receive`, shared by the vLLM and the HF engine) and loads them with the same in-place
begin/load/finish update the Ray transport uses. One bucket is in flight at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlhfkit.rollout.buckets import DEFAULT_BUCKET_BYTES, iter_buckets
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.lora_sync import begin_update, finish_update
from rlhfkit.rollout.remote import RemoteActors, remote_call_timeout, wait_remote
from rlhfkit.rollout.types import NamedTensors, SyncStats

BROADCAST_BACKENDS = ("gloo", "nccl")
JOINED_KEY = "rlhfkit_weight_sync_joined"  # each member adds 1 once its store client is up (the sender polls it)
JOIN_POLL_S = 0.2
ALIGN = 64  # byte alignment of each tensor inside a bucket buffer (any dtype can view it)
_PREFIX = "rlhfkit_weight_sync"

BucketMeta = list[tuple[str, tuple[int, ...], torch.dtype]]


def check_backend(backend: str, cuda: bool) -> None:
    """Raise a clear ValueError for an unknown backend, or for nccl where CUDA is missing."""
    if backend not in BROADCAST_BACKENDS:
        raise ValueError(f"unknown weight broadcast backend {backend!r}: expected one of {BROADCAST_BACKENDS} "
                         "(or the Ray object store transport: --vllm_sync_backend ray)")
    if backend == "nccl" and not cuda:
        raise ValueError("weight broadcast backend 'nccl' (--vllm_sync_backend nccl) needs CUDA on the sender and "
                         "on every engine; without GPUs use gloo (a torch.distributed broadcast on CPU) or ray")


def group_device(backend: str) -> torch.device:
    """Where a bucket buffer lives for `backend`: the current CUDA device for nccl, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group backend object on `store` that never touches torch's default/global group state."""
    store = dist.PrefixStore(_PREFIX, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast(group: Any, buffer: torch.Tensor) -> Any:
    """Start broadcasting `buffer` from rank 0 (in place on the other ranks); returns the work to wait on."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([buffer], options)


def _offsets(meta: BucketMeta) -> tuple[list[int], int]:
    """Byte offset of each tensor in a bucket buffer, and the buffer's size."""
    offsets, end = [], 0
    for _, shape, dtype in meta:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _numel(shape) * dtype.itemsize
    return offsets, end


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def pack_bucket(bucket: NamedTensors, device: torch.device,
                staging: torch.Tensor | None = None) -> tuple[BucketMeta, torch.Tensor]:
    """(metadata, one flat uint8 buffer on `device` holding every tensor of the bucket). The buffer is the head of
    `staging` when that is large enough (the sender reuses one: fresh large buffers cost page faults)."""
    meta: BucketMeta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    offsets, size = _offsets(meta)
    if staging is not None and staging.numel() >= size and staging.device == device:
        buffer = staging[:size]
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)  # alignment gaps stay unset: never read
    for (_, tensor), start in zip(bucket, offsets):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start:start + flat.numel()].copy_(flat)
    return meta, buffer


def unpack_bucket(meta: BucketMeta, buffer: torch.Tensor) -> NamedTensors:
    """Named tensors viewing `buffer` (the inverse of `pack_bucket`)."""
    offsets, _ = _offsets(meta)
    out: NamedTensors = []
    for (name, shape, dtype), start in zip(meta, offsets):
        nbytes = _numel(shape) * dtype.itemsize
        out.append((name, buffer[start:start + nbytes].view(dtype).view(shape)))
    return out


class WeightGroupMember:
    """An engine worker's side of the weight group: joins it, then receives one bucket per `receive` call.

    Used by the vLLM worker extension (one member per tensor-parallel worker) and by the HF engine.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str,
                 timeout_s: float | None = None) -> None:
        check_backend(backend, torch.cuda.is_available())
        timeout_s = remote_call_timeout() if timeout_s is None else timeout_s
        self.backend, self.rank = backend, rank
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        store.add(JOINED_KEY, 1)  # tells the sender this member is alive and about to build its side
        self.store: dist.TCPStore | None = store  # None once closed
        self.group = new_group(backend, store, rank, world_size, timeout_s)

    def receive(self, meta: BucketMeta) -> NamedTensors:
        """Allocate the bucket's buffer from `meta`, receive the sender's broadcast into it, return named tensors.

        A fresh buffer per bucket: the returned tensors view it, and vLLM may hold a layer's tensors until the
        layer's last piece arrives in a later bucket."""
        _, size = _offsets(meta)
        buffer = torch.empty(size, dtype=torch.uint8, device=group_device(self.backend))
        broadcast(self.group, buffer).wait()
        return unpack_bucket(meta, buffer)

    def close(self) -> None:
        """Leave the group (drop the backend and the store client)."""
        self.group = None
        self.store = None


class WeightGroupSlot:
    """An engine's (or engine worker's) membership of at most one weight group: `join` replaces an earlier group,
    `receive` needs one, `leave` drops it. Shared by the HF engine and the vLLM worker extension."""

    def __init__(self) -> None:
        self.member: WeightGroupMember | None = None

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> int:
        self.leave()
        self.member = WeightGroupMember(host, port, rank, world_size, backend, timeout_s)
        return rank

    def receive(self, meta: BucketMeta) -> NamedTensors:
        if self.member is None:
            raise RuntimeError("a weight bucket arrived before this engine joined the weight group: the sender "
                               "builds the group first (join_weight_group)")
        return self.member.receive(meta)

    def leave(self) -> None:
        if self.member is not None:
            self.member.close()
        self.member = None


class WeightBroadcaster:
    """The sender (rank 0): builds the group with `engines` (Ray actor handles of vLLM or HF engines) and
    broadcasts buckets of full weights to all of them. Usable from any process: a trainer rank, a driver, a test.

        sender = WeightBroadcaster(engines, "gloo")
        stats = sender.sync(named_weights_for_sync(model), bucket_bytes=64 << 20)  # again every step
        sender.close()
    """

    def __init__(self, engines: Sequence[Any], backend: str = "gloo", *, timeout_s: float | None = None,
                 host: str | None = None) -> None:
        import ray

        check_backend(backend, torch.cuda.is_available())
        if not engines:
            raise ValueError("WeightBroadcaster needs at least one engine")
        self.timeout_s = timeout_s = remote_call_timeout() if timeout_s is None else timeout_s
        infos = RemoteActors(engines, role="engine", timeout_s=timeout_s).call(RolloutEngine.weight_sync_info)
        if backend == "nccl" and not all(info["cuda"] for info in infos):
            check_backend(backend, cuda=False)
        self.engines, self.backend = list(engines), backend
        self.device = group_device(backend)
        world_size = 1 + sum(info["workers"] for info in infos)
        host = host or ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        self.store: dist.TCPStore | None = store  # None once dropped
        offsets = [1 + sum(info["workers"] for info in infos[:k]) for k in range(len(infos))]
        joins = [e.join_weight_group.remote(host, store.port, offset, world_size, backend, timeout_s)
                 for e, offset in zip(self.engines, offsets)]
        self._await_members(store, joins, world_size - 1)
        try:
            self.group = new_group(backend, store, 0, world_size, timeout_s)  # completes with the joins
        except Exception:  # an engine died between reaching the store and joining: name it if so
            wait_remote(joins, role="engine", method="join_weight_group", handles=self.engines, timeout_s=1.0)
            raise
        wait_remote(joins, role="engine", method="join_weight_group", handles=self.engines, timeout_s=timeout_s)
        self.world_size = world_size
        self._staging: torch.Tensor | None = None

    def _await_members(self, store: dist.TCPStore, joins: list[Any], members: int) -> None:
        """Wait until every engine worker has reached the store before building the sender's side (whose
        constructor blocks, uninterruptibly, until all ranks connect): an engine that dies or hangs before joining
        raises at once (`RemoteActorDied`) or at the deadline (`RemoteCallTimeout`) instead of blocking here."""
        import ray

        began = time.monotonic()
        while store.add(JOINED_KEY, 0) < members:
            done, _ = ray.wait(joins, num_returns=len(joins), timeout=JOIN_POLL_S)
            if done or time.monotonic() - began > self.timeout_s:
                # a join that returned before the group exists failed (died, or raised): name it; else the deadline
                ranks = [joins.index(r) for r in done] or list(range(len(joins)))
                wait_remote(done or joins, role="engine", method="join_weight_group", ranks=ranks,
                            handles=[self.engines[k] for k in ranks], timeout_s=self.timeout_s, started=began)
                raise RuntimeError(f"engines {ranks} returned from join_weight_group before the group was built")

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, lora_config: dict[str, Any] | None = None,
             keep_vision_tower: bool = False) -> SyncStats:
        """Replace every engine's weights in place with `named_tensors` (full HF-named tensors, consumed lazily,
        one bucket at a time); returns the same `SyncStats` as the Ray transport. With `lora_config` the tensors
        are a LoRA adapter's, served as a new adapter on the engines' base (`rlhfkit.rollout.lora_sync`).
        `keep_vision_tower`: the tensors leave out a frozen vision tower, which the engines keep."""
        if self.group is None:
            raise RuntimeError("WeightBroadcaster.sync after close(): create a new WeightBroadcaster")
        start = time.perf_counter()
        begin_update(self.engines, lora_config, self.timeout_s, keep_vision_tower=keep_vision_tower)
        total_bytes = buckets = tensors = 0
        for bucket in iter_buckets(named_tensors, bucket_bytes, device=self.device):
            self._send(bucket)
            buckets += 1
            tensors += len(bucket)
            total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        finish_update(self.engines, lora_config, self.timeout_s)
        return SyncStats(seconds=time.perf_counter() - start, bytes=total_bytes, buckets=buckets, tensors=tensors)

    def _send(self, bucket: NamedTensors) -> None:
        """Metadata to every engine through Ray, the bytes through the group; returns once all engines loaded it."""

        meta, buffer = pack_bucket(bucket, self.device, self._staging)
        if self._staging is None or buffer.numel() > self._staging.numel():
            self._staging = buffer  # reused by the next buckets (the previous broadcast has completed)
        loads = [e.receive_weight_bucket.remote(meta) for e in self.engines]
        work = broadcast(self.group, buffer)
        try:
            wait_remote(loads, role="engine", method="receive_weight_bucket", handles=self.engines,
                        timeout_s=self.timeout_s)
        except BaseException:
            self._drop(abort=True)  # an engine failed mid-bucket: the group is out of step, never reuse it
            raise
        work.wait()

    def _drop(self, abort: bool = False) -> None:
        if abort and self.group is not None:
            self.group.abort()  # unblocks this side's pending broadcast
        self.group, self.store, self._staging = None, None, None

    def close(self) -> None:
        """Make the engines leave the group, then drop the sender's side. An engine that died meanwhile (it is being
        replaced) cannot leave: the group is dropped all the same."""
        from rlhfkit.errors import RemoteCallError

        if self.group is None:
            return
        try:
            RemoteActors(self.engines, role="engine", timeout_s=min(self.timeout_s, 30.0)).call(
                RolloutEngine.leave_weight_group)
        except RemoteCallError:
            self._drop(abort=True)
            return
        self._drop()
