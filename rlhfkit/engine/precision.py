"""Precision that fits the hardware: what `--param_dtype auto` and `--vllm_dtype auto` mean on this machine.

auto = bf16 where the device computes it natively, fp32 elsewhere:
- CUDA: bf16 when `torch.cuda.is_bf16_supported()` (Ampere and newer), else fp32.
- CPU: bf16 when torch reports AVX512-BF16 or AMX *and* a short matmul probe confirms bf16 is at least as fast as
  fp32; fp32 otherwise. On an AVX2-only CPU bf16 is emulated: measured on an AMD EPYC (family 25 model 1, AVX2,
  2 threads) bf16 matmul runs at about 1.3 GFLOP/s against 170 for fp32, so a bf16 run is 30-100x slower there;
  on an EPYC Zen 4 with AVX512-BF16 bf16 runs at about 400 GFLOP/s against 177.

The probe (two matmul sizes per dtype, well under a second) is cached per machine (CPU model, capability, torch
version, thread count) under `$RLHFKIT_CACHE` (default `~/.cache/rlhfkit`), so every process after the first
reads the file; a probe taken on a busy machine (its threads short of the cores: `cpu_share`) is not cached, and
sets no ceiling. Its rates are also the ceilings the MFU figures are computed against.

`RLHFKIT_AUTO_DTYPE=fp32|bf16` pins what auto means (the test suite pins fp32, so its tolerances hold on every
CPU; the precision tests lift the pin). The manifest records the pin as the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from rlhfkit.config.rl_options import RolloutOptions

log = logging.getLogger("rlhfkit")

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_PROBE_SIZE = 512
_PROBE_SECONDS = 0.08   # per dtype, once the first matmul shows it is fast
_SLOW_GFLOPS = 8.0      # a bf16 rate below this is emulation: stop probing after one small matmul
_MIN_CPU_SHARE = 0.75   # a probe whose threads ran for less of its time than this shared the cores (cpu_share)


@dataclass(frozen=True)
class Precision:
    """The precision a run computes in, and why. `dtype` is one of bf16, fp16, fp32."""

    dtype: str
    requested: str
    device: str                 # cpu | cuda
    device_name: str            # CPU model or GPU name
    capability: str             # torch's CPU capability (AVX2, AVX512, ...) or the CUDA compute capability
    native_bf16: bool
    fp32_gflops: float | None   # measured matmul rates (None where not measured)
    bf16_gflops: float | None
    reason: str

    def ceiling_gflops(self) -> float | None:
        """The measured matmul rate of the precision in use (what MFU is computed against)."""
        return self.bf16_gflops if self.dtype in ("bf16", "fp16") else self.fp32_gflops

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for the derived-quantities table and the report."""
        return f"{self.dtype} ({self.reason})"


