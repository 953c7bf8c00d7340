"""Typed option groups, CLI/YAML parsing and validation."""

from rlhfkit.config.parse import ConfigError, config_to_dict, parse_config

__all__ = ["ConfigError", "config_to_dict", "parse_config"]
