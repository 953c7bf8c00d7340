"""A worker's forward strategy (rl/forward.py) is chosen once from the config: ring (padded or packed), packed,
vision or padded, each carrying the temperature, the log-prob truncation and the packed mask's dtype it runs with."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.models.context_parallel import RingGroup
from rlhfkit.models.logprobs import SamplingTruncation
from rlhfkit.rl.forward import (
    PackedForward,
    PaddedForward,
    RingPackedForward,
    RingPaddedForward,
    VisionForward,
    forward_strategy,
)

BASE = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "temperature": 0.7}
RING = RingGroup(group=None, rank=0, size=2)  # chosen, never run here (tests/rl/test_ring_ppo.py runs the rings)


@pytest.mark.parametrize(("flags", "ring", "vision", "expected"), [
    ({}, None, False, PaddedForward),
    ({}, None, True, VisionForward),
    ({"packing_samples": True}, None, False, PackedForward),
    ({}, RING, False, RingPaddedForward),
    ({"packing_samples": True}, RING, False, RingPackedForward),
])
def test_the_strategy_follows_packing_ring_and_vision(flags, ring, vision, expected):
    cfg = parse_config("ppo", None, flags_to_argv({**BASE, **flags}))
    cut = SamplingTruncation(top_k=5, top_p=0.9)
    chosen = forward_strategy(cfg, ring=ring, vision=vision, truncation=cut, mask_dtype=torch.bfloat16)
    assert type(chosen) is expected
    assert (chosen.temperature, chosen.truncation, chosen.mask_dtype) == (0.7, cut, torch.bfloat16)
    if ring is not None:
        assert chosen.ring is RING  # type: ignore[attr-defined]


def test_packed_strategies_keep_a_prompts_rows_together_and_padded_ones_sort_by_length():
    """Training micro-batch order: grouped by prompt for a packed row (its prompt computed once), by length for
    padded rows (trim_padding cuts more)."""
    shard = {"prompt_index": torch.tensor([0, 1, 0, 1]), "sequences": torch.zeros(4, 6, dtype=torch.long),
             "attention_mask": torch.tensor([[1] * 3 + [0] * 3, [1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0]])}
    cfg = parse_config("ppo", None, flags_to_argv(BASE))
    padded = forward_strategy(cfg, ring=None, vision=False, truncation=None, mask_dtype=torch.float32)
    packed = forward_strategy(parse_config("ppo", None, flags_to_argv({**BASE, "packing_samples": True})),
                              ring=None, vision=False, truncation=None, mask_dtype=torch.float32)
    by_prompt = packed.order(shard)
    assert by_prompt["prompt_index"].tolist() == [0, 0, 1, 1]
    assert by_prompt["attention_mask"].sum(-1).tolist() == [3, 2, 6, 5]  # stable within a prompt
    assert padded.order(shard)["attention_mask"].sum(-1).tolist() == [2, 3, 5, 6]


def test_only_the_vision_strategy_hands_the_model_the_rows_images():
    pixels = torch.ones(2, 1, 3, 4, 4)
    mb = {"pixel_values": pixels}
    vision = VisionForward(1.0, None, torch.float32)
    assert vision.model_inputs(mb)["pixel_values"].shape == (2, 1, 3, 4, 4)
    assert vision.model_inputs({}) == {}
    assert PaddedForward(1.0, None, torch.float32).model_inputs(mb) == {}


@pytest.mark.parametrize(("strategy", "switched"), [
    (PackedForward, True), (PaddedForward, False), (RingPackedForward, False), (RingPaddedForward, False),
])
def test_only_the_packed_strategy_switches_the_model_to_block_attention(tiny_model_dir, strategy, switched):
    """`prepare` runs once on the freshly loaded model: the packed strategy moves an SDPA model to
    `rlhfkit_packed_sdpa` (models/packed_attention.py); the ring strategies leave the attention to the ring."""
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.packed_attention import uses_packed_attention

    model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa")
    extra = {"ring": RING} if strategy in (RingPackedForward, RingPaddedForward) else {}
    strategy(1.0, None, torch.float32, **extra).prepare(model)
    assert uses_packed_attention(model) is switched


def test_the_packed_probe_scores_every_sequence_as_the_padded_one_does(tiny_model_dir):
    """The weight-sync probe (`probe_log_probs`): the packed strategy scores all sequences in one packed row (a
    shared prompt once); each response token's log-prob equals the one-sequence-at-a-time padded forward's, with
    sequences of different lengths and two that share a prompt. (A float64 model; the padded probe's log-softmax runs
    in float32, hence the tolerance: a token that saw a wrong key moves by far more.)"""
    from rlhfkit.models.loading import load_causal_lm

    prompts = [[5, 6, 7, 8], [11, 12], [5, 6, 7, 8]]
    responses = [[20, 21, 22], [23], [24, 25]]
    scores = {}
    for strategy in (PaddedForward(1.0, None, torch.float64), PackedForward(1.0, None, torch.float64)):
        model = load_causal_lm(tiny_model_dir).double().eval()
        strategy.prepare(model)
        with torch.no_grad():
            scores[strategy.name] = strategy.probe_log_probs(model, prompts, responses, torch.device("cpu"))
    assert [len(s) for s in scores["packed"]] == [3, 1, 2]
    for padded, packed in zip(scores["padded"], scores["packed"], strict=True):
        assert all(x < 0 for x in padded)
        torch.testing.assert_close(torch.tensor(packed), torch.tensor(padded), rtol=0, atol=1e-5)
