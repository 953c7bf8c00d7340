"""`rlhfkit ppo` on a 3-node Ray cluster on this machine (tests/cluster/conftest.py): roles spread over the nodes by
OpenRLHF's flags, weight sync across nodes, the same metrics as one node; and `ray job submit` as users run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from local_cluster import cluster_pids

from rlhfkit.rl.sync_check import PROBE_SEQUENCES

REWARD = Path(__file__).parent.parent / "rl" / "letters_reward.py"
# the per-step metrics compared between the 3-node and the one-node run, and how close they must be: the same
# seed gives the same samples (engine k seeded seed + k on both) and the same fp32 updates up to the reduction
# order of the threads each rank computes with
COMPARED = ("rollout/reward_mean", "rollout/response_length_mean", "rollout/kl", "train/policy_loss", "train/grad_norm",
            "sync/logprob_diff")
TOLERANCE = 1e-4


def ppo_flags(model: str, prompts: str, out: Path, **extra) -> list[str]:
    flags = {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "max_samples": 8, "remote_rm_url": str(REWARD), "advantage_estimator": "group_norm",
             "n_samples_per_prompt": 4, "rollout_batch_size": 4, "train_batch_size": 16,
             "micro_train_batch_size": 8, "micro_rollout_batch_size": 16, "generate_max_len": 8,
             "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0, "init_kl_coef": 0.01,
             "seed": 5, "rollout_backend": "vllm", "vllm_num_engines": 2, "vllm_kv_cache_mb": 32,
             "run_dir": str(out / "run"), "save_path": str(out / "hf"), "ckpt_path": str(out / "ckpt"), **extra}
    argv = ["--apply_chat_template", "--enforce_eager"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    return argv


def start_ppo(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, float]:
    """Start `python -m rlhfkit.cli.ppo argv` (output to files next to its run dir)."""
    out = Path(argv[argv.index("--run_dir") + 1]).parent
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.ppo", *argv], env=env, text=True,
                            stdout=open(out / "stdout.txt", "w"), stderr=open(out / "stderr.txt", "w"))
    return proc, time.perf_counter()


def finish_ppo(started: tuple[subprocess.Popen, float], argv: list[str]) -> tuple[list[dict], dict, float]:
    """Wait for a run from `start_ppo`; (metrics rows, manifest, seconds)."""
    proc, start = started
    try:
        code = proc.wait(timeout=600)
    finally:
        proc.kill()
    seconds = time.perf_counter() - start
    run_dir = Path(argv[argv.index("--run_dir") + 1])
    assert code == 0, (run_dir.parent / "stderr.txt").read_text()[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((run_dir / "manifest.json").read_text()), seconds


def nodes_of(manifest: dict, role: str) -> list[str]:
    return [e["node_id"] for e in manifest["placement"] if e.get("role") == role or (role == "engine" and
                                                                                      "engine" in e)]


def test_roles_spread_over_three_nodes_match_one_node(three_node_cluster, tiny_model_dir, echo_prompt_file,
                                                      tmp_path):
    cluster = three_node_cluster
    # the same run on one node (the plain local path: rlhfkit starts its own Ray) with the same 2 actor ranks on
    # it, side by side with the 3-node run (most of a run's start-up is waiting)
    local_tmp = tempfile.mkdtemp(prefix="rk-ray1-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": local_tmp, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    one_argv = ppo_flags(tiny_model_dir, echo_prompt_file, tmp_path / "one", actor_num_nodes=1,
                         actor_num_gpus_per_node=2)
    multi_argv = ppo_flags(tiny_model_dir, echo_prompt_file, tmp_path / "multi", ray_address=cluster.gcs_address,
                           actor_num_nodes=2, actor_num_gpus_per_node=1)
    try:
        one_run = start_ppo(one_argv, env)
        multi, manifest, multi_s = finish_ppo(start_ppo(multi_argv, cluster.env), multi_argv)
        one, one_manifest, one_s = finish_ppo(one_run, one_argv)
    finally:
        for pid in cluster_pids(local_tmp):
            os.kill(pid, 9)
        shutil.rmtree(local_tmp, ignore_errors=True)
    print(f"\n[cluster] 3-node run {multi_s:.1f} s, one-node run {one_s:.1f} s (side by side)")
    ours = set(cluster.node_ids.values())
    actor, ref, engines = nodes_of(manifest, "actor"), nodes_of(manifest, "ref"), nodes_of(manifest, "engine")
    assert len(actor) == 2 and len(ref) == 1 and len(engines) == 2
    assert set(actor + ref + engines) <= ours                # every role ran on a node of this cluster
    assert len(set(actor)) == 2                               # --actor_num_nodes 2: one rank per node
    assert len(set(actor + ref + engines)) > 1
    where = {name: [role for role, ids in (("actor", actor), ("ref", ref), ("engine", engines)) for i in ids
                    if i == node] for name, node in cluster.node_ids.items()}
    print(f"[cluster] placement {where}")
    # the engines are spread (SPREAD on CPU nodes), so the weight sync from the actor's rank 0 crossed nodes, and
    # the engines agree with the trainer after it
    assert len(set(engines)) == 2 and any(e != actor[0] for e in engines)
    assert [r["step"] for r in multi] == [1, 2] and all(r["sync/logprob_diff"] <= 1e-3 for r in multi)
    # --vllm_num_engines 2: the prompts of each step split between the engines (4 a step: one contiguous half each);
    # the run joined by --ray_address with --pretrain the tiny model and no --verbose: a quiet console
    # (engine 0 also sampled the weight-sync check's probe at start: PROBE_SEQUENCES prompts)
    assert [e["prompts_generated"] for e in manifest["placement"] if "engine" in e] == [4 + PROBE_SEQUENCES, 4]
    assert_joined_with_a_quiet_console(tmp_path / "multi")

    assert len({e["node_id"] for e in one_manifest["placement"]}) == 1
    assert [r["step"] for r in one] == [1, 2]
    for m, o in zip(multi, one):
        for key in COMPARED:
            assert m[key] == pytest.approx(o[key], rel=TOLERANCE, abs=TOLERANCE), (m["step"], key, m[key], o[key])


def assert_joined_with_a_quiet_console(out: Path) -> None:
    """A run that joined a cluster by --ray_address did not start its own Ray, and its console (no --verbose) holds
    the table, the progress bar and rlhfkit's own lines; vLLM's and the workers' logs are in the run folder, one file
    per model rank and engine."""
    stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
    assert "Started a local Ray instance" not in stderr
    console = (stdout + stderr).splitlines()
    table = [line for line in console if line[:1] in "┌│├└" or line.strip() == "rlhfkit ppo"]
    rest = [line for line in console if line not in table and line.strip() and not line.startswith("ppo:")]
    assert len(table) > 15 and len(rest) <= 12, "\n".join(rest)
    assert not any("VLLMEngine" in line or "ModelWorker" in line or "vllm" in line.lower() for line in rest), rest
    logs = out / "run" / "logs"
    assert "Initializing a V1 LLM engine" in (logs / "engine0.log").read_text()
    assert (logs / "actor_rank0.log").exists()


def test_ray_job_submit_runs_ppo_on_the_cluster(three_node_cluster, tiny_model_dir, echo_prompt_file, tmp_path):
    """As docs/cluster.md: `ray job submit --address http://HEAD:DASHBOARD --working-dir DIR --runtime-env-json ...
    -- python -m rlhfkit.cli.ppo ...`; the run joins the cluster through RAY_ADDRESS, with the job's runtime_env
    (its env_vars name TOKENIZERS_PARALLELISM, which rlhfkit also sets: Ray refuses to merge a variable set twice,
    so rlhfkit leaves the job's own)."""
    cluster = three_node_cluster
    job_dir = tmp_path / "job"  # the working dir Ray uploads: the reward function and the prompts
    job_dir.mkdir()
    shutil.copy(REWARD, job_dir / "letters_reward.py")
    shutil.copy(echo_prompt_file, job_dir / "prompts.jsonl")
    out = tmp_path / "out"
    argv = ppo_flags(tiny_model_dir, "prompts.jsonl", out, remote_rm_url="letters_reward.py", max_samples=4,
                     rollout_backend="hf", vllm_num_engines=1, init_kl_coef=0)
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    job_id = f"rk-ppo-{os.getpid()}"
    env = cluster.env
    ray_cli = str(Path(sys.executable).with_name("ray"))
    start = time.perf_counter()
    done = subprocess.run([ray_cli, "job", "submit", "--address", cluster.dashboard_url, "--submission-id", job_id,
                           "--working-dir", str(job_dir), "--runtime-env-json", json.dumps(runtime_env), "--",
                           "python", "-m", "rlhfkit.cli.ppo", *argv],
                          env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    print(f"\n[cluster] ray job submit {seconds:.1f} s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr)
    logs = subprocess.run([ray_cli, "job", "logs", "--address", cluster.dashboard_url, job_id], env=env,
                          capture_output=True, text=True, timeout=120).stdout
    assert "report:" in logs  # the driver's output reached `ray job logs`
    assert "Started a local Ray instance" not in logs  # it joined the cluster
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["train/grad_norm"] > 0
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    assert {e["node_id"] for e in manifest["placement"]} <= set(cluster.node_ids.values())
    assert (out / "hf" / "config.json").is_file()


def test_lost_node_ends_the_run_with_the_error_naming_it(three_node_cluster, tiny_model_dir, tmp_path):
    """Whole-node loss: after step 1, the raylet of a worker node that holds an actor rank is killed (SIGKILL: the
    node's workers go with it, Ray marks the node and its actors dead). The run stops with the error naming the
    rank, the node and the method, long before --remote_call_timeout (120 s here), and exits non-zero.
    Runs last in this module: the cluster has one node less afterwards."""
    from local_cluster import node_raylet_pid

    cluster = three_node_cluster
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    prompts = write_jsonl(echo_rows(40, seed=3), tmp_path / "prompts.jsonl")  # 10 steps: the loss comes long before
    argv = ppo_flags(tiny_model_dir, str(prompts), tmp_path, ray_address=cluster.gcs_address, actor_num_nodes=2,
                     actor_num_gpus_per_node=1, rollout_backend="hf", init_kl_coef=0, max_samples=40,
                     remote_call_timeout=120)
    proc, _ = start_ppo(argv, cluster.env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        placement = json.loads((tmp_path / "run" / "manifest.json").read_text())["placement"]
        names = {node: name for name, node in cluster.node_ids.items()}
        [(rank, node)] = [(e["rank"], e["node_id"]) for e in placement if e.get("role") == "actor"
                          and names[e["node_id"]] != "rk_head"][:1]
        lost = names[node]
        os.kill(node_raylet_pid(cluster, lost), 9)
        killed_at = time.perf_counter()
        code = proc.wait(timeout=300)
        took = time.perf_counter() - killed_at
    finally:
        proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    engines_there = [e["engine"] for e in placement if "engine" in e and e["node_id"] == node]
    print(f"\n[cluster] node {lost} lost after step 1 (actor rank {rank}, engines {engines_there} on it): run exited "
          f"{code} after {took:.1f} s; {[line for line in stderr.splitlines() if 'Remote' in line][-1:]}")
    assert code != 0
    assert re.search(rf"RemoteActorDied: \w+ on actor rank {rank} on node [\d.]+ \({node[:12]}\)", stderr), \
        stderr[-3000:]
    assert took < 120  # named when Ray reports the node dead, not at the deadline
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[-1]["step"] < 10  # it stopped before the end (on a quiet machine a step or two may finish first)
