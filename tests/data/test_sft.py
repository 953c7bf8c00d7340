"""SFT samples: loss masks for plain / chat / multi-turn / pretraining, the over-long rule, and bad input."""

from __future__ import annotations

import pytest

from rlhfkit.config.parse import parse_config
from rlhfkit.data.sft import build_sft_samples
from rlhfkit.errors import DataError

TEMPLATE = "User: {}\nAssistant: "
CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]


def sft(rows, tokenizer, **kw):
    opts = dict(input_key="input", output_key="output", input_template=TEMPLATE, apply_chat_template=False,
                max_len=512)
    opts.update(kw)
    return build_sft_samples(rows, tokenizer, **opts)


def sft_from_flags(rows, tokenizer, *flags: str):
    """The samples the sft command builds (trainers.sft.sft_samples) from its parsed command line."""
    from rlhfkit.trainers.sft import sft_samples

    return sft_samples(parse_config("sft", None, ["--pretrain", "m", "--dataset", "d", *flags]), tokenizer, rows)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_plain_template_masks_exactly_the_response(tokenizer, load_rows, spans):
    rows = load_rows([{"input": "What is the capital of France?", "output": "Paris."}])
    (sample,), stats = sft(rows, tokenizer)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    prompt_ids = _ids(tokenizer, "User: What is the capital of France?\nAssistant: ")
    # boundary: the prompt part is the prompt tokenised on its own, and the mask switches on right after it
    assert ids[: len(prompt_ids)] == prompt_ids
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    assert spans(tokenizer, ids, mask) == ["Paris." + tokenizer.eos_token]
    assert ids[-1] == tokenizer.eos_token_id
    assert stats == {"total": 1, "kept": 1, "truncated": 0, "dropped": 0}


def test_chat_template_single_turn(tokenizer, load_rows, spans):
    rows = load_rows([{"input": "What is 2+2?", "output": "4"}])
    (sample,), _ = sft_from_flags(rows, tokenizer, "--input_key", "input", "--output_key", "output",
                                  "--apply_chat_template")
    ids, mask = sample["input_ids"], sample["loss_mask"]
    user = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "4"}], tokenize=False)
    boundary = mask.index(1)
    assert ids[:boundary] == _ids(tokenizer, prompt)  # role header included in the prompt, not in the target
    assert spans(tokenizer, ids, mask) == ["4<|im_end|>"]
    assert tokenizer.decode(ids) == full.rstrip("\n")  # the text after the final end-of-turn token is cut


def test_chat_conversation_without_output_key_trains_last_turn(tokenizer, load_rows, spans):
    rows = load_rows([{"messages": CONV}])
    (sample,), _ = sft(rows, tokenizer, input_key="messages", output_key=None, apply_chat_template=True)
    assert spans(tokenizer, sample["input_ids"], sample["loss_mask"]) == ["see you<|im_end|>"]


def test_chat_messages_input_and_output(tokenizer, load_rows, spans):
    rows = load_rows([{"input": CONV[:1], "output": [CONV[1]]}])
    (sample,), _ = sft(rows, tokenizer, apply_chat_template=True)
    assert spans(tokenizer, sample["input_ids"], sample["loss_mask"]) == ["hello there<|im_end|>"]


def test_multiturn_trains_every_assistant_turn_but_not_headers(tokenizer, load_rows, spans):
    rows = load_rows([{"messages": CONV}])
    (sample,), _ = sft_from_flags(rows, tokenizer, "--input_key", "messages", "--apply_chat_template", "--multiturn")
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert spans(tokenizer, ids, mask) == ["hello there<|im_end|>", "see you<|im_end|>"]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONV, tokenize=False).rstrip("\n")
    # each target run is preceded by the assistant header, which is context
    first = mask.index(1)
    assert tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def test_pretrain_mode_trains_every_token(tokenizer, load_rows):
    rows = load_rows([{"text": "Once upon a time there was a cat."}])
    (sample,), _ = sft_from_flags(rows, tokenizer, "--input_key", "text", "--pretrain_mode")
    assert sample["loss_mask"] == [1] * len(sample["input_ids"])
    # the input template is not used in pretraining, and eos closes the document
    assert tokenizer.decode(sample["input_ids"]) == "Once upon a time there was a cat." + tokenizer.eos_token


