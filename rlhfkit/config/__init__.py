"""Typed option groups, CLI/YAML parsing and validation. The error type is `rlhfkit.errors.ConfigError`."""

from rlhfkit.config.parse import config_to_dict, parse_config

__all__ = ["config_to_dict", "parse_config"]
