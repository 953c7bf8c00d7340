"""`rlhfkit ppo`: online RL (OpenRLHF's train_ppo_ray). `--advantage_estimator` picks PPO (gae, with a critic),
REINFORCE++ (reinforce), REINFORCE++-baseline, GRPO (group_norm), Dr. GRPO (dr_grpo) or RLOO."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.parse import parse_config
from rlhfkit.config.rl_options import RL_GROUPS

DESCRIPTION = "Online RL on Ray + vLLM: PPO (critic + GAE) and the critic-free estimators."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rlhfkit.rl.ppo_trainer import train_ppo

    cfg = parse_config("ppo", RL_GROUPS, argv, DESCRIPTION)
    return train_ppo(cfg)


if __name__ == "__main__":
    main()
