"""A run-time error reaches the console as one message (what failed, the numbers, the flag that changes it) and its
full trace goes to the run folder (`rlhfkit.cli.main`)."""

from __future__ import annotations

import pytest

from rlhfkit.errors import WeightSyncMismatch


def test_a_run_error_is_one_message_with_the_trace_in_the_run_folder(monkeypatch, tmp_path, capsys):
    from rlhfkit.cli import main as cli
    from rlhfkit.observability.run import setup_logging

    message = "weight sync: rollout engine 0 of 1 computes log-probs that differ ... Set --sync_logprob_tolerance"

    def failing_run(argv):  # the fault: the run stops inside its loop, after its folder and log exist
        setup_logging(tmp_path, is_main=True)
        def deep_inside():
            raise WeightSyncMismatch(message)
        deep_inside()

    monkeypatch.setattr("rlhfkit.cli.ppo.main", failing_run)
    with pytest.raises(SystemExit) as stop:
        cli.main(["ppo"])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"rlhfkit ppo: WeightSyncMismatch: {message}"
    assert "Traceback" not in err and f"(the full trace: {tmp_path / 'error.txt'})" in err
    trace = (tmp_path / "error.txt").read_text()
    assert "Traceback" in trace and "deep_inside" in trace and message in trace
    assert "deep_inside" in (tmp_path / "train.log").read_text()