def cpu_model_name() -> str:
    """The CPU's model name with its family/model numbers (from /proc/cpuinfo where there is one)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    return name


def cpu_bf16_capability() -> tuple[str, bool]:
    """(torch's capability string with the bf16 extensions it sees, whether any of them computes bf16 natively)."""
    cap = torch.backends.cpu.get_cpu_capability()
    extras = [name for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
              if getattr(torch.cpu, probe, lambda: False)()]
    return "+".join([cap, *extras]), bool(extras)


def measure_matmul_gflops(dtype: torch.dtype, device: str = "cpu", size: int = _PROBE_SIZE) -> float:
    """Square-matmul rate in GFLOP/s, the best single matmul of the probe: an untimed first call (it starts the
    thread pool and picks kernels), one timed half-size matmul, then `size` matmuls for about `_PROBE_SECONDS`.
    The best one, not the mean: other processes that start at the same time (Ray's workers, at a run's start) made a
    mean read fp32 as 2 GFLOP/s on a 170 GFLOP/s CPU. A dtype that the half-size matmul shows to be emulated
    (< `_SLOW_GFLOPS`) is reported from it alone."""
    def best(n: int, min_reps: int, seconds: float) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        rates: list[float] = []
        began = time.perf_counter()
        while len(rates) < min_reps or time.perf_counter() - began < seconds:
            start = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            rates.append(2 * n**3 / max(time.perf_counter() - start, 1e-9) / 1e9)
        return max(rates)

    best(64, 1, 0.0)
    warm = best(size // 2, 1, 0.0)
    if warm < _SLOW_GFLOPS:
        return warm
    return best(size, 3, _PROBE_SECONDS)


def _probe_key() -> dict[str, Any]:
    """What a cached probe is valid for: the CPU, torch's capability and version, the thread count."""
    capability, _ = cpu_bf16_capability()
    return {"cpu": cpu_model_name(), "capability": capability, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "probe": f"v3-{_PROBE_SIZE}"}  # v3: best single matmul


def _cache_file(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("RLHFKIT_CACHE") or Path.home() / ".cache" / "rlhfkit")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "precision" / f"{digest}.json"


def cpu_matmul_rates() -> dict[str, Any]:
    """This CPU's fp32 and bf16 matmul rates at the current thread count, measured once per machine (cached;
    concurrent processes wait on a file lock instead of probing at the same time and halving each other's rate)."""
    key = _probe_key()
    path = _cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return cached
        cpu_began, began = time.process_time(), time.perf_counter()
        fp32 = measure_matmul_gflops(torch.float32)
        share = cpu_share(time.process_time() - cpu_began, time.perf_counter() - began, torch.get_num_threads())
        rates: dict[str, Any] = {"key": key, "fp32_gflops": round(fp32, 2),
                                 "bf16_gflops": round(measure_matmul_gflops(torch.bfloat16), 2),
                                 "cpu_share": round(share, 3)}
        # Busy: other processes held the cores. No AVX2-class CPU computes fp32 this slowly; and a probe whose
        # threads ran for less than _MIN_CPU_SHARE of its time shared the cores (its best matmul may still read
        # anything from 1 to 160 GFLOP/s: measured on a 130 GFLOP/s AMD EPYC beside 1-2 busy processes, share
        # 0.33-0.51; alone 0.96-1.0). Such rates decide nothing and are not kept as the MFU ceiling.
        if rates["fp32_gflops"] < _SLOW_GFLOPS or share < _MIN_CPU_SHARE:
            log.warning("precision probe: fp32 matmul ran at %.1f GFLOP/s with %.0f%% of its threads' time on the "
                        "cores, so the machine was busy; deciding from the CPU's flags, reporting no MFU, and "
                        "probing again in the next run", rates["fp32_gflops"], 100 * share)
            return {**rates, "contended": True}  # not cached
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rates))
        tmp.replace(path)
        return rates


def cpu_share(cpu_seconds: float, wall_seconds: float, threads: int) -> float:
    """The fraction of `threads` x `wall_seconds` that the process's threads ran (CPU time over wall time): near 1
    for a multi-threaded matmul alone on its cores, about 1 / (1 + busy processes per core) beside others. 1.0 where
    the span is too short to tell (under a millisecond)."""
    if wall_seconds < 1e-3:
        return 1.0
    return cpu_seconds / (wall_seconds * max(threads, 1))


def forget_cpu_rates() -> Path | None:
    """Delete this machine's cached probe (at the current thread count), so the next run measures again; the path
    deleted, or None where none was cached. For a run that finds the cached ceiling wrong (a stage faster than it)."""
    path = _cache_file(_probe_key())
    if not path.exists():
        return None
    path.unlink(missing_ok=True)
    return path


def _cpu_precision(requested: str) -> Precision:
    capability, flagged = cpu_bf16_capability()
    rates = cpu_matmul_rates()
    fp32, bf16 = rates["fp32_gflops"], rates["bf16_gflops"]
    contended = bool(rates.get("contended"))
    native = flagged and (contended or bf16 >= fp32)
    facts = f"{capability} CPU, matmul bf16 {_rate(bf16)} vs fp32 {_rate(fp32)} GFLOP/s"
    if contended:
        facts += "; the machine was busy during the probe: decided by the CPU's flags"
    if requested != "auto":
        reason = f"requested; {facts}"
    elif native:
        reason = f"auto: native bf16 ({facts})"
    elif flagged:
        reason = f"auto: the CPU reports bf16 support but the probe found it slower than fp32 ({facts})"
    else:
        reason = f"auto: no native bf16 on this CPU ({facts})"
    dtype = requested if requested != "auto" else ("bf16" if native else "fp32")
    # rates read beside other work are no ceiling: MFU is not reported rather than overstated
    fp32_ceiling, bf16_ceiling = (None, None) if contended else (fp32, bf16)
    return Precision(dtype, requested, "cpu", cpu_model_name(), capability, native, fp32_ceiling, bf16_ceiling, reason)


def _rate(gflops: float) -> str:
    return f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.1f}"


