"""rlhfkit.models.positions: the one padding rule of position ids, and the last real token (#12)."""

from __future__ import annotations

import torch

from rlhfkit.models.positions import last_token_index, position_ids

MASK = torch.tensor([[0, 0, 1, 1, 1],    # left padding
                     [1, 1, 1, 0, 0],    # right padding
                     [0, 1, 1, 0, 0],    # both
                     [1, 1, 1, 1, 1]])   # none


def test_positions_count_real_tokens_and_padding_follows_one_rule():
    assert position_ids(MASK).tolist() == [[0, 0, 0, 1, 2],
                                           [0, 1, 2, 2, 2],
                                           [0, 0, 1, 1, 1],
                                           [0, 1, 2, 3, 4]]
    assert position_ids(MASK.bool()).dtype == torch.long


def test_last_token_index_for_left_and_right_padding():
    assert last_token_index(MASK).tolist() == [4, 2, 2, 4]
    assert last_token_index(torch.zeros(1, 3, dtype=torch.long)).tolist() == [-1]


def test_real_tokens_do_not_depend_on_padding(tiny_model_dir):
    """A left-padded row's real-token logits equal the unpadded row's: padded positions are never attended to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float64).eval()
    ids = torch.tensor([[5, 9, 17, 4]])
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(input_ids=ids, position_ids=position_ids(torch.ones_like(ids))).logits
        left = model(input_ids=padded, attention_mask=mask, position_ids=position_ids(mask)).logits[:, 3:]
    torch.testing.assert_close(left, plain, rtol=1e-9, atol=1e-9)
