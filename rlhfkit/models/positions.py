"""Positions in padded batches: the one rule every forward of a padded row uses (#12).

`position_ids(attention_mask)`: a token's position is the number of real tokens (mask 1) before it, so the first
real token is at 0 whatever the left padding, as in an unpadded forward. Padding rule: a padded position gets
0 before the first real token and repeats the last real position after the last one (`cumsum - 1`, clamped at
0). Padded positions are never attended to (the attention mask hides them as keys), so the value they get does
not change any real token's output; only their own outputs, which every caller masks out, depend on it.

The last real token of each row (rewards at the end of a response, a reward model's score) is
`rlhfkit.algorithms.rewards.last_token_index`: -1 for a row without real tokens. It lives in `algorithms`,
which imports nothing of ours, and is used from here too.
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.rewards import last_token_index

__all__ = ["last_token_index", "position_ids"]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ([B, T], long) counted over real tokens only; see the module docstring for padded positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
