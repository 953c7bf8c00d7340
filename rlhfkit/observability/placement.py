"""Where each part of an online run ran: every model rank and rollout engine, as Ray placed it.

Each Ray actor reports its own Ray actor id, node id, placement group id and process id (`whereabouts`); the
driver writes the list into the run's manifest.json under `placement` at start, and again at the end with each
engine's count of prompts generated (how the rollouts were spread);
`rlhfkit.rl.placement.collect_whereabouts` asks every actor. The ids are Ray's, so they can be checked
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


def record_placement(run_dir: str | Path, entries: list[dict[str, Any]]) -> None:
    """Write `entries` into the run's manifest.json as `placement` (the manifest is written at start)."""
    path = Path(run_dir) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["placement"] = entries
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)
