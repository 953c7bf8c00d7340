"""`rlhfkit ppo` building its own rollout engines from the flags (every other RL test hands the loop the session's
engine): one engine on a mixture-of-experts model and `--colocate_all_models`
placing the engine on the actor's bundle (two engines sharing the rollouts: tests/cluster/test_multinode.py).
Placement is read from the run's manifest (what each Ray actor reported)
and checked against Ray's own actor table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.rl.ppo_trainer import train_ppo
from rlhfkit.rl.sync_check import PROBE_SEQUENCES

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def run_own_engines(model: str, out: Path, **overrides) -> tuple[list[dict], dict]:
    """A short GRPO run whose engines the command creates; returns (metrics rows, manifest)."""
    prompts = write_jsonl(echo_rows(8, seed=3), out / "prompts.jsonl")
    flags = {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
             "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "rollout_batch_size": 4,
             "train_batch_size": 16, "micro_train_batch_size": 16, "micro_rollout_batch_size": 16,
             "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0,
             "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "vllm_kv_cache_mb": 32, "enforce_eager": True,
             "run_dir": str(out / "run"), "save_path": str(out / "hf"), "ckpt_path": str(out / "ckpt"), **overrides}
    train_ppo(parse_config("ppo", None, flags_to_argv(flags)))
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "run" / "manifest.json").read_text())


def placed(manifest: dict, role: str) -> list[dict]:
    return [entry for entry in manifest["placement"] if entry["role"] == role]


def assert_ray_agrees(ray_cluster, entries: list[dict]) -> None:
    """Each reported actor is in Ray's actor table with the same node and process, and was stopped by the run."""
    from ray._private import state

    for entry in entries:
        row = state.actors(entry["actor_id"])
        assert row["Address"]["NodeID"] == entry["node_id"] and row["Pid"] == entry["pid"], entry
        assert row["State"] == "DEAD", entry  # the run freed what it created


def assert_policy_loss_adds_the_router_aux_loss(moe: str, out: Path, coef: float, first_row: dict) -> None:
    """--aux_loss_coef in the ppo policy step: the first update's micro-batch loss is the policy term plus
    coef x the load-balancing loss, recomputed here in float64 from the initial model's router logits."""
    import torch
    from moe_reference import reference_aux_loss
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.positions import position_ids

    dump = torch.load(out / "run" / "debug" / "step_1.pt", weights_only=True)
    entry = dump["actor"][0]
    [mb] = entry["micro_batches"]  # one micro-batch of 16 rows, one rank
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    with torch.no_grad():
        routed = model(input_ids=mb["sequences"], attention_mask=mb["attention_mask"],
                       position_ids=position_ids(mb["attention_mask"]), output_router_logits=True)
    aux = reference_aux_loss(routed.router_logits, mb["attention_mask"], 4, 2)
    assert float(mb["aux_loss"]) == pytest.approx(aux, rel=1e-5)
    mask = mb["action_mask"].double()
    policy_term = float((mb["policy_loss"].double() * mask).sum()) / entry["num_tokens"]
    assert int(mb["num_micro_batches"]) == 1
    assert float(mb["loss"]) - policy_term == pytest.approx(coef * aux, rel=1e-4, abs=1e-6)
    assert first_row["train/aux_loss"] == pytest.approx(aux, rel=1e-5)


def test_one_engine_from_flags_on_a_mixture_of_experts_model(ray_cluster, tmp_path):
    from rlhfkit.models.tiny import build_tiny_moe_causal_lm

    moe = build_tiny_moe_causal_lm(str(tmp_path / "moe"))
    coef = 0.1
    rows, manifest = run_own_engines(moe, tmp_path, max_samples=8, vllm_dtype="fp32", aux_loss_coef=coef,
                                     debug_dump_steps=["1"])
    assert [r["step"] for r in rows] == [1, 2]
    assert_policy_loss_adds_the_router_aux_loss(moe, tmp_path, coef, rows[0])
    for row in rows:  # the engine computes what the trainer computes after every sync (was 1e-2 off for MoE)
        assert row["sync/logprob_diff"] <= 1e-3 and row["sync/logprob_diff_max"] < 1e-2
        assert row["train/grad_norm"] > 0
    [engine] = placed(manifest, "engine")
    # 8 rollout prompts, and the sync check's probe prompts sampled once at start
    assert (engine["backend"], engine["dtype"], engine["prompts_generated"]) == ("vllm", "float32", 8 + PROBE_SEQUENCES)
    [actor] = placed(manifest, "actor")
    assert_ray_agrees(ray_cluster, [engine, actor])


def test_colocate_all_models_puts_the_engine_on_the_actors_bundle(ray_cluster, tiny_model_dir, tmp_path):
    rows, manifest = run_own_engines(tiny_model_dir, tmp_path, max_samples=4, colocate_all_models=True,
                                     init_kl_coef=0.01, vllm_enable_sleep=True, fsdp_enable_offload=True)
    [engine], [actor], [ref] = placed(manifest, "engine"), placed(manifest, "actor"), placed(manifest, "ref")
    assert engine["placement_group_id"] == actor["placement_group_id"] == ref["placement_group_id"] is not None
    assert "rollout/kl" in rows[0] and rows[0]["sync/logprob_diff"] <= 1e-3  # the reference ran
    log = (tmp_path / "run" / "train.log").read_text()  # the CUDA-only flags say they do nothing here, and why
    assert "--vllm_enable_sleep: vLLM's sleep mode is CUDA-only" in log
    assert "--fsdp_enable_offload: a no-op on CPU" in log
    assert_ray_agrees(ray_cluster, [engine, actor, ref])
