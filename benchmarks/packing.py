"""The RL training pass, padded micro-batches against `--packing_samples` (each shared prompt once), same rollout.

    .venv/bin/python benchmarks/packing.py [--prompts 4] [--samples 8] [--new_tokens 24] [--micro 8] [--repeats 5]

The rollout has the demo's shape: `--prompts` arithmetic prompts (chat template, the demo's system prompt) x
`--samples` responses of random tokens whose lengths spread from a quarter of `--new_tokens` to all of it. Both
sides run what `ModelWorker.train_policy_step` runs per micro-batch: the policy forward with the log-probs and
entropy of the response tokens, then backward of a token-sum loss. Padded: rows sorted by length, cut into
`--micro` rows, padding-only columns trimmed (the default path). Packed: rows grouped by prompt, one packed row
per micro-batch (`rlhfkit/rl/packing.py`). Alternating, medians of `--repeats` passes over the whole rollout after
one warm-up pass. Prints a table and writes benchmarks/results/packing.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import machine_line, machine_record

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.data.synthetic import arithmetic_rows
from rlhfkit.models.loading import load_causal_lm, load_tokenizer, resolve_pretrain
from rlhfkit.models.logprobs import log_probs_from_logits
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import build_experience, sort_rows_by_length, sort_rows_by_prompt, trim_padding
from rlhfkit.rl.packing import pack_rollout, packed_response_log_probs
from rlhfkit.rl.worker import micro_batches

RESULTS = Path(__file__).parent / "results"
SYSTEM = "You are a helpful assistant."  # as rlhfkit.cli.demo.SYSTEM


def demo_rollout(tokenizer, prompts: int, samples: int, new_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = arithmetic_rows(prompts, seed=1, system=SYSTEM)
    prompt_ids, response_ids, index = [], [], []
    for k, row in enumerate(rows):
        text = tokenizer.apply_chat_template(row["input"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for _ in range(samples):
            length = int(torch.randint(max(1, new_tokens // 4), new_tokens + 1, (), generator=gen))
            prompt_ids.append(list(ids))
            response_ids.append(torch.randint(100, 4000, (length,), generator=gen).tolist())
            index.append(k)
    exp = build_experience(prompt_ids, response_ids, [[0.0] * len(r) for r in response_ids], index,
                           tokenizer.pad_token_id)
    return exp.tensors()


def padded_pass(model, batch: dict[str, torch.Tensor], micro: int) -> int:
    tokens = 0
    for mb in micro_batches(sort_rows_by_length(batch), micro):
        mb = trim_padding(mb)
        seq, mask, width = mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1]
        logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=width + 1).logits[:, :-1].float()
        log_probs = log_probs_from_logits(logits, seq[:, -width:])
        entropy_from_logits(logits.detach())
        (log_probs * mb["action_mask"]).sum().backward()
        tokens += seq.numel()
    return tokens


def packed_pass(model, batch: dict[str, torch.Tensor], micro: int) -> int:
    tokens = 0
    for mb in micro_batches(sort_rows_by_prompt(batch), micro):
        mb = trim_padding(mb)
        packed = pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])
        log_probs, _ = packed_response_log_probs(model, packed, 1.0, mask_dtype=torch.float32, with_entropy=True)
        (log_probs * mb["action_mask"]).sum().backward()
        tokens += packed.num_tokens
    return tokens


def timed(fn, model, batch, micro) -> tuple[float, int]:
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    tokens = fn(model, batch, micro)
    return time.perf_counter() - began, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=24)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    machine = machine_record("fp32")
    print(machine_line(machine))
    path = resolve_pretrain(args.pretrain)
    model = load_causal_lm(path)
    model.train()
    batch = demo_rollout(load_tokenizer(path), args.prompts, args.samples, args.new_tokens, seed=0)
    real = int(batch["attention_mask"].sum())
    sides = {"padded": padded_pass, "packed": packed_pass}
    times: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for fn in sides.values():  # warm-up
        timed(fn, model, batch, args.micro)
    for _ in range(args.repeats):
        for name, fn in sides.items():
            seconds, tokens[name] = timed(fn, model, batch, args.micro)
            times[name].append(seconds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"rollout: {args.prompts} prompts x {args.samples} samples, {real} real tokens; micro-batch {args.micro}")
    print(f"| pass | tokens through the model | s (median of {args.repeats}) | speed-up |")
    print("|---|---|---|---|")
    for name in sides:
        print(f"| {name} | {tokens[name]} | {medians[name]:.2f} | {medians['padded'] / medians[name]:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packing.json").write_text(json.dumps(
        {"machine": machine, "config": vars(args), "real_tokens": real, "tokens": tokens, "seconds": times,
         "median_s": medians}, indent=2))


if __name__ == "__main__":
    main()
