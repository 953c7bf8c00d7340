"""Where each part of an online run ran: every model rank and rollout engine, as Ray placed it.

Each Ray actor reports its own Ray actor id, node id, placement group id and process id (`whereabouts`); the
driver writes the list into the run's manifest.json under `placement` at start, and again at the end with each
engine's count of prompts generated (how the rollouts were spread). The ids are Ray's, so they can be checked
against Ray's own tables (`ray._private.state.actors(actor_id)`, `ray.util.placement_group_table`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any


def whereabouts(**facts: Any) -> dict[str, Any]:
    """This Ray actor's placement as Ray sees it, plus `facts` (role, rank, dtype, ...)."""
    import ray

    context = ray.get_runtime_context()
    return {**facts, "actor_id": context.get_actor_id(), "node_id": context.get_node_id(),
            "placement_group_id": context.get_placement_group_id(), "pid": os.getpid(),
            "host": socket.gethostname()}


def collect_whereabouts(groups: list[Any], engines: list[Any]) -> list[dict[str, Any]]:
    """Every rank of every model group, then every engine (`engine` = its index in the run's list). Each call has
    the run's deadline (--remote_call_timeout): a hung or dead rank or engine raises `RemoteCallTimeout` /
    `RemoteActorDied` naming it (role, rank, node, `whereabouts`), as every other call of the run does."""
    from rlhfkit.rollout.remote import call_all

    ranks = [entry for group in groups for entry in call_all(group.workers, "whereabouts", role=group.role)]
    found = call_all(engines, "whereabouts", role="engine") if engines else []
    return ranks + [{**entry, "engine": k} for k, entry in enumerate(found)]


def record_placement(run_dir: str | Path, entries: list[dict[str, Any]]) -> None:
    """Write `entries` into the run's manifest.json as `placement` (the manifest is written at start)."""
    path = Path(run_dir) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["placement"] = entries
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)
