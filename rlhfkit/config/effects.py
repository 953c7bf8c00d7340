"""Every option of every command, with the test that proves it acts or the reason it has no observable effect.

A key is a flag name (`"eps_clip"`), standing for every command that has the flag and reaches it through the same
code (the offline methods share one training loop and one engine), or `"command:flag"` (`"ppo:learning_rate"`) where
a command's path differs; the command-specific key wins. `tests/config/test_option_effects.py` fails when an option
of any command has no entry, when a named test does not exist, or when the test's source never names the flag.
`python -m rlhfkit.config.docs` renders the table into docs/options.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tested:
    """The option's effect is asserted by these tests: pytest node ids relative to the repository root."""

    tests: tuple[str, ...]
    what: str  # one line: what the tests assert changes when the option is set


@dataclass(frozen=True)
class NoEffect:
    """The option has no effect a test can observe (or is refused); `reason` says why."""

    reason: str


Effect = Tested | NoEffect

# The shared and command-specific entries; the PPO algorithm options (proven on the tensors that
# `--debug_dump_steps` writes) live in effects_ppo.py and are merged below.
EFFECTS: dict[str, Effect] = {}


def _merge() -> None:
    from rlhfkit.config.effects_ppo import PPO_EFFECTS

    overlap = sorted(set(EFFECTS) & set(PPO_EFFECTS))
    assert not overlap, f"options listed twice in effects.py and effects_ppo.py: {overlap}"
    EFFECTS.update(PPO_EFFECTS)


def effect_of(command: str, flag: str) -> Effect | None:
    """The entry for `--flag` of `rlhfkit command`: the command-specific key first, then the shared one."""
    return EFFECTS.get(f"{command}:{flag}") or EFFECTS.get(flag)


_merge()
