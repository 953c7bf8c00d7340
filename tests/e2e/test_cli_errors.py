"""Bad input through the real commands: each error names the culprit and exits cleanly (no traceback)."""

from __future__ import annotations

import json

import pytest

from rlhfkit.cli.main import main as rlhfkit_main


def run_cli(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        rlhfkit_main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def sft(model: str, data: str, tmp_path, *extra: str) -> list[str]:
    return ["sft", "--pretrain", model, "--dataset", data, "--input_key", "q", "--output_key", "a",
            "--train_batch_size", "2", "--micro_train_batch_size", "1", "--run_dir", str(tmp_path / "run"),
            "--save_path", str(tmp_path / "hf"), *extra]


def test_missing_key_names_file_row_and_present_keys(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n" + json.dumps({"q": "hi", "answer": "yo"}) + "\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert "d.jsonl line 2" in err and "'a'" in err and "answer" in err


def test_line_that_is_not_json_names_the_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n{not json\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert "d.jsonl" in err and "line 2" in err


def test_empty_dataset_is_named(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert "empty.jsonl" in err and "empty" in err


def test_fewer_samples_than_the_batch_is_explained(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert "--train_batch_size" in err


def test_model_path_that_does_not_exist(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n")
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        rlhfkit_main(sft("/no/such/model", str(data), tmp_path))


def test_contradictory_and_unknown_flags(tmp_path, capsys):
    err = run_cli(capsys, "sft", "--multiturn", "--pretrain_mode", "--pretrain", "x", "--dataset", "y")
    assert "--multiturn and --pretrain_mode" in err
    err = run_cli(capsys, "sft", "--learnin_rate", "1")
    assert "--learnin_rate" in err
    err = run_cli(capsys, "ppo", "--pretrain", "x", "--prompt_data", "y", "--remote_rm_url", "builtin:math",
                  "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1")
    assert "--n_samples_per_prompt" in err


def test_unknown_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        rlhfkit_main(["sfft"])
    assert "unknown command 'sfft'" in capsys.readouterr().err
