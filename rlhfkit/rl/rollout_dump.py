"""`--rollout_dump_dir` and `--rollout_replay_dir`: each step's rollouts written to a folder, and a later run that
trains from them instead of generating (no rollout engines), to debug or bisect a divergence (docs/rl.md, "Replaying
a run's rollouts").

What a step file holds is everything the step consumes after generation and scoring: the `Rollout` as the loop
collected it (after --dynamic_filtering, before the length penalties), that is the prompts (text, token ids, label,
images), each sample's prompt and response token ids, the engine's sampling log-probs, finish reason, prompt and
sample index, action mask (multi-turn agents) and extra (policy versions of --async_train), the rewards, scores,
decoded texts, the reward's failure reasons and extra logs; plus the step's filter metrics and the prompt stream's
cursor (so a replay run's checkpoints resume where the original's would). Masks, log-probs of the trainer and the
reference, values, KL and advantages are not stored: the replay run computes them from these, as the original did.

    <dir>/rollout_manifest.json   the settings a replay must share (`MANIFEST_KEYS`) and the dumping run's flags
    <dir>/step_<N>.pt             global step N: {"step", "rollout", "filter_metrics", "prompt_cursor",
                                  "seconds"} (the original's generation / reward seconds, for reference)

The step files are written with `rlhfkit.engine.safe_state.save_state` (plain data and tensors, `torch.save`) and read
with `load_state` (`weights_only=True`): a crafted file is refused, never unpickled. Read one by hand with
`rlhfkit.rl.rollout_dump.read_step_file(path)`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.parse import config_to_dict
from rlhfkit.engine.safe_state import load_state, save_state
from rlhfkit.errors import ConfigError
from rlhfkit.rl.make_experience import Rollout, register_rollout_types

log = logging.getLogger("rlhfkit")
MANIFEST = "rollout_manifest.json"
FORMAT = 1
# What the rollouts depend on, or what the replay must share to train as the original did: the policy that sampled
# them (and whose log-probs they hold), the prompts and their order, the group and batch shapes, the estimator.
# Other flags (learning rate, clipping, KL, micro-batch sizes, precision, ...) may differ: that is what a bisection
# varies.
MANIFEST_KEYS = ("pretrain", "prompt_data", "seed", "rollout_batch_size", "n_samples_per_prompt",
                 "train_batch_size", "advantage_estimator", "generate_max_len", "max_len")


def manifest_settings(cfg: PPOConfig, resolved: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values of `MANIFEST_KEYS` in this run: `resolved`'s where given (build_setup's plan: --pretrain resolved
    to a folder), else the flags'."""
    resolved = resolved or {}
    return {key: resolved[key] if key in resolved else getattr(cfg, key) for key in MANIFEST_KEYS}


def step_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step_{step}.pt"


def dumped_steps(folder: str | Path) -> list[int]:
    """The global steps a dump folder holds, sorted."""
    return sorted(int(p.stem.split("_", 1)[1]) for p in Path(folder).glob("step_*.pt")
                  if p.stem.split("_", 1)[1].isdigit())


def _read_manifest(path: Path, flag: str) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{flag}: cannot read {path} ({err}); it is written by a run with --rollout_dump_dir") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            not isinstance(manifest.get("settings"), dict):
        raise ConfigError(f"{flag}: {path} is not a rollout manifest of format {FORMAT} (written by "
                          "--rollout_dump_dir); dump the rollouts again with this version")
    return manifest


def check_compatible(path: Path, manifest: dict[str, Any], cfg: PPOConfig, flag: str,
                     resolved: dict[str, Any] | None = None) -> None:
    """ConfigError naming `path` and every setting of `MANIFEST_KEYS` that differs between the dump and this run
    (`resolved`: the flags the run resolved, as `manifest_settings`)."""
    dumped, now = manifest["settings"], manifest_settings(cfg, resolved)
    differ = [f"--{k}: dumped {dumped.get(k)!r}, this run {now[k]!r}" for k in MANIFEST_KEYS
              if json.loads(json.dumps(now[k], default=str)) != dumped.get(k)]
    if differ:
        raise ConfigError(f"{flag}: the rollouts in {path.parent} were dumped with other settings ({MANIFEST}): "
                          + "; ".join(differ) + ". Run with the dumping run's values of these flags, or use "
                          "another folder")


