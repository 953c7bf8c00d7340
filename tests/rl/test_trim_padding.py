"""Padding-free micro-batches in the trainer: columns that are padding in every row are cut, rows are sorted by
length; the model's outputs on the real tokens do not change."""

from __future__ import annotations

import torch

from rlhfkit.models.logprobs import log_probs_from_logits
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import build_experience, sort_rows_by_length, trim_padding


def _batch(prompts, responses):
    exp = build_experience(prompts, responses, [[-0.5] * len(r) for r in responses], list(range(len(prompts))), 0)
    exp.advantages = torch.arange(exp.action_mask.numel(), dtype=torch.float32).view_as(exp.action_mask)
    exp.rewards = torch.tensor([float(i) for i in range(len(prompts))])
    return exp.tensors()


def test_trim_cuts_columns_that_are_padding_everywhere():
    batch = _batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 13, 14, 15], [16]])  # P = 4, R = 5
    rows = {k: v[1:] for k, v in batch.items()}                           # the short row alone
    cut = trim_padding(rows)
    assert cut["sequences"].tolist() == [[9, 10, 16]]
    assert cut["attention_mask"].tolist() == [[1, 1, 1]]
    assert cut["action_mask"].tolist() == [[True]] and cut["rollout_log_probs"].tolist() == [[-0.5]]
    assert cut["advantages"].tolist() == [[5.0]]                          # row 1, response column 0
    assert cut["rewards"].tolist() == [1.0]
    whole = trim_padding(batch)                                            # nothing is padding in every row
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in batch.items()}


def test_trim_keeps_one_response_column_when_every_response_is_empty():
    cut = trim_padding(_batch([[5, 6], [7]], [[], []]))
    assert cut["sequences"].tolist() == [[5, 6, 0], [0, 7, 0]] and cut["action_mask"].shape == (2, 1)


def test_sorting_keeps_rows_whole():
    batch = _batch([[5, 6, 7], [8], [9, 10]], [[1, 2, 3], [4], [5, 6]])
    ordered = sort_rows_by_length(batch)
    assert ordered["attention_mask"].sum(-1).tolist() == [2, 4, 6]
    assert ordered["rewards"].tolist() == [1.0, 2.0, 0.0]
    for i, src in enumerate([1, 2, 0]):
        assert torch.equal(ordered["sequences"][i], batch["sequences"][src])
        assert torch.equal(ordered["advantages"][i], batch["advantages"][src])


def _action_log_probs(model, mb):
    width = mb["action_mask"].shape[1]
    logits = model(input_ids=mb["sequences"], attention_mask=mb["attention_mask"],
                   position_ids=position_ids(mb["attention_mask"]), logits_to_keep=width + 1).logits
    return log_probs_from_logits(logits[:, :-1].float(), mb["sequences"][:, -width:])


def test_trimmed_micro_batches_give_the_same_log_probs(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [(3, 9), (12, 2), (5, 5), (7, 1)]
    batch = _batch([torch.randint(10, 400, (p,), generator=gen).tolist() for p, _ in lengths],
                   [torch.randint(10, 400, (r,), generator=gen).tolist() for _, r in lengths])
    with torch.no_grad():
        full = _action_log_probs(model, batch)
        for rows in ([0], [1], [2, 3], [1, 3]):
            part = trim_padding({k: v[rows] for k, v in batch.items()})
            got = _action_log_probs(model, part)
            mask = part["action_mask"]
            want = full[rows][:, :got.shape[1]]
            assert got.shape[1] == max(lengths[r][1] for r in rows)
            torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
            assert not batch["action_mask"][rows][:, got.shape[1]:].any()  # nothing real was cut
