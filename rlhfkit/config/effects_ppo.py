"""The PPO algorithm options and the tests that prove each acts, on the tensors `--debug_dump_steps` writes.

Same format as `rlhfkit.config.effects` (which merges this table); keys are `"ppo:flag"` or shared flag names.
"""

from __future__ import annotations

from rlhfkit.config.effects import Effect, NoEffect, Tested  # noqa: F401

PPO_EFFECTS: dict[str, Effect] = {}
