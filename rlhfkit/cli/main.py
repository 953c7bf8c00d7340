"""`rlhfkit <command> [flags]`: dispatch to `rlhfkit.cli.<command>.main`."""

from __future__ import annotations

import importlib
import sys

from rlhfkit.errors import ConfigError, DataError

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


if __name__ == "__main__":
    main()
