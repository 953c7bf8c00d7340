"""Preference pairs (chosen / rejected), shared by DPO and the reward model."""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import DPOConfig, RMConfig
from rlhfkit.data.preference import build_preference_samples

PAIR_SIDES = (("chosen_ids", "chosen_loss_mask"), ("rejected_ids", "rejected_loss_mask"))


def preference_samples(cfg: RMConfig | DPOConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    return build_preference_samples(rows, tokenizer, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key,
                                    rejected_key=cfg.rejected_key, input_template=cfg.input_template,
                                    apply_chat_template=cfg.apply_chat_template, max_len=cfg.max_len)
