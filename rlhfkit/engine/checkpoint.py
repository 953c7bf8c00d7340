"""Checkpoints: the final HF folder, and full-state folders for exact resume.

Full state = model + optimizer (torch.distributed.checkpoint, sharded, any world size can read it),
scheduler, the trainer's position (step, epoch, samples consumed), every rank's RNG state, and the number of
ranks that wrote it (`world_size` in trainer_state.json).
A checkpoint is written under `<name>.tmp` and renamed when complete, so a crash never leaves a
half-written folder that `--load_checkpoint` would pick up.
The scheduler and RNG files are plain data and tensors (`rlhfkit.engine.safe_state`): loading never unpickles code.

Resume on a different number of ranks: DCP reshards the model and optimizer state to the new world size. RNG rule:
rank r takes the saved rank r's state when the checkpoint has one; a rank the saved run did not have (more ranks
now) seeds python, numpy and torch from `derived_rng_seed(seed, step, rank)`, and the saved states of ranks that no
longer exist (fewer ranks now) are not used. Both cases are logged; the outcome is deterministic.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rlhfkit.engine.distributed import barrier
from rlhfkit.engine.safe_state import dcp_load, load_state, save_state

log = logging.getLogger("rlhfkit")

STEP_PREFIX = "global_step"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def derived_rng_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of a rank that the resumed checkpoint has no state for (it was written by fewer ranks)."""
    return (seed * 1_000_003 + step * 1_009 + rank) % 2**32


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model weights on CPU (collective: every rank must call it; rank 0 receives them)."""
    return cast(dict[str, torch.Tensor],
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def save_hf_folder(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path,
                   extra_config: dict[str, Any] | None = None, weights: dict[str, torch.Tensor] | None = None) -> None:
    """Write an HF folder (safetensors + config + tokenizer) that `from_pretrained` loads. Collective.

    `weights` (full tensors by parameter name, e.g. the EMA's `full_state`): written instead of the model's own,
    each in the dtype of the tensor it replaces."""
    state = full_state_dict(model)
    if _rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        unwrapped: Any = getattr(model, "module", model)
        tied_keys = getattr(unwrapped, "all_tied_weights_keys", None) or {}
        if weights:
            unknown = sorted(set(weights) - set(state))
            if unknown:
                raise KeyError(f"save_hf_folder: weights for parameters the model does not have: {unknown[:5]}")
            # a tied weight is one parameter (named once): its other name takes the same replacement
            weights = {**{t: weights[s] for t, s in tied_keys.items() if s in weights and t in state},
                       **{s: weights[t] for t, s in tied_keys.items() if t in weights and s in state}, **weights}
            state.update({k: v.to(state[k].dtype) for k, v in weights.items()})
        for tied, source in tied_keys.items():
            # gathered from shards, a tied weight is its own tensor, which save_pretrained would write twice
            # (a single-rank state dict shares storage and is written once): keep the source only
            if tied in state and source in state and torch.equal(state[tied], state[source]):
                del state[tied]
        for key, value in (extra_config or {}).items():
            setattr(unwrapped.config, key, value)
        unwrapped.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
    barrier()


def list_checkpoints(ckpt_path: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and not p.suffix]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def save_checkpoint(ckpt_path: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, trainer_state: dict[str, Any], max_keep: int,
                    extra_models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
                    extra_state: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write `<ckpt_path>/global_step<step>` with everything needed to resume exactly. Collective.

    `extra_state`: more sharded tensors by name (e.g. {"ema": the EMA's state_dict}), each in its own DCP folder."""
    final = Path(ckpt_path) / f"{STEP_PREFIX}{step}"
    tmp = final.with_suffix(".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    models = {"model": (model, optimizer), **(extra_models or {})}
    for name, (mod, opt) in models.items():
        msd, osd = get_state_dict(mod, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / name))
    for name, tensors in (extra_state or {}).items():
        dcp.save(tensors, checkpoint_id=str(tmp / name))
    save_state(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        save_state(scheduler.state_dict(), tmp / "scheduler.pt")
        state = {**trainer_state, "step": step, "world_size": _world_size()}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(ckpt_path)[:-max_keep] if max_keep > 0 else []:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(ckpt_path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    extra_models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
                    seed: int = 0, extra_state: dict[str, dict[str, torch.Tensor]] | None = None,
                    ) -> dict[str, Any] | None:
    """Restore the newest checkpoint in place; return its trainer state, or None when there is none.

    The state carries `saved_world_size` (the ranks that wrote it; counted from the RNG files for checkpoints
    older than the `world_size` field), `world_size` (the ranks now) and `checkpoint` (the folder). Written by
    another number of ranks, the model and optimizer are resharded by DCP and the RNG follows the module's rule
    (`seed` derives the state of a rank the checkpoint lacks)."""
    found = list_checkpoints(ckpt_path)
    if not found:
        return None
    folder = found[-1]
    models = {"model": (model, optimizer), **(extra_models or {})}
    for name, (mod, opt) in models.items():
        msd, osd = get_state_dict(mod, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp_load(state, folder / name)
        set_state_dict(mod, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, tensors in (extra_state or {}).items():  # loaded in place (resharded like the model)
        if not (folder / name).is_dir():
            from rlhfkit.errors import ConfigError

            raise ConfigError(f"--load_checkpoint: {folder} holds no '{name}' state (the run that wrote it did not "
                              f"keep one: for 'ema', it ran without --enable_ema); resume without that option, "
                              "or start fresh")
        dcp_load(tensors, folder / name)
    scheduler.load_state_dict(load_state(folder / "scheduler.pt", "the lr scheduler state"))
    state = json.loads((folder / "trainer_state.json").read_text())
    saved = int(state.get("world_size") or len(list(folder.glob("rng_rank*.pt"))))
    world, rank = _world_size(), _rank()
    if rank < saved:
        set_rng_state(load_state(folder / f"rng_rank{rank}.pt", f"rank {rank}'s RNG state"))
    else:
        seed_all(derived_rng_seed(seed, state["step"], rank))
    if saved != world and rank == 0:
        if world > saved:
            seeds = [derived_rng_seed(seed, state["step"], r) for r in range(saved, world)]
            rng = (f"; ranks {saved}..{world - 1} have no saved RNG state and are seeded with "
                   f"derived_rng_seed(--seed {seed}, step {state['step']}, rank) = {seeds}")
        else:
            rng = f"; the RNG states of saved ranks {world}..{saved - 1} are not used"
        log.info("resharded %s from %d to %d ranks (model and optimizer by torch.distributed.checkpoint; rank r "
                 "keeps the saved rank r's RNG state%s)", folder, saved, world, rng)
    return {**state, "saved_world_size": saved, "world_size": world, "checkpoint": str(folder)}