def test_over_long_rule_truncates_or_drops_and_counts(tokenizer, load_rows):
    word_ids = _ids(tokenizer, " cat")
    assert len(word_ids) == 1  # one token per " cat", so lengths below are exact
    rows = load_rows([
        {"input": "hi", "output": "ok"},                    # fits
        {"input": "hi", "output": " cat" * 40},             # response too long: truncated
        {"input": " cat" * 9, "output": "ok"},              # prompt 9 tokens: fits with exactly one target
        {"input": " cat" * 10, "output": "ok"},             # prompt 10 tokens: no room for a target: dropped
        {"input": " cat" * 40, "output": "ok"},             # prompt alone too long: dropped
    ])
    samples, stats = sft(rows, tokenizer, input_template=None, max_len=10)
    assert stats == {"total": 5, "kept": 3, "truncated": 2, "dropped": 2}
    assert len(samples) == 3
    assert all(len(s["input_ids"]) <= 10 and len(s["input_ids"]) == len(s["loss_mask"]) for s in samples)
    assert samples[1]["loss_mask"][: len(_ids(tokenizer, "hi"))] == [0] * len(_ids(tokenizer, "hi"))
    assert samples[2]["loss_mask"] == [0] * 9 + [1]


def test_missing_key_names_file_line_key_and_present_keys(tokenizer, load_rows):
    rows = load_rows([{"input": "a", "output": "b"}, {"input": "c", "answer": "d"}])
    with pytest.raises(DataError, match=r"rows0.jsonl line 2: missing key 'output' \(set by --output_key\); "
                                        r"keys present: \['input', 'answer'\]"):
        sft(rows, tokenizer)


@pytest.mark.parametrize("kw,message", [
    ({"multiturn": True}, "--multiturn needs --apply_chat_template"),
    ({"output_key": None}, "--output_key is required"),
    ({"input_template": "no placeholder"}, "--input_template .* has no '{}'"),
])
def test_bad_flag_combinations(tokenizer, load_rows, kw, message):
    rows = load_rows([{"input": "a", "output": "b"}])
    with pytest.raises(DataError, match=message):
        sft(rows, tokenizer, **kw)


def test_messages_without_chat_template_say_what_to_do(tokenizer, load_rows):
    rows = load_rows([{"input": CONV[:1], "output": "x"}])
    with pytest.raises(DataError, match=r"line 1: key 'input' holds chat messages; pass --apply_chat_template"):
        sft(rows, tokenizer)


def test_conversation_without_assistant_turn(tokenizer, load_rows):
    rows = load_rows([{"messages": CONV[:1]}])
    with pytest.raises(DataError, match=r"line 1: the conversation has no assistant message"):
        sft(rows, tokenizer, input_key="messages", output_key=None, apply_chat_template=True)


class BosTokenizer:
    """The real tokenizer, but adding a BOS token in front like Llama-style tokenizers do."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, text, add_special_tokens=True):
        ids = self._inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([self._inner.bos_token_id] + ids) if add_special_tokens else ids}

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_leading_bos_is_added_once(tokenizer, load_rows, spans):
    bos_tok = BosTokenizer(tokenizer)
    rows = load_rows([{"input": "hi", "output": "ok"}])
    (plain,), _ = sft(rows, bos_tok)
    assert plain["input_ids"][0] == tokenizer.bos_token_id and plain["loss_mask"][0] == 0
    expected = _ids(tokenizer, "User: hi\nAssistant: ") + _ids(tokenizer, "ok") + [tokenizer.eos_token_id]
    assert plain["input_ids"][1:] == expected
    # SmolLM2's chat text already starts with its BOS token (<|im_start|>): it must not be doubled
    (chat,), _ = sft(rows, bos_tok, apply_chat_template=True)
    assert chat["input_ids"][0] == tokenizer.bos_token_id and chat["input_ids"][1] != tokenizer.bos_token_id
    assert spans(tokenizer, chat["input_ids"], chat["loss_mask"]) == ["ok<|im_end|>"]
