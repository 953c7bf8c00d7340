"""`rlhfkit dpo` (also `python -m rlhfkit.cli.dpo`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.dpo`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import DPOConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.dpo import dpo_method, dpo_samples, validate_dpo
from rlhfkit.trainers.sft import load_policy

GROUPS = list(DPOConfig.GROUPS)
DESCRIPTION = "Direct preference optimisation on chosen/rejected pairs: DPO, cDPO (--label_smoothing), IPO (--ipo)."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(DPOConfig, GROUPS, argv, DESCRIPTION)
    validate_dpo(cfg)
    return run_offline_command(cfg, dpo_samples, dpo_method, load_policy)


if __name__ == "__main__":
    main()
