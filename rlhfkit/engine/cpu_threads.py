"""Compute threads for a process that shares the node's cores with others.

Ray sets `OMP_NUM_THREADS` to an actor's logical CPU request, and the online loop asks for fractions of a CPU so
that every role fits on a small machine: each model worker and engine then computes on one thread, whatever the
machine has. In the synchronous loop the phases take turns on the cores, so a process that runs alone should use
all of them: on this 2-core CPU the actor's training stage ran 1.9x faster with 2 threads than with Ray's 1
(docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch


def node_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads(share: int = 1) -> int:
    """Threads for one of `share` processes that compute at the same time on this node."""
    return max(1, node_cores() // max(1, share))


def set_cpu_threads(requested: int, share: int) -> int:
    """torch's intra-op threads: `requested` when > 0, else the node's cores split `share` ways. Returns the count."""
    threads = requested if requested > 0 else cpu_threads(share)
    torch.set_num_threads(threads)
    return threads
