"""`rlhfkit <command> [flags]`: dispatch to `rlhfkit.cli.<command>.main`."""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from pathlib import Path

from rlhfkit.errors import (
    AgentError,
    ConfigError,
    DataError,
    DriftError,
    RemoteCallError,
    RewardError,
    WeightSyncMismatch,
)

# Errors a run meets at run time whose message already says what failed, the numbers and the flag that changes it:
# one message on the console, the full trace in the run folder (`error.txt`).
RUN_ERRORS = (WeightSyncMismatch, RewardError, AgentError, DriftError, RemoteCallError)

COMMANDS = {
    "demo": "GRPO on the embedded SmolLM2-135M-Instruct (what `make demo` runs)",
    "sft": "supervised fine-tuning (conditional SFT with --csft_keys)",
    "rm": "Bradley-Terry reward model on preference pairs",
    "dpo": "DPO / IPO / cDPO on preference pairs",
    "kto": "KTO on unpaired completions with desirable/undesirable labels",
    "kd": "knowledge distillation from a teacher model, mixed with SFT",
    "prm": "process reward model: a reward token at every step placeholder",
    "ppo": "online RL on Ray + vLLM: PPO, REINFORCE++, GRPO, Dr. GRPO, RLOO",
    "batch-inference": "generate / score in batch; rejection sampling, conditional SFT and iterative DPO data",
    "serve-rm": "serve a reward model or reward function over HTTP",
    "lora-merge": "merge a LoRA adapter folder into its base model (a plain HF folder)",
    "report": "write RUN_DIR/report.html: plots, samples and the reproduce command of a run",
    "runs": "list the run folders under a directory (default ./runs): command, date, steps, outcome",
    "compare": "one HTML page overlaying the curves of two runs for the metrics they share",
}


def usage() -> str:
    lines = ["usage: rlhfkit <command> [flags]   (rlhfkit <command> --help lists the flags)", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlhfkit: unknown command '{command}'\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(f"rlhfkit.cli.{command.replace('-', '_')}")
    try:
        module.main(rest)
    except (ConfigError, DataError) as err:
        print(f"rlhfkit {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RUN_ERRORS as err:
        where = write_trace(err)
        trace = f"\n(the full trace: {where})" if where else ""
        print(f"rlhfkit {command}: {type(err).__name__}: {err}{trace}", file=sys.stderr)
        raise SystemExit(1) from None


def write_trace(err: BaseException) -> Path | None:
    """Write `err`'s traceback to `error.txt` in the run folder (the folder of the run's `train.log`) and to the
    log file; return the file, or None where the run has no folder yet."""
    for handler in logging.getLogger("rlhfkit").handlers:
        if isinstance(handler, logging.FileHandler):
            path = Path(handler.baseFilename).parent / "error.txt"
            text = "".join(traceback.format_exception(err))
            path.write_text(text)
            handler.flush()
            with open(handler.baseFilename, "a") as log_file:
                log_file.write(text)
            return path
    return None


if __name__ == "__main__":
    main()
