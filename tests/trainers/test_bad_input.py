"""Bad input to the offline commands: each error names the file, the row and the key (or the flag) and stops the
command with exit status 2 before any model is loaded; identical pairs are counted and reported, not dropped."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from rlhfkit.cli.main import main as rlhfkit_main
from rlhfkit.data.synthetic import preference_rows, process_rows, unpaired_rows


def write(tmp_path, rows, name="data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fails(capsys, tmp_path, command: str, *flags: str) -> str:
    """Run `rlhfkit <command> ...`; assert exit status 2 and return the error message."""
    with pytest.raises(SystemExit) as exc:
        rlhfkit_main([command, *flags, "--run_dir", str(tmp_path / "run"), "--save_path", str(tmp_path / "hf")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"rlhfkit {command}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command,missing", [("rm", "rejected"), ("dpo", "chosen")])
def test_missing_preference_key_names_file_row_and_keys_present(tiny_model_dir, tmp_path, capsys, command, missing):
    rows = preference_rows(4, seed=0)
    del rows[2][missing]
    data = write(tmp_path, rows)
    err = fails(capsys, tmp_path, command, "--pretrain", tiny_model_dir, "--dataset", data, "--prompt_key", "prompt",
                "--train_batch_size", "2", "--micro_train_batch_size", "1")
    assert f"{data} line 3" in err
    present = {"rejected": "['prompt', 'chosen']", "chosen": "['prompt', 'rejected']"}[missing]
    assert f"missing key '{missing}' (set by --{missing}_key); keys present: {present}" in err
    assert err.endswith(f"Point --{missing}_key at one of them or fix the data.")  # the fix


@pytest.mark.parametrize("label", ["yes", 1.0, None, 2], ids=["string", "float", "null", "int-2"])
def test_kto_label_that_is_not_boolean(tiny_model_dir, tmp_path, capsys, label):
    rows = unpaired_rows(4, seed=0)
    rows[1]["label"] = label
    data = write(tmp_path, rows)
    err = fails(capsys, tmp_path, "kto", "--pretrain", tiny_model_dir, "--dataset", data, "--output_key", "output",
                "--train_batch_size", "2", "--micro_train_batch_size", "1")
    assert f"{data} line 2" in err
    if label is None:
        assert "missing key 'label' (set by --label_key)" in err and "Point --label_key at one of them" in err
    else:
        assert f"label key 'label' must be a boolean (true/false, or the integers 0/1), got {type(label).__name__} " \
               f"{label!r}" in err
        assert err.endswith("Convert the labels to true/false.")


def test_kto_missing_output_key(tiny_model_dir, tmp_path, capsys):
    rows = unpaired_rows(4, seed=0)
    rows[3] = {"input": rows[3]["input"], "answer": "x", "label": True}
    data = write(tmp_path, rows)
    err = fails(capsys, tmp_path, "kto", "--pretrain", tiny_model_dir, "--dataset", data, "--output_key", "output",
                "--train_batch_size", "2", "--micro_train_batch_size", "1")
    assert f"{data} line 4: missing key 'output' (set by --output_key); keys present: ['input', 'label', 'answer']" \
        in err
    assert err.endswith("Point --output_key at one of them or fix the data.")


def test_kd_missing_output_key(tiny_model_dir, tmp_path, capsys):
    data = write(tmp_path, [{"input": "a", "output": "b"}, {"input": "c", "reply": "d"}])
    err = fails(capsys, tmp_path, "kd", "--pretrain", tiny_model_dir, "--teacher_model", tiny_model_dir,
                "--dataset", data, "--train_batch_size", "1", "--micro_train_batch_size", "1")
    assert f"{data} line 2: missing key 'output' (set by --output_key); keys present: ['input', 'reply']" in err
    assert err.endswith("Point --output_key at one of them or fix the data.")


@pytest.mark.parametrize("case", ["count", "missing", "bad-token", "mixed", "soft-range"])
def test_prm_bad_labels(tiny_model_dir, tmp_path, capsys, case):
    rows = process_rows(3, seed=0, steps=(2, 2))
    if case == "count":
        rows[1]["label"] = rows[1]["label"][:1]
    elif case == "missing":
        del rows[1]["label"]
    elif case == "bad-token":
        rows[1]["label"] = ["+", "?"]
    elif case == "mixed":
        rows[1]["label"] = ["+", 0.5]
    else:
        rows[1]["label"] = [0.5, 1.5]
        rows[0]["label"] = [0.5, 0.5]
    data = write(tmp_path, rows)
    err = fails(capsys, tmp_path, "prm", "--pretrain", tiny_model_dir, "--dataset", data, "--placeholder_token", "§",
                "--reward_tokens", "+", "-", "--train_batch_size", "1", "--micro_train_batch_size", "1")
    assert f"{data} line 2" in err
    expected = {  # what is wrong with the row's label, and what would fix it
        "count": "the text has 2 step placeholders '§' but 1 labels in key 'label'; give one label per step",
        "missing": "missing key 'label' (set by --label_key); keys present: ['input']. Point --label_key at one of "
                   "them",
        "bad-token": "step label '?' is not one of --reward_tokens ['+', '-']",
        "mixed": "label key 'label' mixes hard labels (tokens or booleans) and soft ones (probabilities): ['+', 0.5]",
        "soft-range": "soft step label 1.5 must be a probability in [0, 1]"}[case]
    assert f"{data} line 2: {expected}" in err


def test_prm_placeholder_must_be_one_token(tiny_model_dir, tmp_path, capsys):
    data = write(tmp_path, process_rows(2, seed=0))
    err = fails(capsys, tmp_path, "prm", "--pretrain", tiny_model_dir, "--dataset", data, "--placeholder_token", "ки",
                "--train_batch_size", "1", "--micro_train_batch_size", "1")
    assert "--placeholder_token 'ки' is 2 tokens" in err and "exactly one token" in err
    assert "Pick another marker" in err  # the fix


def test_rm_margin_must_be_a_number(tiny_model_dir, tmp_path, capsys):
    rows = [dict(r, margin=1.0) for r in preference_rows(3, seed=0)]
    rows[2]["margin"] = "big"
    data = write(tmp_path, rows)
    err = fails(capsys, tmp_path, "rm", "--pretrain", tiny_model_dir, "--dataset", data, "--prompt_key", "prompt",
                "--margin_loss", "--train_batch_size", "1", "--micro_train_batch_size", "1")
    assert f"{data} line 3: --margin_loss: key 'margin' must be a finite number, got 'big'" in err


@pytest.mark.parametrize("command,flags,message", [
    ("dpo", ["--label_smoothing", "0.6"], "--label_smoothing must lie in [0, 0.5), got 0.6"),
    ("dpo", ["--ipo", "--label_smoothing", "0.1"],
     "--ipo and --label_smoothing contradict: cDPO smoothing applies to the DPO loss only"),
    ("dpo", ["--beta", "0"], "--beta must be > 0, got 0.0"),
    ("kto", ["--beta", "-1"], "--beta must be > 0, got -1.0"),
    ("kd", [], "--teacher_model is required for 'rlhfkit kd'"),
    ("kd", ["--teacher_model", "x", "--kd_coef", "1.5"], "--kd_coef must lie in [0, 1], got 1.5"),
    ("prm", [], "--placeholder_token is required for 'rlhfkit prm' (the token that ends each step)"),
    ("rm", ["--zpg", "2"], "--zpg is not supported: ZeRO++ partition groups are DeepSpeed-only"),
])
def test_contradictory_flags(tmp_path, capsys, command, flags, message):
    err = fails(capsys, tmp_path, command, "--pretrain", "unused", "--dataset", "unused", *flags)
    assert err.startswith(f"rlhfkit {command}: error: ") and message in err  # the flag, its bound and the value


def test_identical_pairs_are_counted_and_reported(tokenizer, caplog, monkeypatch):
    from rlhfkit.trainers.pairs import preference_samples

    rows = preference_rows(5, seed=0)
    rows[1]["rejected"] = rows[1]["chosen"]
    rows[3]["rejected"] = rows[3]["chosen"]
    cfg = SimpleNamespace(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", input_template=None,
                          apply_chat_template=False, max_len=64)
    # a command run earlier in the session sets the package logger not to propagate (to the root, where caplog is)
    monkeypatch.setattr(logging.getLogger("rlhfkit"), "propagate", True)
    with caplog.at_level(logging.WARNING):
        samples, stats = preference_samples(cfg, tokenizer, rows)
    assert stats["identical_pairs"] == 2 and len(samples) == 5  # kept: counted, not silently dropped
    assert "2 pairs have chosen == rejected" in caplog.text
