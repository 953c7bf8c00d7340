"""`rlhfkit sft` (also `python -m rlhfkit.cli.sft`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.sft`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import SFTConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.sft import load_policy, sft_method, sft_samples

GROUPS = list(SFTConfig.GROUPS)
DESCRIPTION = "Supervised fine-tuning: loss on response tokens (--multiturn: every assistant turn; " \
              "--pretrain_mode: all tokens)."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(SFTConfig, GROUPS, argv, DESCRIPTION)
    return run_offline_command(cfg, sft_samples, sft_method, load_policy)


if __name__ == "__main__":
    main()
