"""Bad input through the real commands: each error names the culprit and exits cleanly (no traceback)."""

from __future__ import annotations

import json

import pytest

from rlhfkit.cli.main import main as rlhfkit_main


def run_cli(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        rlhfkit_main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def sft(model: str, data: str, tmp_path, *extra: str) -> list[str]:
    return ["sft", "--pretrain", model, "--dataset", data, "--input_key", "q", "--output_key", "a",
            "--train_batch_size", "2", "--micro_train_batch_size", "1", "--run_dir", str(tmp_path / "run"),
            "--save_path", str(tmp_path / "hf"), *extra]


def test_missing_key_names_file_row_and_present_keys(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n" + json.dumps({"q": "hi", "answer": "yo"}) + "\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert f"{data} line 2: missing key 'a' (set by --output_key); keys present: ['q', 'answer']" in err
    assert "Point --output_key at one of them or fix the data." in err  # the fix


def test_line_that_is_not_json_names_the_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n{not json\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert f"{data} line 2: not valid JSON" in err and "'{not json'" in err
    assert "fix or delete that line" in err  # the fix


def test_empty_dataset_is_named(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert f"dataset '{data}' is empty (0 bytes)" in err and "give a file with at least one row" in err


def test_fewer_samples_than_the_batch_is_explained(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n")
    err = run_cli(capsys, *sft(tiny_model_dir, str(data), tmp_path))
    assert "the training set has 1 samples, fewer than --train_batch_size 2" in err
    assert "lower --train_batch_size or add data" in err  # the fix


def test_model_path_that_does_not_exist(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n")
    with pytest.raises(FileNotFoundError) as info:
        rlhfkit_main(sft("/no/such/model", str(data), tmp_path))
    message = str(info.value)
    assert "model path '/no/such/model' does not exist" in message
    assert "accepted --pretrain forms: a local Hugging Face folder containing config.json" in message  # the fix


def test_contradictory_and_unknown_flags(tmp_path, capsys):
    err = run_cli(capsys, "sft", "--multiturn", "--pretrain_mode", "--pretrain", "x", "--dataset", "y")
    assert "rlhfkit sft: error: --multiturn and --pretrain_mode contradict" in err
    assert "pretrain_mode trains on all tokens already" in err
    err = run_cli(capsys, "sft", "--learnin_rate", "1")
    assert "unknown flag(s) for 'rlhfkit sft': --learnin_rate 1" in err and "Run 'rlhfkit sft --help'" in err
    err = run_cli(capsys, "ppo", "--pretrain", "x", "--prompt_data", "y", "--remote_rm_url", "builtin:math",
                  "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1")
    assert "rlhfkit ppo: error: --advantage_estimator group_norm compares the samples of a prompt" in err
    assert "set --n_samples_per_prompt >= 2" in err  # the fix


def test_unknown_command_lists_the_commands(capsys):
    err = run_cli(capsys, "sfft")
    assert "unknown command 'sfft'" in err
    from rlhfkit.cli.main import COMMANDS

    assert all(f"  {name} " in err for name in COMMANDS), err  # every command is listed