def _cuda_precision(requested: str, touch_device: bool = True) -> Precision:
    """`touch_device=False` (a Ray driver): decide without creating a CUDA context in this process, which would take
    GPU memory the colocated engines and trainers count on; GPUs that train with RL are bf16-capable (Ampere+)."""
    if not touch_device or not torch.cuda.is_available():
        dtype = "bf16" if requested == "auto" else requested
        return Precision(dtype, requested, "cuda", "GPUs of the Ray cluster (not touched by the driver)", "unknown",
                         True, None, None, "auto: bf16 on GPUs" if requested == "auto" else "requested")
    native = torch.cuda.is_bf16_supported()
    major, minor = torch.cuda.get_device_capability()
    fp32 = round(measure_matmul_gflops(torch.float32, "cuda", 4096), 1)
    bf16 = round(measure_matmul_gflops(torch.bfloat16, "cuda", 4096), 1)
    dtype = requested if requested != "auto" else ("bf16" if native else "fp32")
    why = "requested" if requested != "auto" else ("auto: native bf16" if native else "auto: no bf16 on this GPU")
    return Precision(dtype, requested, "cuda", torch.cuda.get_device_name(), f"sm_{major}{minor}", native, fp32,
                     bf16, why)


_RESOLVED: dict[tuple, Precision] = {}


def resolve_precision(requested: str, device_type: str, touch_device: bool = True) -> Precision:
    """What `--param_dtype requested` means on a `device_type` ("cpu" or "cuda") device; memoised per process, except a
    CPU probe taken on a busy machine (no ceiling), which the next call repeats.
    `touch_device=False`: never initialise CUDA here (the Ray driver of an online run)."""
    if requested not in ("auto", *TORCH_DTYPES):
        raise ValueError(f"--param_dtype {requested!r}: expected auto, bf16, fp16 or fp32")
    pinned = os.environ.get("RLHFKIT_AUTO_DTYPE") if requested == "auto" else None
    if pinned and pinned not in TORCH_DTYPES:
        raise ValueError(f"RLHFKIT_AUTO_DTYPE={pinned!r}: expected one of {sorted(TORCH_DTYPES)}")
    key = (requested, device_type, pinned, touch_device)
    if key not in _RESOLVED:
        choice = _cuda_precision(requested, touch_device) if device_type == "cuda" else _cpu_precision(requested)
        if pinned:  # the hardware facts stay measured (MFU needs the ceiling); the decision is the pin's
            choice = replace(choice, dtype=pinned, reason=f"auto pinned to {pinned} by RLHFKIT_AUTO_DTYPE")
        if device_type == "cpu" and choice.fp32_gflops is None:  # probed on a busy machine: probe again next call
            return choice
        _RESOLVED[key] = choice
    return _RESOLVED[key]


def auto_torch_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype `auto` resolves to on `device`."""
    return TORCH_DTYPES[resolve_precision("auto", torch.device(device).type).dtype]


class DtypeFlags(Protocol):
    """What apply_precision reads of a command's config: --param_dtype (and, with ppo's RolloutOptions,
    --vllm_dtype); structural, so `engine/` imports no command class (tests/test_layering.py)."""

    param_dtype: str


def engine_dtype_of(cfg: DtypeFlags, choice: Precision) -> str | None:
    """ppo's engine dtype: --vllm_dtype, with auto = the trainer's resolved `choice`; None for a command without
    engines of its own dtype."""
    if not isinstance(cfg, RolloutOptions):
        return None
    return choice.dtype if cfg.vllm_dtype == "auto" else cfg.vllm_dtype


def apply_precision(cfg: DtypeFlags, device_type: str, touch_device: bool = True
                    ) -> Precision:
    """The decision for `cfg.param_dtype` on this device (its `dtype` is the concrete trainer dtype; ppo's engine
    dtype is `engine_dtype_of(cfg, choice)`), warning once when an explicit half precision runs without native
    support. The config is not written to: the caller keeps the decision (the manifest, the derived-quantities
    table and the report show it)."""
    choice = resolve_precision(cfg.param_dtype, device_type, touch_device)
    engine_dtype = engine_dtype_of(cfg, choice)
    half = [f"{flag} {value}" for flag, value in (("--param_dtype", choice.dtype), ("--vllm_dtype", engine_dtype))
            if value in ("bf16", "fp16")]
    if half and device_type == "cpu" and not choice.native_bf16 and choice.bf16_gflops:
        slowdown = cast(float, choice.fp32_gflops) / choice.bf16_gflops
        log.warning("%s on a CPU without native bf16 (%s): half-precision matmul measured %.0fx slower than fp32 "
                    "here; leave it at auto (fp32 on this machine) unless bf16 itself is what you test",
                    " and ".join(half), choice.reason.removeprefix("requested; "), slowdown)
    return choice
