"""The machinery of the option-claim checks (issue #28): the per-test record of the options a test sets
(tests/option_record.py), the forced defaults of the revert check, and tools/check_option_claims.py's verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from rlhfkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


record_mod = load(REPO / "tests" / "option_record.py", "option_record_under_test")
checker = load(REPO / "tools" / "check_option_claims.py", "check_option_claims_under_test")


def test_command_lines_flags_and_their_removal():
    assert record_mod.flag_names_in_argv(["--a", "1", "--b=2", "--no-c", "--ds.ring_head_stride", "2", "x"]) == \
        ["a", "b", "c", "ring_head_stride"]
    argv = ["--port", "0", "--host=h", "--ds.port", "7", "--normalize_reward", "--reward_weights", "0.5", "-1"]
    assert record_mod.strip_flag(argv, "port") == ["--host=h", "--normalize_reward", "--reward_weights", "0.5", "-1"]
    assert record_mod.strip_flag(argv, "reward_weights") == argv[:6]
    assert record_mod.rlhfkit_command(["python", "-m", "rlhfkit", "sft", "--x"]) == (4, "sft")
    torchrun = ["py", "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "rlhfkit.cli.batch_inference", "--y"]
    assert record_mod.rlhfkit_command(torchrun) == (6, "batch-inference")
    assert record_mod.rlhfkit_command(["/venv/bin/rlhfkit", "serve-rm"]) == (2, "serve-rm")
    assert record_mod.rlhfkit_command(["python", "worker.py", "rlhfkit"]) is None


@pytest.fixture
def recorder(monkeypatch):
    """A recorder of its own, installed over the session's (wrappers compose; uninstall restores)."""
    def make(revert: str = ""):
        monkeypatch.setenv(record_mod.REVERT_ENV, revert)
        rec = record_mod.OptionRecorder(None)
        rec.install()
        rec.current = "t"
        return rec

    made = []
    yield lambda revert="": made.append(make(revert)) or made[-1]
    for rec in made:
        rec.uninstall()


def test_configs_refusals_argparse_commands_and_subprocesses_are_recorded(recorder, tmp_path):
    import subprocess

    import rlhfkit.cli.ppo as ppo_cli
    from rlhfkit.cli.report import build_parser
    from rlhfkit.config.commands import SFTConfig

    rec = recorder()
    ppo_cli.parse_config("ppo", ppo_cli.GROUPS, ["--pretrain", "m", "--ptx_coef", "0.5", "--seed", "42"])
    SFTConfig(max_norm=2.0)
    with pytest.raises(ConfigError):
        ppo_cli.parse_config("ppo", ppo_cli.GROUPS, ["--full_determinism"])  # refused by ppo
    build_parser().parse_args([str(tmp_path), "--step", "3"])
    # the command line of an rlhfkit subprocess is parsed here (this one only passes it to `python -c pass`)
    subprocess.run([sys.executable, "-c", "pass", "-m", "rlhfkit", "sft", "--max_len", "77"], timeout=60)
    seen = rec.tests["t"]["set"]
    assert seen["ppo"] >= {"pretrain", "ptx_coef", "full_determinism"} and "seed" not in seen["ppo"]  # 42: default
    assert "max_norm" in seen["sft"] and "max_len" in seen["sft"] and "learning_rate" not in seen["sft"]
    assert seen["report"] == {"run_dir", "step"}


def test_a_reverted_option_is_its_default_wherever_it_is_set(recorder):
    import rlhfkit.cli.ppo as ppo_cli
    from rlhfkit.cli.demo import build_parser
    from rlhfkit.config.commands import PPOConfig

    recorder("ppo:ptx_coef,ppo:full_determinism,demo:run_dir")
    cfg = ppo_cli.parse_config("ppo", ppo_cli.GROUPS, ["--pretrain", "m", "--ptx_coef", "0.5", "--full_determinism"])
    assert (cfg.pretrain, cfg.ptx_coef, cfg.full_determinism) == ("m", 0.05, False)  # no refusal either
    assert PPOConfig(ptx_coef=0.7).ptx_coef == 0.05
    assert build_parser().parse_args(["--run_dir", "x", "--steps", "2"]).run_dir is None


def test_the_checker_fails_an_entry_whose_cited_tests_never_set_the_option():
    serve = "tests/config/test_cli_options_act.py::test_serve_rm_listens_on_the_host_and_port_it_is_given"
    ptx = "tests/rl/test_ptx_coef.py::test_ptx_coef_weights_the_lm_loss_gradient_of_the_policy_step"
    record = {"tests": {serve: {"outcome": "passed", "set": {"serve-rm": ["port", "remote_rm_url"]}},
                        ptx + "[x]": {"outcome": "passed", "set": {"ppo": ["ptx_coef"]}},
                        "tests/config/test_cli_options_act.py::test_demo_run_dir_is_the_folder_its_ppo_run_writes_and_"
                        "reads": {"outcome": "skipped", "set": {}}}}
    verdicts = {v.key: v.status for v in checker.check(record)}
    assert verdicts["serve-rm:host"] == "not set" and verdicts["serve-rm:port"] == "proven"
    assert verdicts["ptx_coef"] == "proven"  # a parametrisation of the cited test
    assert verdicts["demo:run_dir"] == "skipped" and verdicts["ppo:eps_clip"] == "not run"
    assert ("sft", "ds_tensor_parallel_size") in checker.entry_targets()["sft:tp_size"]  # an alias: its flag