class RolloutDump:
    """--rollout_dump_dir: writes the manifest at the start (or checks the one a resumed run finds there) and one
    file per step."""

    def __init__(self, cfg: PPOConfig, resolved: dict[str, Any] | None = None) -> None:
        """`resolved`: the flags the run resolved (build_setup's plan), recorded instead of the values given."""
        self.folder = Path(cfg.rollout_dump_dir or "")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / MANIFEST
        if path.exists():  # a resumed run (or a second run into the same folder): it must be the same run
            check_compatible(path, _read_manifest(path, "--rollout_dump_dir"), cfg, "--rollout_dump_dir", resolved)
            return
        config = json.loads(json.dumps({**config_to_dict(cfg), **(resolved or {})}, default=str))
        manifest = {"format": FORMAT, "settings": json.loads(json.dumps(manifest_settings(cfg, resolved),
                                                                        default=str)),
                    "config": config}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(path)

    def write(self, step: int, rollout: Rollout, filter_metrics: dict[str, float], prompt_cursor: int,
              seconds: dict[str, float]) -> Path:
        """Step `step`'s rollout (call before anything modifies it in place: the length penalties do)."""
        register_rollout_types()
        path = step_path(self.folder, step)
        tmp = path.with_suffix(".tmp")
        save_state({"step": step, "rollout": rollout, "filter_metrics": dict(filter_metrics),
                    "prompt_cursor": prompt_cursor, "seconds": dict(seconds)}, tmp)
        tmp.replace(path)
        return path


class RolloutReplay:
    """--rollout_replay_dir: checks the manifest against this run's settings, then reads each step's file."""

    def __init__(self, cfg: PPOConfig, resolved: dict[str, Any] | None = None) -> None:
        """`resolved`: the flags the run resolved (build_setup's plan), compared instead of the values given."""
        self.folder = Path(cfg.rollout_replay_dir or "")
        if not self.folder.is_dir():
            raise ConfigError(f"--rollout_replay_dir {self.folder}: no such folder (give the --rollout_dump_dir of "
                              "the run to replay)")
        path = self.folder / MANIFEST
        if not path.exists():
            raise ConfigError(f"--rollout_replay_dir: {path} is missing; the folder was not written by a run with "
                              "--rollout_dump_dir")
        check_compatible(path, _read_manifest(path, "--rollout_replay_dir"), cfg, "--rollout_replay_dir", resolved)
        steps = dumped_steps(self.folder)
        log.info("--rollout_replay_dir %s: rollouts of %d step(s)%s; no rollout engines are started", self.folder,
                 len(steps), f" ({steps[0]}..{steps[-1]})" if steps else "")

    def read(self, step: int) -> tuple[Rollout, dict[str, float], int]:
        """(rollout, filter metrics, prompt cursor) of `step`; ConfigError naming the file when it is missing."""
        path = step_path(self.folder, step)
        if not path.exists():
            steps = dumped_steps(self.folder)
            held = f"steps {steps[0]}..{steps[-1]} ({len(steps)} files)" if steps else "no step files"
            raise ConfigError(f"--rollout_replay_dir: {path} is missing: the dump holds {held}, this run needs step "
                              f"{step}. Replay at most the steps that were dumped (a shorter run, e.g. fewer "
                              "--num_episodes, also shortens its learning-rate schedule), or dump that step")
        record = read_step_file(path)
        if record.get("step") != step or not isinstance(record.get("rollout"), Rollout):
            raise ConfigError(f"--rollout_replay_dir: {path} does not hold the rollout of step {step}")
        return record["rollout"], record["filter_metrics"], int(record["prompt_cursor"])


def read_step_file(path: str | Path) -> dict[str, Any]:
    """One step file of a dump, as a dict (see the module docstring); never unpickles code."""
    register_rollout_types()
    return load_state(path, "a dumped rollout (--rollout_replay_dir)")
