"""The run's plan (`rlhfkit.config.plan.RunPlan`) is the one home of what an online run derives (#30): validation
makes it, build_setup completes it against the cluster and the engines and keeps it on the setup, and the user's
config object comes out of validation and set-up exactly as it went in (no resolution is written back into it).

The fast tests run the real `validate_rl` and `build_setup` up to the model groups (Ray, preflight and placement
faked, as tests/config/test_ppo_options_act.py does); the slow one runs the whole set-up of a tiny GRPO and a tiny
PPO-with-critic run on the session's Ray cluster and engine."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

import rlhfkit.rl.placement as placement
import rlhfkit.rl.setup as setup
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.plan import RunPlan
from rlhfkit.rl.validate import validate_rl

RUNS = {
    "grpo": {"advantage_estimator": "group_norm", "init_kl_coef": 0.1, "use_kl_loss": True, "kl_estimator": "k3"},
    "ppo_critic": {"advantage_estimator": "gae", "init_kl_coef": 0.05, "kl_estimator": "k2",
                   "critic_learning_rate": 5e-3},
}


class Reached(Exception):
    pass


def _cfg(name: str, model: str, prompts: str, run_dir: Path):
    flags = {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "apply_chat_template": True, "remote_rm_url": "builtin:format", "rollout_batch_size": 4,
             "n_samples_per_prompt": 4,
             "train_batch_size": 16, "micro_train_batch_size": 8, "micro_rollout_batch_size": 8,
             "generate_max_len": 8, "prompt_max_len": 128, "max_samples": 8, "seed": 5, "param_dtype": "auto",
             "vllm_dtype": "auto", "vllm_sync_backend": "auto", "lora_sync": "auto", "enforce_eager": True,
             "run_dir": None, **RUNS[name]}
    cfg = parse_config("ppo", None, flags_to_argv({k: v for k, v in flags.items() if v is not None}))
    return cfg


def _snapshot(cfg) -> dict:
    """Every attribute the config object holds (its flags, and anything set on the instance)."""
    return copy.deepcopy({**dataclasses.asdict(cfg), **vars(cfg)})


def _fake_cluster(monkeypatch, seen: dict) -> None:
    monkeypatch.setattr(setup, "start_ray", lambda cfg: False)
    monkeypatch.setattr(setup, "preflight", lambda cfg, engines=None: None)
    monkeypatch.setattr(setup, "cluster_has_gpus", lambda: False)
    monkeypatch.setattr(placement, "make_placement_group", lambda nodes, per_node, cpus: object())

    def groups(cfg, plan, updates, reward_specs, placement, made, critic_specs=None):
        seen["plan"] = plan
        raise Reached

    monkeypatch.setattr(setup, "_groups", groups)
    monkeypatch.setattr(setup, "_abandon", lambda *args: None)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_validation_and_setup_leave_the_config_unchanged(name, tiny_model_dir, echo_prompt_file, tmp_path,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # --run_dir unset: the default runs/ppo-<time> folder lands here
    monkeypatch.setenv("RLHFKIT_AUTO_DTYPE", "fp32")  # auto resolves to fp32 whatever this CPU is
    cfg = _cfg(name, tiny_model_dir, echo_prompt_file, tmp_path)
    before = _snapshot(cfg)
    checked = validate_rl(cfg)
    assert _snapshot(cfg) == before
    seen: dict = {}
    _fake_cluster(monkeypatch, seen)
    with pytest.raises(Reached):
        setup.build_setup(cfg)
    assert _snapshot(cfg) == before  # param_dtype, vllm_dtype, vllm_sync_backend, pretrain, run_dir as given
    assert cfg.precision is None and cfg.run_dir is None and cfg.param_dtype == "auto"
    plan: RunPlan = seen["plan"]
    # the groups got validation's plan, completed: what the flags decided is the same, the cluster's part is filled
    flag_facts = ("estimator", "needs_critic", "group_estimator", "kl_mode", "layout", "distill", "kl_estimator",
                  "init_kl_coef", "reference_model", "reward_models")
    assert {f: getattr(plan, f) for f in flag_facts} == {f: getattr(checked, f) for f in flag_facts}
    assert checked.sync_transport is None and checked.precision is None  # validation ran before any cluster
    assert (plan.trainer_dtype, plan.engine_dtype, plan.sync_transport) == ("fp32", "fp32", "gloo")
    assert plan.precision is not None and plan.precision.dtype == "fp32"  # type: ignore[attr-defined]
    assert plan.model_path == str(Path(tiny_model_dir).resolve())
    assert plan.run_dir is not None and Path(plan.run_dir).parent == Path("runs")
    assert (tmp_path / plan.run_dir / "manifest.json").exists()
    if name == "grpo":
        assert (plan.kl_mode, plan.kl_estimator, plan.needs_critic, plan.needs_ref) == ("loss", "k3", False, True)
        assert plan.kl_coef() == 0.1 and plan.kl_coef(0.03) == 0.03
    else:
        assert (plan.kl_mode, plan.kl_estimator, plan.needs_critic, plan.needs_ref) == ("penalty", "k2", True, True)
        assert plan.kl_coef() == 0.05
    assert plan.reference_model == tiny_model_dir


def test_the_manifest_records_the_resolved_flags_and_the_config_keeps_the_given_ones(tiny_model_dir,
                                                                                     echo_prompt_file, tmp_path,
                                                                                     monkeypatch):
    import json

    monkeypatch.setenv("RLHFKIT_AUTO_DTYPE", "fp32")
    cfg = _cfg("grpo", tiny_model_dir, echo_prompt_file, tmp_path)
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"))
    _fake_cluster(monkeypatch, {})
    with pytest.raises(Reached):
        setup.build_setup(cfg)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    resolved = {k: manifest["config"][k] for k in ("param_dtype", "vllm_dtype", "vllm_sync_backend", "run_dir")}
    assert resolved == {"param_dtype": "fp32", "vllm_dtype": "fp32", "vllm_sync_backend": "gloo",
                        "run_dir": str(tmp_path / "run")}
    assert manifest["precision"]["dtype"] == "fp32"
    assert (cfg.param_dtype, cfg.vllm_dtype, cfg.vllm_sync_backend) == ("auto", "auto", "auto")


def test_the_plan_is_frozen_and_each_resolution_makes_a_new_one(tiny_model_dir, echo_prompt_file, tmp_path):
    plan = validate_rl(_cfg("grpo", tiny_model_dir, echo_prompt_file, tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.lora_sync = "adapter"  # type: ignore[misc]
    adapted = plan.with_lora_sync("adapter")
    assert (plan.lora_sync, plan.adapter_sync, adapted.lora_sync, adapted.adapter_sync) == ("auto", False, "adapter",
                                                                                           True)
    with pytest.raises(RuntimeError, match="not resolved against the cluster"):
        _ = plan.transport


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_whole_setup_leaves_the_config_unchanged(name, tiny_model_dir, echo_prompt_file, vllm_engine_session,
                                                     tmp_path, monkeypatch):
    """A real set-up (Ray groups, the given engine, the LoRA-sync and weight-sync checks): the config is unchanged
    and the setup's plan is what its workers read (the transport, the dtypes, the resolved LoRA sync)."""
    monkeypatch.setenv("RLHFKIT_AUTO_DTYPE", "fp32")
    cfg = dataclasses.replace(_cfg(name, tiny_model_dir, echo_prompt_file, tmp_path), run_dir=str(tmp_path / "run"))
    before = _snapshot(cfg)
    s = setup.build_setup(cfg, engines=[vllm_engine_session])
    try:
        assert _snapshot(cfg) == before
        assert s.plan.lora_sync == "merged" and s.plan.transport == "gloo"  # no LoRA: merged; a CPU cluster: gloo
        assert (s.plan.trainer_dtype, s.plan.engine_dtype) == ("fp32", "fp32")
        assert s.summary["weight sync"] == "gloo" and s.summary["engine dtype"] == "fp32"
        assert (s.critic is not None) == (name == "ppo_critic") and s.ref is not None
        assert s.kl_ctl.value == s.plan.init_kl_coef
    finally:
        s.close()
