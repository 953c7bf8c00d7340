"""`rlhfkit kd` (also `python -m rlhfkit.cli.kd`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.kd`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import KDConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.kd import kd_method, kd_samples, validate_kd
from rlhfkit.trainers.sft import load_policy

GROUPS = list(KDConfig.GROUPS)
DESCRIPTION = "Knowledge distillation: SFT loss mixed with forward KL to a teacher on response tokens (--kd_coef)."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(KDConfig, GROUPS, argv, DESCRIPTION)
    validate_kd(cfg)
    return run_offline_command(cfg, kd_samples, kd_method, load_policy)


if __name__ == "__main__":
    main()
