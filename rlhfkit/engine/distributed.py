"""Process-group set-up for 1..N ranks: torchrun today, a Ray worker later (it sets the same env vars).

gloo on CPU, NCCL on CUDA. A single process still gets a 1-rank group so FSDP2 runs the same code path.
"""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ephemeral_port_range() -> tuple[int, int]:
    """The range the kernel hands out for outgoing connections (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port unused on every address of this host: torch's TCPStore listens on all of them, so a port free on
    127.0.0.1 alone can still be taken on the node's address (or the reverse), EADDRINUSE.

    The port is drawn below the ephemeral range: the rendezvous binds it only later, in another process, and a port
    from the ephemeral range (what ``bind(0)`` returns) can be taken in between by any outgoing connection of the
    machine (gloo opens many while process groups form); one below it can only be taken by another explicit bind.
    """
    low = ephemeral_port_range()[0]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all tried were taken: any free port
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_distributed() -> DistInfo:
    """Join (or create) the default process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT."""
    launched = "RANK" in os.environ
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A plain single process (no launcher) gets a private 1-rank group on a free loopback port.
        init_method = "env://" if launched else f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(backend=backend, rank=rank, world_size=world, init_method=init_method)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def all_reduce_sum(value: float | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum a scalar or tensor over all ranks (float64 on the wire for scalars)."""
    tensor = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
    if device is not None:
        tensor = tensor.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
