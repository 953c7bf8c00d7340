"""SFT throughput: `rlhfkit sft` (FSDP2 engine, shared loop) beside a plain PyTorch loop, same batches, same run.

    .venv/bin/python benchmarks/sft.py [--pretrain embedded:smollm2-135m-instruct] [--steps 6]

Both train the same model on the same global batches (same order, same micro-batches, AdamW, same lr) and
count real (non-pad) tokens per second of optimizer steps, skipping the first (warm-up) step.
Prints a table and writes benchmarks/results/sft.json. Target: rlhfkit's overhead at most 10%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import machine_line, machine_record

from rlhfkit.data.collate import collate_padded, model_inputs
from rlhfkit.data.readers import blend_datasets
from rlhfkit.data.sft import build_sft_samples
from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
from rlhfkit.models.loading import load_causal_lm, load_tokenizer, resolve_pretrain
from rlhfkit.models.logprobs import log_probs_from_logits
from rlhfkit.trainers.loop import epoch_order, rank_micro_batches

RESULTS = Path(__file__).parent / "results"


def plain_loop(path: str, samples: list[dict], pad_id: int, steps: int, batch: int, micro: int, lr: float,
               seed: int) -> list[float]:
    """forward -> masked NLL -> backward per micro-batch, AdamW step per global batch; tokens/s per step."""
    torch.manual_seed(seed)
    model = load_causal_lm(path)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    order = epoch_order(len(samples), seed, 0)
    rates = []
    for step in range(steps):
        began = time.perf_counter()
        global_batch = order[step * batch:(step + 1) * batch]
        micro_batches = rank_micro_batches(global_batch, 0, 1, micro)
        targets = sum(sum(samples[i]["loss_mask"][1:]) for i in global_batch)
        tokens = 0
        for mb in micro_batches:
            chunk = [samples[i] for i in mb]
            b = collate_padded(chunk, pad_token_id=pad_id)
            logits = model(**model_inputs(b)).logits[:, :-1]
            logp = log_probs_from_logits(logits.float(), b["input_ids"][:, 1:])
            loss = -(logp * b["loss_mask"][:, 1:]).sum() / targets
            loss.backward()
            tokens += sum(len(s["input_ids"]) for s in chunk)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        rates.append(tokens / (time.perf_counter() - began))
    return rates


def rlhfkit_loop(path: str, data: str, steps: int, batch: int, micro: int, lr: float, seed: int,
                 run_dir: Path) -> list[float]:
    from rlhfkit.cli.sft import main as sft_main

    sft_main(["--pretrain", path, "--dataset", data, "--input_key", "input", "--output_key", "output",
              "--apply_chat_template", "--max_len", "128", "--train_batch_size", str(batch),
              "--micro_train_batch_size", str(micro), "--max_epochs", "1", "--learning_rate", str(lr),
              "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--seed", str(seed),
              "--max_samples", str(steps * batch), "--run_dir", str(run_dir), "--save_path", str(run_dir / "hf")])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    path = resolve_pretrain(args.pretrain)
    tokenizer = load_tokenizer(path)
    lr, seed = 1e-5, 0
    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(arithmetic_rows(args.steps * args.batch, seed=3), Path(tmp) / "train.jsonl")
        rows = blend_datasets(data, None, split="train", seed=seed, max_samples=args.steps * args.batch)
        samples, _ = build_sft_samples(rows, tokenizer, input_key="input", output_key="output", input_template=None,
                                       apply_chat_template=True, max_len=128)
        ours = rlhfkit_loop(path, data, args.steps, args.batch, args.micro, lr, seed, Path(tmp) / "run")
        plain = plain_loop(path, samples, tokenizer.pad_token_id, args.steps, args.batch, args.micro, lr, seed)
    ours_rate, plain_rate = statistics.mean(ours[1:]), statistics.mean(plain[1:])
    overhead = 1.0 - ours_rate / plain_rate
    machine = machine_record("fp32")
    result = {"machine": machine, "precision": "fp32", "model": args.pretrain, "steps": args.steps,
              "train_batch_size": args.batch,
              "micro_train_batch_size": args.micro, "threads": torch.get_num_threads(),
              "rlhfkit_tokens_per_s": ours_rate, "plain_pytorch_tokens_per_s": plain_rate,
              "rlhfkit_overhead": overhead, "target_overhead": 0.10,
              "per_step": {"rlhfkit": ours, "plain": plain}}
    print(machine_line(machine))
    print(f"\n{'loop':<16}{'tokens/s':>12}\n{'rlhfkit sft':<16}{ours_rate:>12.1f}\n{'plain PyTorch':<16}"
          f"{plain_rate:>12.1f}\noverhead: {overhead * 100:.1f}% (target <= 10%)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sft.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
