"""retain_freed_host_memory: after it, memory a process frees is reused by its next allocations instead of being
page-faulted in again (rlhfkit.engine.host_memory). Each side runs in a fresh interpreter, so the default side sees
glibc's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, resource, sys
from rlhfkit.engine.host_memory import retain_freed_host_memory

applied = retain_freed_host_memory() if sys.argv[1] == "retain" else None
libc = ctypes.CDLL("libc.so.6")
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.memset.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(6):  # a step's activations: twenty 4 MB blocks written, then all freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = []
    for _ in range(20):  # as torch's CPU allocator allocates: posix_memalign, 64-byte aligned
        block = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(block), 64, 4_000_000) == 0
        libc.memset(block, 1, 4_000_000)
        blocks.append(block)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = 20 * 4_000_000 // 4096  # the pages one cycle writes


def _probe(mode: str, env: dict[str, str] | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                                   "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_host_memory_is_reused_instead_of_faulted_in_again():
    default, retained = _probe("default"), _probe("retain")
    # glibc's default: the freed 80 MB at the heap's top are trimmed, and every cycle faults them in again
    assert all(f > PAGES // 2 for f in default["faults"][1:]), default
    assert retained["applied"] is True
    assert sum(retained["faults"][3:]) < PAGES // 20, retained  # reused: once settled, (almost) nothing faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_thresholds_set_in_the_environment_are_left_as_the_user_set_them():
    """glibc reads MALLOC_MMAP_THRESHOLD_ at start; with it set to its default (128 KiB), retain_freed_host_memory
    changes nothing: the 4 MB blocks are fresh mappings every cycle, as under glibc's defaults."""
    kept = _probe("retain", {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    assert kept["applied"] is False
    assert all(f > PAGES // 2 for f in kept["faults"][1:]), kept


def test_user_malloc_settings_names_what_the_environment_sets():
    from rlhfkit.engine.host_memory import user_malloc_settings

    assert user_malloc_settings({}) == []
    assert user_malloc_settings({"MALLOC_TRIM_THRESHOLD_": "0"}) == ["MALLOC_TRIM_THRESHOLD_"]
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536"}
    assert user_malloc_settings(tunables) == ["glibc.malloc.mmap_threshold"]
    assert user_malloc_settings({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == []
