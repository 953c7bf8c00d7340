"""A 3-node Ray cluster on this machine, started as users start one (`ray start --head`, then `ray start --address`
twice), each node with its own logical CPUs and a custom resource naming it (`rk_head`, `rk_w1`, `rk_w2`).

It gets its own temp dir (RAY_TMPDIR for every process of it, so no other `ray.init()` on the machine finds and
joins it), its own ports, token auth off (Ray turns it on for `ray start --head` when ~/.ray/auth_token exists, and
the joining nodes would then need the token), and is torn down by killing exactly the processes it started: every
process carrying its RAY_TMPDIR (`ray stop` would stop every cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
NODES = (("rk_head", 2), ("rk_w1", 2), ("rk_w2", 2))  # (custom resource naming the node, logical CPUs)


@dataclass
class LocalCluster:
    temp_dir: str
    gcs_address: str                 # what `--ray_address` / `ray.init(address=...)` take
    dashboard_url: str               # what `ray job submit --address` takes
    env: dict[str, str]              # the environment every process of (or against) this cluster runs with
    node_ids: dict[str, str] = field(default_factory=dict)  # rk_head / rk_w1 / rk_w2 -> Ray node id
    start_s: float = 0.0             # seconds from the first `ray start` until all nodes were alive


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ray_start_all(calls: list[list[str]], env: dict[str, str]) -> list[str]:
    """Run `ray start` with each argument list side by side (each waits mostly on its node's processes coming up);
    returns each one's output."""
    procs = [subprocess.Popen([RAY, "start", *args, "--disable-usage-stats", "--min-worker-port", "0",
                               "--max-worker-port", "0", "--object-store-memory", str(200 << 20)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in calls]
    outputs = []
    for args, proc in zip(calls, procs):
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if proc.returncode:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
        outputs.append(stdout + stderr)
    return outputs


def _ray_start(args: list[str], env: dict[str, str]) -> str:
    return _ray_start_all([args], env)[0]


def _node_ports(names: tuple[str, ...], ports: list[int] | None = None) -> list[str]:
    ports = ports or free_ports(len(names))
    return [arg for name, port in zip(names, ports, strict=True) for arg in (f"--{name}", str(port))]


PER_NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                  "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")


def cluster_nodes(gcs_address: str, env: dict[str, str], expect: int, timeout_s: float = 60) -> list[dict]:
    """Ray's node table as a driver connected to the cluster sees it, once `expect` nodes are alive."""
    script = ("import json, sys, time, ray\n"
              f"ray.init(address={gcs_address!r}, logging_level='ERROR', log_to_driver=False)\n"
              f"deadline = time.time() + {timeout_s}\n"
              f"while len([n for n in ray.nodes() if n['Alive']]) < {expect} and time.time() < deadline:\n"
              "    time.sleep(0.5)\n"
              "print(json.dumps([{k: n[k] for k in ('NodeID', 'Alive', 'Resources', 'NodeManagerAddress')}"
              " for n in ray.nodes()]))\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout_s + 60)
    if done.returncode:
        raise RuntimeError(f"listing the nodes failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_cluster(nodes=NODES, dashboard: bool = True) -> LocalCluster:
    temp_dir = tempfile.mkdtemp(prefix="rk-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    # as a user who activated the venv and then ran `ray start`: a job's `python` is the venv's
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_TMPDIR": temp_dir, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": path}
    env.pop("RAY_ADDRESS", None)
    # all of the head's ports from one call: separate calls could hand out the same port twice (seen in CI: the
    # GCS port equal to the node manager's)
    gcs_port, dashboard_port, client_port, *head_ports = free_ports(3 + len(PER_NODE_PORTS))
    start = time.perf_counter()
    cluster = LocalCluster(temp_dir, "", "", env)
    try:
        (head, head_cpus), *workers = nodes
        said = _ray_start(["--head", "--port", str(gcs_port), "--temp-dir", temp_dir, "--num-cpus", str(head_cpus),
                           "--resources", json.dumps({head: 1}), f"--include-dashboard={str(dashboard).lower()}",
                           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                           "--ray-client-server-port", str(client_port), *_node_ports(PER_NODE_PORTS, head_ports)], env)
        # Ray puts a node started on loopback on the machine's address, which `ray start` prints
        ip = re.search(r"Local node IP: ([\d.]+)", said)
        ip = ip[1] if ip else cluster_nodes(f"127.0.0.1:{gcs_port}", env, 1)[0]["NodeManagerAddress"]
        cluster.gcs_address, cluster.dashboard_url = f"{ip}:{gcs_port}", f"http://127.0.0.1:{dashboard_port}"
        # the workers join side by side, their ports from one call (separate calls could repeat a port)
        ports = free_ports(len(workers) * len(PER_NODE_PORTS))
        # each its own temp dir: nodes sharing one would share runtime_resources/, and a node that does not use a
        # job's working_dir deletes it under the job's driver (seen: "FileNotFoundError" from os.getcwd())
        _ray_start_all([["--address", cluster.gcs_address, "--temp-dir", f"{temp_dir}/{name}",
                         "--num-cpus", str(cpus), "--resources", json.dumps({name: 1}),
                         *_node_ports(PER_NODE_PORTS, ports[k * len(PER_NODE_PORTS):(k + 1) * len(PER_NODE_PORTS)])]
                        for k, (name, cpus) in enumerate(workers)], env)
        table = cluster_nodes(cluster.gcs_address, env, len(nodes))
        cluster.start_s = time.perf_counter() - start
        for node in table:
            names = [name for name, _ in nodes if node["Alive"] and name in node["Resources"]]
            if names:
                cluster.node_ids[names[0]] = node["NodeID"]
        assert sorted(cluster.node_ids) == sorted(name for name, _ in nodes), table
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def cluster_pids(temp_dir: str) -> list[int]:
    """Every process started for the cluster (and their children): they carry its RAY_TMPDIR."""
    mark = f"RAY_TMPDIR={temp_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def stop_cluster(cluster: LocalCluster) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = cluster_pids(cluster.temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while pids and cluster_pids(cluster.temp_dir) and time.time() < deadline:
            time.sleep(0.2)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def node_raylet_pid(cluster: LocalCluster, name: str) -> int:
    """The raylet of node `name` (rk_w1 / rk_w2: started with `--temp-dir <temp_dir>/<name>`): killing it is the
    node lost (its workers exit with it, Ray marks the node and its actors dead)."""
    found = []
    for pid in cluster_pids(cluster.temp_dir):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.split(" ")[0].endswith("raylet") and re.search(re.escape(f"{cluster.temp_dir}/{name}") + r"(/|\s)",
                                                               cmd + " "):
            found.append(pid)
    if len(found) != 1:
        raise RuntimeError(f"expected one raylet of node {name} under {cluster.temp_dir}, found {found}")
    return found[0]
