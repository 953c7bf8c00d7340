"""`rlhfkit prm` (also `python -m rlhfkit.cli.prm`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.prm`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import PRMConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.prm import prm_method, prm_samples, validate_prm
from rlhfkit.trainers.sft import load_policy

GROUPS = list(PRMConfig.GROUPS)
DESCRIPTION = "Process reward model: at each step's --placeholder_token, predict one of --reward_tokens."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(PRMConfig, GROUPS, argv, DESCRIPTION)
    validate_prm(cfg)
    return run_offline_command(cfg, prm_samples, prm_method, load_policy)


if __name__ == "__main__":
    main()
