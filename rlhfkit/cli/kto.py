"""`rlhfkit kto` (also `python -m rlhfkit.cli.kto`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.kto`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import KTOConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.kto import kto_method, kto_samples, validate_kto
from rlhfkit.trainers.sft import load_policy

GROUPS = list(KTOConfig.GROUPS)
DESCRIPTION = "KTO on unpaired completions with a boolean desirable/undesirable label."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(KTOConfig, GROUPS, argv, DESCRIPTION)
    validate_kto(cfg)
    return run_offline_command(cfg, kto_samples, kto_method, load_policy)


if __name__ == "__main__":
    main()
