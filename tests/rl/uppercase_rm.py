"""A reward model a tiny random-init policy can climb, trained with `rlhfkit rm`.

Preference pairs on the PPO test prompts ("Repeat: red cat"): the chosen response is a string of vocabulary tokens
written in upper case (e.g. 'EMS', 'API'; every such token of the vocabulary appears in some chosen answer), the
rejected one a string of lower-case tokens. Two epochs reach accuracy 1. The model's score is a token-level function
of the response, which a random-init tiny policy (near-uniform over the vocabulary) climbs within a dozen PPO steps.
What it climbs is the reward model's score, not necessarily upper case: tokens the reward model never saw keep
random embeddings, and measured on the letters rule (`letters_reward.py`) the policy does not move in 12 steps.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlhfkit.data.synthetic import echo_rows, write_jsonl


def letter_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(upper-case token ids, lower-case token ids): tokens whose text is 2+ ASCII letters of one case."""
    upper, lower = [], []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id]).strip()
        if len(text) >= 2 and text.isascii() and text.isalpha():
            if text.isupper():
                upper.append(token_id)
            elif text.islower():
                lower.append(token_id)
    return upper, lower


def preference_file(tokenizer, out: Path, tokens: int = 8, seed: int = 0) -> str:
    """One pair per `tokens` upper-case tokens: every upper-case token of the vocabulary is in some chosen answer."""
    upper, lower = letter_tokens(tokenizer)
    rng = random.Random(seed)
    rng.shuffle(upper)
    chunks = [upper[i:i + tokens] for i in range(0, len(upper) - tokens + 1, tokens)]
    prompts = [r["input"] for r in echo_rows(len(chunks), seed=seed + 1)]
    rows = [{"prompt": prompt, "chosen": tokenizer.decode(chunk),
             "rejected": tokenizer.decode(rng.sample(lower, tokens))} for prompt, chunk in zip(prompts, chunks)]
    return write_jsonl(rows, out)


def train_reward_model(base_model: str, tokenizer, out: Path, epochs: int = 2, lr: float = 1e-2) -> tuple[str, dict]:
    """`rlhfkit rm` on the uppercase-vs-lowercase pairs (in-process); returns (model folder, its result)."""
    from rlhfkit.cli.rm import main as rm_main

    data = preference_file(tokenizer, out / "pairs.jsonl")
    argv = ["--pretrain", base_model, "--dataset", data, "--prompt_key", "prompt", "--apply_chat_template",
            "--max_len", "64", "--train_batch_size", "32", "--micro_train_batch_size", "32",
            "--max_epochs", str(epochs), "--learning_rate", str(lr), "--lr_warmup_ratio", "0",
            "--lr_scheduler", "constant", "--seed", "1",
            "--save_path", str(out / "rm"), "--run_dir", str(out / "rm_run"), "--ckpt_path", str(out / "rm_ckpt")]
    result = rm_main(argv)
    return str(out / "rm"), result
