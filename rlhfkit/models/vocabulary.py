"""Whether two models can score each other's token ids: the same tokenizer (token -> id map and special tokens),
and embeddings that cover it. On-policy distillation needs this of the student and the teacher (the teacher scores
the student's sampled ids); a model with more embedding rows than the tokenizer (padded vocabularies, as between
sizes of one family) is fine."""

from __future__ import annotations

from transformers import AutoConfig

from rlhfkit.errors import ConfigError
from rlhfkit.models.loading import load_tokenizer, resolve_pretrain


def check_same_tokenizer(student: str, teacher: str, student_flag: str = "--pretrain",
                         teacher_flag: str = "--teacher_model") -> None:
    """ConfigError naming both models (and flags) unless `teacher` reads `student`'s token ids as the same tokens:
    equal vocabularies (every token string with the same id), the same eos / bos / pad tokens, and a teacher
    embedding table with a row for every id."""
    s_tok, t_tok = load_tokenizer(student), load_tokenizer(teacher)
    named = f"{student_flag} {student} and {teacher_flag} {teacher}"
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    if s_vocab != t_vocab:
        differing = sorted(tok for tok in set(s_vocab) | set(t_vocab) if s_vocab.get(tok) != t_vocab.get(tok))
        example = differing[0]
        raise ConfigError(f"{named} have different tokenizers ({len(s_vocab)} vs {len(t_vocab)} tokens; "
                          f"{len(differing)} tokens differ, e.g. {example!r}: id {s_vocab.get(example)} vs "
                          f"{t_vocab.get(example)}): the teacher scores the student's token ids, so both must share "
                          "one tokenizer. Pick a teacher of the student's model family")
    for name in ("eos_token", "bos_token", "pad_token"):
        if getattr(s_tok, name) != getattr(t_tok, name):
            raise ConfigError(f"{named}: the {name} differs ({getattr(s_tok, name)!r} vs {getattr(t_tok, name)!r}); "
                              "both must share one tokenizer")
    rows = AutoConfig.from_pretrained(resolve_pretrain(teacher)).vocab_size
    if rows is not None and rows < len(t_tok):
        raise ConfigError(f"{teacher_flag} {teacher}: its embedding table has {rows} rows but its tokenizer "
                          f"{len(t_tok)} tokens, so it cannot score every id {student_flag} {student} samples")
