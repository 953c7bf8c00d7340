"""`rlhfkit rm` (also `python -m rlhfkit.cli.rm`, and under `torchrun --nproc_per_node N -m rlhfkit.cli.rm`)."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import RMConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.trainers.common import run_offline_command
from rlhfkit.trainers.rm import RewardNormalisation, load_reward_model, rm_method, rm_samples, validate_rm

GROUPS = list(RMConfig.GROUPS)
DESCRIPTION = "Bradley-Terry reward model on chosen/rejected pairs (scalar 'score' head; reward_mean/reward_std of " \
              "the training set saved in config.json)."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(RMConfig, GROUPS, argv, DESCRIPTION)
    validate_rm(cfg)
    norm = RewardNormalisation()
    return run_offline_command(cfg, rm_samples, rm_method, load_reward_model, extra_config=norm.remember,
                               after_training=norm.after_training)


if __name__ == "__main__":
    main()
