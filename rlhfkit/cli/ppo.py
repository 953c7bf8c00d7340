"""`rlhfkit ppo`: online RL (OpenRLHF's train_ppo_ray). `--advantage_estimator` picks PPO (gae, with a critic),
REINFORCE++ (reinforce), REINFORCE++-baseline, GRPO (group_norm), Dr. GRPO (dr_grpo) or RLOO."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.config.validate import need

DESCRIPTION = "Online RL on Ray + vLLM: PPO (critic + GAE) and the critic-free estimators."
GROUPS = list(PPOConfig.GROUPS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rlhfkit.observability.report import write_report
    from rlhfkit.observability.summary import summarize_run, summary_lines
    from rlhfkit.rl.ppo_trainer import train_ppo

    cfg = parse_config(PPOConfig, GROUPS, argv, DESCRIPTION)
    result = train_ppo(cfg)
    run_dir = need(cfg.run_dir, "--run_dir")  # set by the run
    print(f"report: {write_report(run_dir)}")
    print("\n".join(summary_lines(summarize_run(run_dir))))
    return result


if __name__ == "__main__":
    main()
