"""Preference pairs: prompt-key and full-conversation formats, masks, identical pairs, over-long pairs."""

from __future__ import annotations

import pytest

from rlhfkit.data.preference import build_preference_samples
from rlhfkit.errors import DataError


def pairs(rows, tokenizer, **kw):
    opts = dict(prompt_key="prompt", input_template=None, apply_chat_template=True, max_len=256)
    opts.update(kw)
    return build_preference_samples(rows, tokenizer, **opts)


def _check_pair(tokenizer, spans, sample, chosen: str, rejected: str, prompt_text: str) -> None:
    n = sample["prompt_len"]
    assert sample["chosen_ids"][:n] == sample["rejected_ids"][:n]
    assert tokenizer.decode(sample["chosen_ids"][:n]) == prompt_text
    assert spans(tokenizer, sample["chosen_ids"], sample["chosen_loss_mask"]) == [chosen]
    assert spans(tokenizer, sample["rejected_ids"], sample["rejected_loss_mask"]) == [rejected]
    assert sample["chosen_loss_mask"][:n] == [0] * n and sample["chosen_loss_mask"][n] == 1


def test_prompt_key_with_chat_template(tokenizer, load_rows, spans):
    rows = load_rows([{"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}])
    (sample,), stats = pairs(rows, tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], tokenize=False,
                                           add_generation_prompt=True)
    _check_pair(tokenizer, spans, sample, "Hi!<|im_end|>", "No.<|im_end|>", prompt)
    assert stats == {"total": 1, "kept": 1, "truncated": 0, "dropped": 0, "identical_pairs": 0, "collapsed_pairs": 0}


def test_full_conversations_without_prompt_key(tokenizer, load_rows, spans):
    user = [{"role": "user", "content": "Say hi"}]
    rows = load_rows([{"chosen": user + [{"role": "assistant", "content": "Hi!"}],
                       "rejected": user + [{"role": "assistant", "content": "No."}]}])
    (sample,), _ = pairs(rows, tokenizer, prompt_key=None)
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    _check_pair(tokenizer, spans, sample, "Hi!<|im_end|>", "No.<|im_end|>", prompt)


def test_plain_template(tokenizer, load_rows, spans):
    rows = load_rows([{"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}])
    (sample,), _ = pairs(rows, tokenizer, apply_chat_template=False, input_template="User: {}\nAssistant: ")
    eos = tokenizer.eos_token
    _check_pair(tokenizer, spans, sample, "Hi!" + eos, "No." + eos, "User: Say hi\nAssistant: ")


def test_plain_whole_texts_without_prompt_key(tokenizer, load_rows, spans):
    rows = load_rows([{"chosen": "good text", "rejected": "bad text"}])
    (sample,), _ = pairs(rows, tokenizer, prompt_key=None, apply_chat_template=False)
    assert sample["prompt_len"] == 0
    assert spans(tokenizer, sample["chosen_ids"], sample["chosen_loss_mask"]) == ["good text" + tokenizer.eos_token]


def test_identical_pairs_are_kept_and_counted(tokenizer, load_rows):
    rows = load_rows([{"prompt": "p", "chosen": "same", "rejected": "same"},
                      {"prompt": "p", "chosen": "a", "rejected": "b"}])
    samples, stats = pairs(rows, tokenizer)
    assert len(samples) == 2 and stats["identical_pairs"] == 1


def test_over_long_pairs(tokenizer, load_rows):
    rows = load_rows([{"prompt": "p", "chosen": " cat" * 50, "rejected": "short"},
                      {"prompt": " cat" * 50, "chosen": "a", "rejected": "b"}])
    samples, stats = pairs(rows, tokenizer, apply_chat_template=False, max_len=20)
    assert stats == {"total": 2, "kept": 1, "truncated": 1, "dropped": 1, "identical_pairs": 0, "collapsed_pairs": 0}
    assert len(samples[0]["chosen_ids"]) == 20 and len(samples[0]["chosen_loss_mask"]) == 20
    assert samples[0]["rejected_ids"][-1] == tokenizer.eos_token_id  # the short side is not cut


def test_pairs_identical_after_the_cut_are_dropped_counted_and_reported(tokenizer, load_rows, caplog):
    """OpenRLHF #1313 (issue #1311), ported: chosen and rejected that differ only past --max_len become the same
    tokens after the cut, a pair with no preference signal; it is dropped, counted as collapsed_pairs and logged.
    A pair whose difference survives the cut is kept."""
    shared = " cat" * 30
    rows = load_rows([{"prompt": "p", "chosen": shared + " good", "rejected": shared + " bad"},
                      {"prompt": "p", "chosen": " dog" + shared, "rejected": " cow" + shared}])
    with caplog.at_level("WARNING"):
        samples, stats = pairs(rows, tokenizer, apply_chat_template=False, max_len=20)
    assert stats == {"total": 2, "kept": 1, "truncated": 1, "dropped": 1, "identical_pairs": 0, "collapsed_pairs": 1}
    assert len(samples) == 1 and samples[0]["chosen_ids"] != samples[0]["rejected_ids"]
    assert "1 pairs dropped because chosen and rejected are the same tokens after the cut to --max_len 20" in \
        caplog.text


def test_conversations_with_different_prompts_are_an_error(tokenizer, load_rows):
    rows = load_rows([{"chosen": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "x"}],
                       "rejected": [{"role": "user", "content": "B"}, {"role": "assistant", "content": "y"}]}])
    with pytest.raises(DataError, match=r"line 1: chosen and rejected have different prompts"):
        pairs(rows, tokenizer, prompt_key=None)


def test_missing_rejected_key(tokenizer, load_rows):
    rows = load_rows([{"prompt": "p", "chosen": "a", "bad": "b"}])
    with pytest.raises(DataError, match=r"line 1: missing key 'rejected' \(set by --rejected_key\)"):
        pairs(rows, tokenizer)
