"""Without --verbose the Ray actors' output (vLLM, transformers, torch: Python and C++ alike) goes to the run folder,
one file per model rank and engine; with it, to Ray's log stream and the console. The end-to-end check of a quiet
`rlhfkit ppo` console is tests/cluster/test_multinode.py::test_roles_spread_over_three_nodes_match_one_node."""

from __future__ import annotations

import subprocess
import sys

from rlhfkit.config.parse import parse_config
from rlhfkit.observability.run import process_log_path


def test_verbose_keeps_the_actors_output_live_and_otherwise_it_goes_to_the_run_folder(tmp_path):
    quiet = parse_config("ppo", None, ["--pretrain", "m", "--prompt_data", "p"])
    loud = parse_config("ppo", None, ["--pretrain", "m", "--prompt_data", "p", "--verbose"])
    assert (quiet.verbose, loud.verbose) == (False, True)
    run = str(tmp_path / "run")
    assert process_log_path(run, quiet.verbose, "actor_rank1") == f"{run}/logs/actor_rank1.log"
    assert process_log_path(run, loud.verbose, "actor_rank1") is None
    assert process_log_path(None, False, "engine0") is None
    batch = parse_config("batch-inference", None, ["--pretrain", "m", "--verbose"])
    assert batch.verbose is True


def test_redirect_output_takes_python_and_c_level_writes_of_the_process(tmp_path):
    log = tmp_path / "logs" / "engine0.log"
    program = ("import os, sys\nfrom rlhfkit.observability.run import redirect_output\n"
               "print('before')\nsys.stdout.flush()\n"
               f"redirect_output({str(log)!r})\n"
               "print('python stdout')\nprint('python stderr', file=sys.stderr)\n"
               "os.write(1, b'fd 1\\n')\nos.write(2, b'fd 2\\n')\n"
               "os.system('echo child process')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before\n" and done.stderr == ""  # nothing after the redirect reached the console
    assert log.read_text().splitlines() == ["python stdout", "python stderr", "fd 1", "fd 2", "child process"]
