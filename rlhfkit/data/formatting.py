"""Turn rows into prompt / response text: ``--input_key``, ``--output_key``, ``--input_template``,
``--apply_chat_template`` (string inputs or ``{"role", "content"}`` message lists, multi-turn).

Text is split into *segments* ``(text, kind)`` that the encoders tokenise one by one and concatenate, so the
prompt tokens of a training sample are exactly the tokens the prompt has on its own at inference time:

* ``"prompt"``: context, never a training target;
* ``"target"``: every token is a training target (plain-text responses);
* ``"turn"``: an assistant turn rendered by the chat template; its tokens up to and including the first special
  token (the end-of-turn token, e.g. ``<|im_end|>``) are targets, whatever follows (e.g. a newline) is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlhfkit.data.errors import PROVENANCE_COLUMNS, row_error
from rlhfkit.errors import DataError

PROMPT, TARGET, TURN = "prompt", "target", "turn"
Segment = tuple[str, str]
Messages = list[dict[str, str]]


def get_field(row: Mapping[str, Any], key: str, flag: str) -> Any:
    """``row[key]``; a missing (or null) key raises an error naming the file, row, key, flag and the keys present."""
    value = row.get(key)
    if value is None:
        present = [k for k, v in row.items() if k not in PROVENANCE_COLUMNS and v is not None]
        raise row_error(row, f"missing key {key!r} (set by {flag}); keys present: {present}. "
                             f"Point {flag} at one of them or fix the data.")
    return value


def apply_input_template(text: str, input_template: str | None) -> str:
    """``--input_template "User: {}\\nAssistant: "`` with the input put where ``{}`` is (other braces are kept)."""
    if input_template is None:
        return text
    if "{}" not in input_template:
        raise DataError(f"--input_template {input_template!r} has no '{{}}' placeholder for the input; "
                        "write it like 'User: {}\\nAssistant: '.")
    before, after = input_template.split("{}", 1)
    return before + text + after


def to_messages(value: Any, row: Mapping[str, Any], key: str, default_role: str = "user") -> Messages:
    """A string (wrapped as one ``default_role`` message), one message dict, or a list of message dicts."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    items = [value] if isinstance(value, Mapping) else value
    if not isinstance(items, Sequence) or not items:
        raise row_error(row, f"key {key!r} must be a string or a non-empty list of {{'role', 'content'}} messages, "
                             f"got {type(value).__name__}.")
    messages = []
    for i, m in enumerate(items):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise row_error(row, f"key {key!r} message {i} must be a dict with string 'role' and 'content', got {m!r}.")
        messages.append({k: v for k, v in m.items() if v is not None})  # Arrow fills absent fields with None
    return messages


def render_chat(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool, row: Mapping[str, Any]) -> str:
    """The tokenizer's chat template applied to ``messages`` (text, not tokens); errors name the row."""
    if not messages:
        return ""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("--apply_chat_template: the tokenizer has no chat template; "
                        "pass --tokenizer_chat_template or use --input_template instead.")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) re-raised with the row
        raise row_error(row, f"the chat template rejected these messages ({type(e).__name__}: {e}).") from e


def format_prompt(value: Any, tokenizer: Any, *, input_template: str | None, apply_chat_template: bool,
                  row: Mapping[str, Any], key: str) -> str:
    """Prompt text for generation or training: chat template with the generation prompt, or the input template.

    With ``apply_chat_template`` the input template is not used (the chat template formats the prompt).
    """
    if apply_chat_template:
        return render_chat(tokenizer, to_messages(value, row, key), add_generation_prompt=True, row=row)
    return apply_input_template(require_text(value, row, key), input_template)


def require_text(value: Any, row: Mapping[str, Any], key: str) -> str:
    """A plain string; a message list without ``--apply_chat_template`` is an error saying so."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        raise row_error(row, f"key {key!r} holds chat messages; pass --apply_chat_template to format them.")
    raise row_error(row, f"key {key!r} must be a string, got {type(value).__name__} ({value!r}).")


def plain_segments(prompt: str, response: str) -> list[Segment]:
    """A prompt and a plain-text response (the encoder appends eos to the target)."""
    return [(prompt, PROMPT), (response, TARGET)]


def chat_segments(tokenizer: Any, messages: Messages, *, all_assistant_turns: bool,
                  row: Mapping[str, Any]) -> list[Segment]:
    """Segments of a conversation rendered by the chat template.

    The last assistant turn is a training target (every assistant turn when ``all_assistant_turns``); everything else,
    including each assistant role header, is context. The text after the last target turn is not included.
    Requires that rendering a prefix of the conversation with the generation prompt is a prefix of the rendering of
    the longer conversation (true for ordinary templates); otherwise the error names the row.
    """
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise row_error(row, "the conversation has no assistant message to train on.")
    targets = assistant if all_assistant_turns else assistant[-1:]
    segments: list[Segment] = []
    done = ""
    for i in targets:
        header = render_chat(tokenizer, messages[:i], add_generation_prompt=True, row=row)
        full = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, row=row)
        _check_prefix(done, header, row)
        _check_prefix(header, full, row)
        segments.append((header[len(done):], PROMPT))
        segments.append((full[len(header):], TURN))
        done = full
    return [s for s in segments if s[0]]


def last_assistant_split(messages: Messages, row: Mapping[str, Any], key: str) -> tuple[Messages, Messages]:
    """(messages before the last assistant turn, the rest) for full conversations without a prompt key."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise row_error(row, f"key {key!r}: the conversation has no assistant message.")
    return messages[: assistant[-1]], messages[assistant[-1]:]


def _check_prefix(prefix: str, text: str, row: Mapping[str, Any]) -> None:
    if not text.startswith(prefix):
        raise row_error(row, "the chat template renders an earlier part of this conversation differently once later "
                             "turns are added, so turn boundaries cannot be located; train without --multiturn "
                             "or use a template whose renderings are prefixes of each other.")
