"""--rollout_dump_dir / --rollout_replay_dir (rl/rollout_dump.py) and --eval_only (ppo_trainer.evaluate_only).

The end-to-end tests share one original run (module fixture): 2 GRPO steps with a k3 KL loss on the tiny model, its
rollouts dumped, --eval_dataset evaluated at steps 0 and 2, a checkpoint at step 2. A replay of the dump trains with no
engine at all (creating one is a fault here) and must give the same training metrics and the same weights; an
--eval_only run must give the original's evaluation at step 0, and from the step-2 checkpoint its evaluation there,
without writing a model or a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ppo_helpers import KL_LOSS, run

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError, UnsafeCheckpointError
from rlhfkit.rl.make_experience import Rollout
from rlhfkit.rl.rollout_dump import MANIFEST, RolloutDump, RolloutReplay, read_step_file, step_path
from rlhfkit.rollout.types import RolloutSample

# every metric of a training step but wall-clock ones (time/*, perf/*: throughput, MFU) and what only engines give
# (sync/*: the weight push and its log-prob check; eval/*: the evaluation, which a replay cannot make)
ENGINE_ONLY = ("time/", "perf/", "sync/", "eval/")


def _cfg(tmp_path: Path, **overrides) -> object:
    flags = {"pretrain": "some/model", "prompt_data": "prompts.jsonl", "remote_rm_url": "builtin:format",
             "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "rollout_batch_size": 2,
             "train_batch_size": 8, "seed": 5, "rollout_dump_dir": str(tmp_path / "dump"), **overrides}
    return parse_config("ppo", None, flags_to_argv(flags))


def _rollout() -> Rollout:
    prompts = [{"prompt": "ab", "prompt_ids": [5, 6], "label": "x"}]
    samples = [RolloutSample(0, j, [5, 6], [7 + j, 2], [-0.25 * (j + 1), -1.0 / 3], "stop",
                             {"policy_versions": [0, 0]}) for j in range(2)]
    return Rollout(prompts, samples, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), ["x", "y"], 1,
                   {"acc": torch.tensor([1.0, 0.0])}, ["", "timeout"], {"timeout": 1})


def test_a_dumped_step_reads_back_field_for_field(tmp_path):
    cfg = _cfg(tmp_path)
    dump = RolloutDump(cfg)
    original = _rollout()
    dump.write(3, original, {"filter/kept_groups": 1}, 12, {"generation": 0.5})
    manifest = json.loads((tmp_path / "dump" / MANIFEST).read_text())
    assert manifest["settings"]["seed"] == 5 and manifest["settings"]["advantage_estimator"] == "group_norm"
    replay_cfg = _cfg(tmp_path, rollout_dump_dir=None, rollout_replay_dir=str(tmp_path / "dump"))
    rollout, filter_metrics, cursor = RolloutReplay(replay_cfg).read(3)
    assert (filter_metrics, cursor) == ({"filter/kept_groups": 1}, 12)
    assert rollout.samples == original.samples  # ids, log-probs (Python floats: exact), finish reason, extra
    assert rollout.prompts == original.prompts and rollout.texts == original.texts
    assert torch.equal(rollout.rewards, original.rewards) and torch.equal(rollout.scores, original.scores)
    assert rollout.reward_failure == ["", "timeout"] and rollout.reward_failures == {"timeout": 1}
    assert torch.equal(rollout.extra_logs["acc"], original.extra_logs["acc"]) and rollout.reward_failed == 1


def test_replay_refuses_other_settings_a_missing_step_and_a_crafted_file(tmp_path):
    RolloutDump(_cfg(tmp_path)).write(1, _rollout(), {}, 2, {})
    folder = str(tmp_path / "dump")
    with pytest.raises(ConfigError) as err:
        RolloutReplay(_cfg(tmp_path, rollout_dump_dir=None, rollout_replay_dir=folder, seed=6,
                           advantage_estimator="rloo"))
    assert MANIFEST in str(err.value) and "--seed: dumped 5, this run 6" in str(err.value)
    assert "--advantage_estimator: dumped 'group_norm', this run 'rloo'" in str(err.value)
    with pytest.raises(ConfigError, match="--rollout_dump_dir"):  # dumping another run's rollouts into it
        RolloutDump(_cfg(tmp_path, n_samples_per_prompt=8, train_batch_size=16))
    replay = RolloutReplay(_cfg(tmp_path, rollout_dump_dir=None, rollout_replay_dir=folder))
    with pytest.raises(ConfigError, match=r"step_2\.pt is missing: the dump holds steps 1\.\.1 \(1 files\)"):
        replay.read(2)

    class Payload:
        def __reduce__(self):
            return (print, ("unpickled",))

    torch.save({"step": 1, "rollout": Payload()}, step_path(folder, 1))
    with pytest.raises(UnsafeCheckpointError, match="step_1.pt"):
        read_step_file(step_path(folder, 1))
    with pytest.raises(ConfigError, match="no such folder"):
        RolloutReplay(_cfg(tmp_path, rollout_dump_dir=None, rollout_replay_dir=str(tmp_path / "nowhere")))


@pytest.mark.parametrize(("flags", "message"), [
    ({"eval_only": True}, "--eval_only evaluates --eval_dataset"),
    ({"eval_only": True, "eval_dataset": "e.jsonl", "rollout_dump_dir": "d"}, "would write nothing"),
    ({"eval_only": True, "eval_dataset": "e.jsonl", "rollout_replay_dir": "d"}, "starts no rollout engines"),
    ({"rollout_dump_dir": "d", "rollout_replay_dir": "d"}, "both d"),
])
def test_contradicting_flags_are_refused(tmp_path, flags, message):
    from rlhfkit.rl.validate import validate_rl

    cfg = _cfg(tmp_path, **{"rollout_dump_dir": None, **flags})
    with pytest.raises(ConfigError, match=message):
        validate_rl(cfg)


def test_a_replay_needs_no_reward(tmp_path):
    from rlhfkit.rl.validate import validate_rl

    validate_rl(_cfg(tmp_path, rollout_dump_dir=None, remote_rm_url=None, rollout_replay_dir="d"))
    with pytest.raises(ConfigError, match="give a reward"):
        validate_rl(_cfg(tmp_path, rollout_dump_dir=None, remote_rm_url=None))


ORIGINAL = {**KL_LOSS, "save_steps": 2, "eval_steps": 2}


@pytest.fixture(scope="module")
def dumped_run(tiny_model_dir, echo_prompt_file, vllm_engine_session, tmp_path_factory):
    """The original: 2 GRPO steps (KL loss, reference model), rollouts dumped, eval at 0 and 2, checkpoint at 2."""
    out = tmp_path_factory.mktemp("original")
    rows = run(tiny_model_dir, echo_prompt_file, out, vllm_engine_session, eval_dataset=echo_prompt_file,
               rollout_dump_dir=str(out / "dump"), **ORIGINAL)
    return out, rows


def _flags(model: str, prompts: str, out: Path, **overrides) -> dict:
    """`ppo_helpers.run`'s flags (for runs that call train_ppo themselves)."""
    return {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
            "apply_chat_template": True, "advantage_estimator": "group_norm", "n_samples_per_prompt": 8,
            "rollout_batch_size": 4, "train_batch_size": 32, "micro_train_batch_size": 16,
            "micro_rollout_batch_size": 16, "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2,
            "lr_warmup_ratio": 0.0, "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "run_dir": str(out / "run"),
            "save_path": str(out / "hf"), "ckpt_path": str(out / "ckpt"), **overrides}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_replay_trains_exactly_as_the_dumped_run_without_engines(dumped_run, tiny_model_dir, echo_prompt_file,
                                                                    tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import rlhfkit.rl.setup as setup
    from rlhfkit.rl.ppo_trainer import train_ppo

    original_out, original = dumped_run
    assert sorted(p.name for p in (original_out / "dump").iterdir()) == [MANIFEST, "step_1.pt", "step_2.pt"]
    manifest = json.loads((original_out / "dump" / MANIFEST).read_text())
    assert manifest["config"]["rollout_dump_dir"] == str(original_out / "dump")  # the fixture's run dumped here

    def no_engines(*args, **kwargs):
        raise AssertionError("a replay created rollout engines")

    monkeypatch.setattr(setup, "_engines", no_engines)  # the fault a replay must never reach
    # the reward is left out (the dump holds the rewards); --eval_dataset stays and is skipped with a warning
    flags = _flags(tiny_model_dir, echo_prompt_file, tmp_path, eval_dataset=echo_prompt_file,
                   rollout_replay_dir=str(original_out / "dump"), **ORIGINAL)
    train_ppo(parse_config("ppo", None, flags_to_argv(flags)))
    replayed = _metrics(tmp_path)
    placement = json.loads((tmp_path / "run" / "manifest.json").read_text())["placement"]
    assert placement and not any("engine" in entry for entry in placement)  # model ranks only

    trained = [r for r in original if "train/policy_loss" in r]
    assert [r["step"] for r in trained] == [r["step"] for r in replayed] == [1, 2]
    for a, b in zip(trained, replayed):
        compared = sorted(k for k in a if not k.startswith(ENGINE_ONLY))
        assert compared == sorted(k for k in b if not k.startswith(ENGINE_ONLY))
        assert not any(k.startswith(("sync/", "eval/")) for k in b) and "time/replay_load" in b
        assert {"train/policy_loss", "train/kl_loss", "train/grad_norm", "train/entropy", "train/clip_frac",
                "rollout/reward_mean", "rollout/logprob_abs_diff_mean", "filter/kept_groups"} <= set(compared)
        for key in compared:  # the same fp32 arithmetic on the same inputs in the same order: bit for bit
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert replayed[1]["train/kl_loss"] > 0 and replayed[1]["train/grad_norm"] > 0  # step 2 moved away: it bites
    wa, wb = load_file(str(original_out / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf" /
                                                                                     "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "ckpt" / "actor" / "global_step2").is_dir()  # the replay checkpoints as the original


@pytest.mark.slow
def test_eval_only_gives_the_runs_evaluation_and_trains_nothing(dumped_run, tiny_model_dir, echo_prompt_file,
                                                                rollout_vllm_engine, tmp_path):
    from rlhfkit.observability.report import write_report
    from rlhfkit.rl.ppo_trainer import train_ppo

    original_out, original = dumped_run
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in original
             if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2] and evals[0] != evals[2]  # training changed what the evaluation sees

    def eval_only(out: Path, **extra) -> list[dict]:
        flags = _flags(tiny_model_dir, echo_prompt_file, out, eval_dataset=echo_prompt_file, eval_only=True,
                       remote_rm_url=str(Path(__file__).parent / "letters_reward.py"), **{**ORIGINAL, **extra})
        result = train_ppo(parse_config("ppo", None, flags_to_argv(flags)), engines=[rollout_vllm_engine])
        rows = _metrics(out)
        assert rows == [{"step": rows[0]["step"], **result}]  # one row: the evaluation, no training metrics
        assert not (out / "hf").exists()  # no model saved
        assert (out / "run" / "report.html") == write_report(out / "run")
        return rows

    fresh = eval_only(tmp_path / "fresh")
    assert fresh[0]["step"] == 0 and fresh[0].keys() - {"step"} == evals[0].keys()
    for key, value in evals[0].items():
        assert fresh[0][key] == pytest.approx(value, abs=1e-6), key
    assert not (tmp_path / "fresh" / "ckpt").exists()

    # from the original's step-2 checkpoint (read in place): its evaluation at step 2; the checkpoint is untouched
    ckpt = original_out / "ckpt"
    before = sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    resumed = eval_only(tmp_path / "resumed", load_checkpoint=True, ckpt_path=str(ckpt))
    assert resumed[0]["step"] == 2
    for key, value in evals[2].items():
        assert resumed[0][key] == pytest.approx(value, abs=1e-6), key
    assert sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
    kinds = {json.loads(line)["kind"] for line in (tmp_path / "resumed" / "run" / "samples.jsonl").open()}
    assert kinds == {"eval"}
