"""The training forward's log-probs + entropy from the LM head's output, the plain path against the fused one.

    .venv/bin/python benchmarks/logprob_entropy.py [--batch 2] [--tokens 512] [--vocab 49152] [--hidden 576]
        [--dtype bf16] [--temperature 1.0] [--repeats 7] [--memory]

One micro-batch of the padded policy forward as `ModelWorker._action_log_probs` computes it, from the final hidden
states on: logits = hidden @ lm_head.T for the last ``tokens + 1`` positions ([batch, tokens + 1, vocab], SmolLM2's
shapes by default), the per-token log-probs of random labels and the (detached) entropy at ``--temperature``, then
backward of a token-mean loss into the hidden states and the LM head weight.

- plain: the code the fused path replaced (rlhfkit before issue #27): ``logits[:, :-1].float() / T``, then
  ``logit[label] - logsumexp`` a few batch rows at a time and ``entropy_from_logits`` on the detached float32
  logits, all through autograd.
- fused: `rlhfkit.models.logprobs.shifted_log_probs_and_entropy` (rlhfkit/models/fused_logprobs.py).

Default: wall time, the two paths alternating, medians of `--repeats` after one warm-up each; writes
benchmarks/results/logprob_entropy.json. ``--memory``: no timing; each path once under `torch.profiler` with
``profile_memory``: the peak of live tensor bytes allocated during the step (above what existed before it) and
the allocations at least as large as one ``[batch x tokens, vocab]`` tensor of the logits' dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from machine import machine_line, machine_record

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.models.logprobs import shifted_log_probs_and_entropy

RESULTS = Path(__file__).parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def plain_step(hidden: torch.Tensor, weight: torch.Tensor, sequences: torch.Tensor, mask: torch.Tensor,
               temperature: float) -> None:
    """The replaced code: upcast + temperature on the whole logits, chunked logsumexp, entropy, via autograd."""
    width = mask.shape[1]
    logits = (hidden @ weight.T)[:, :-1].float() / temperature
    labels = sequences[:, -width:]
    rows = []
    for start in range(0, logits.shape[0], 4):
        chunk = logits[start:start + 4].float()
        picked = chunk.gather(-1, labels[start:start + 4].unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(chunk, dim=-1))
    log_probs = torch.cat(rows)
    entropy_from_logits(logits.detach())                     # the metric the worker reports
    loss = -(log_probs * mask).sum() / mask.sum()
    loss.backward()


def fused_step(hidden: torch.Tensor, weight: torch.Tensor, sequences: torch.Tensor, mask: torch.Tensor,
               temperature: float) -> None:
    """The training forward now: `shifted_log_probs_and_entropy` on the model-dtype logits."""
    width = mask.shape[1]
    log_probs, _ = shifted_log_probs_and_entropy(hidden @ weight.T, sequences, width, temperature, with_entropy=True)
    loss = -(log_probs * mask).sum() / mask.sum()
    loss.backward()


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(args.batch, args.tokens + 1, args.hidden, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden ** -0.5).to(dtype).requires_grad_()
    sequences = torch.randint(0, args.vocab, (args.batch, args.tokens + 8), generator=gen)
    mask = torch.ones(args.batch, args.tokens)
    mask[0, args.tokens // 2:] = 0                           # a shorter response
    return hidden, weight, sequences, mask


def memory_profile(step: Step, args: argparse.Namespace) -> dict:
    """Peak live bytes allocated during one step and the large allocations, from the profiler's allocation timeline
    (`torch.profiler.profile._memory_profile`, what `export_memory_timeline` draws: every tensor allocation and
    free; tensors that existed before the step are not counted)."""
    from torch.profiler._memory_profiler import Action

    hidden, weight, sequences, mask = inputs(args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step(hidden, weight, sequences, mask, args.temperature)
    live = peak = 0
    big = args.batch * args.tokens * args.vocab * DTYPES[args.dtype].itemsize
    large = []
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
            if size >= big:
                large.append(size)
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return {"peak_MiB": peak / 2 ** 20, "allocations_of_at_least_one_logits_tensor": len(large),
            "their_MiB": [round(n / 2 ** 20, 1) for n in large], "logits_tensor_MiB": big / 2 ** 20}


def timed(step: Step, args: argparse.Namespace) -> float:
    hidden, weight, sequences, mask = inputs(args)
    began = time.perf_counter()
    step(hidden, weight, sequences, mask, args.temperature)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="response tokens per row")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory", action="store_true", help="profile allocations instead of timing")
    args = parser.parse_args()
    steps: dict[str, Step] = {"plain": plain_step, "fused": fused_step}
    print(f"{args.batch} x {args.tokens} tokens x {args.vocab} vocab, hidden {args.hidden}, {args.dtype}, "
          f"temperature {args.temperature}")
    if args.memory:
        report = {name: memory_profile(step, args) for name, step in steps.items()}
        print("| path | peak MiB above start | allocations >= one [tokens, V] logits tensor | their MiB |")
        print("|---|---|---|---|")
        for name, r in report.items():
            print(f"| {name} | {r['peak_MiB']:.0f} | {r['allocations_of_at_least_one_logits_tensor']} | "
                  f"{r['their_MiB']} |")
        return
    machine = machine_record(args.dtype)
    print(machine_line(machine))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        timed(step, args)
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(timed(step, args))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"| path | s (median of {args.repeats}) | speed-up |")
    print("|---|---|---|")
    for name in steps:
        print(f"| {name} | {medians[name]:.3f} | {medians['plain'] / medians[name]:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "logprob_entropy.json").write_text(json.dumps(
        {"machine": machine, "config": vars(args), "seconds": times, "median_s": medians}, indent=2))


if __name__ == "__main__":
    main()
