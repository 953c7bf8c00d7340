"""One attention layer of a packed row (SmolLM2-135M's 9 query / 3 key-value heads of 64, bf16, forward + backward),
four ways: the dense ``[L, L]`` mask (what packed rows used before), causal rows, masked blocks and shared prompts
(`rlhfkit.models.packed_attention`); and which of the block layouts the cost estimate picks.

    .venv/bin/python benchmarks/packed_attention.py [--reps 5]
    .venv/bin/python benchmarks/packed_attention.py --widths   # bf16 blocks in bf16, in fp32, in matmuls

`--widths`: one attention call over N blocks of W tokens (causal, or under a [W, W] mask), bf16 inputs, forward +
backward: SDPA's kernel in bf16, SDPA on the blocks upcast to fp32 (cast included), and `attend_in_matmuls` where the
call has at most `MATMUL_ATTENTION_MAX_SCORES` scores; alternating; writes packed_attention_widths.json. It
calibrates `FP32_ATTENTION_MAX_WIDTH` (below it the CPU kernel is faster in fp32) and the matmul route.

Shapes: micro-batches of the workloads that pack (the demo's one prompt x 8 samples, GRPO's forced-256/512 micro-
batches of 2 prompts x 4 samples, a long prompt shared by short answers, an offline SFT row of 8 x 128). Per shape:
the median of `--reps` timed runs after one warm-up, each layout alternating. Prints a table and writes
benchmarks/results/packed_attention.json. The estimate's constants (`CALL_NS`, `BLOCK_NS`, `*_SCORE_NS`) were
fitted on these timings on an AMD EPYC Zen 5 (native bf16); on another machine the table says how far its picks are
from the best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_line, machine_record

from rlhfkit.engine.host_memory import retain_freed_host_memory
from rlhfkit.models.packed_attention import (
    MATMUL_ATTENTION_MAX_SCORES,
    PackedAttention,
    attend_in_matmuls,
    causal_rows,
    masked_blocks,
    packed_sdpa_forward,
    sample_blocks,
    shared_prompts,
)
from rlhfkit.rl.packing import allowed_between, allowed_keys, pack_rows

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, DIM = 9, 3, 64
SHAPES = [  # name, prompts, samples per prompt, prompt length, response length (offline: samples x length)
    ("demo micro-batch (1 x 8, 45 + 24)", 1, 8, 45, 24),
    ("demo, 4 prompts per micro-batch", 4, 8, 45, 24),
    ("demo step (4 x 8, 30 + 16)", 4, 8, 30, 16),
    ("forced-256 micro-batch (2 x 4, 60 + 256)", 2, 4, 60, 256),
    ("forced-512 micro-batch (2 x 4, 60 + 512)", 2, 4, 60, 512),
    ("long prompt, short answers (1 x 8, 1000 + 32)", 1, 8, 1000, 32),
    ("offline SFT row (8 x 128)", 0, 8, 0, 128),
]


def layouts(prompts: int, samples: int, prompt_len: int, response_len: int) -> tuple[dict[str, PackedAttention],
                                                                                      torch.Tensor, str]:
    """The dense mask ([L, L] bool), both block layouts, and the one the estimate picks."""
    if prompts == 0:  # whole samples back to back
        total = samples * response_len
        rows = [range(i * response_len, (i + 1) * response_len) for i in range(samples)]
        owner = torch.arange(total) // response_len
        allowed = (owner[:, None] == owner[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
        return ({"causal rows": causal_rows(rows, total),
                 "masked blocks": masked_blocks([range(total)], lambda p: allowed[p][:, p], total)},
                allowed, sample_blocks([response_len] * samples).kind)
    packed = pack_rows([[p + 1] * prompt_len for p in range(prompts) for _ in range(samples)],
                       [[7] * response_len] * (prompts * samples), response_len)
    group, segment = packed.group, packed.segment
    rows, blocks, prompt_rows, responses = [], [], [], []
    for g in range(prompts):
        members = (group == g).nonzero().flatten()
        blocks.append(members.tolist())
        prompt = members[segment[members] == -1].tolist()
        prompt_rows.append(prompt)
        for r in sorted(set(segment[members].tolist()) - {-1}):
            rows.append(prompt + (segment == r).nonzero().flatten().tolist())
            responses.append((g, (segment == r).nonzero().flatten().tolist()))
    length = packed.num_tokens
    return ({"causal rows": causal_rows(rows, length),
             "masked blocks": masked_blocks(blocks, lambda p: allowed_keys(group[p], segment[p]), length),
             "shared prompts": shared_prompts(prompt_rows, responses,
                                              lambda q, k: allowed_between(group, segment, q, k), length)},
            allowed_keys(group, segment), packed.blocks.kind)


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(allowed: torch.Tensor, block_layouts: dict[str, PackedAttention], reps: int) -> dict[str, float]:
    """Milliseconds per forward + backward: the dense mask, then each block layout."""
    length = allowed.shape[0]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, length, DIM, generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, KV_HEADS, length, DIM, generator=g).bfloat16().requires_grad_()
    v = torch.randn(1, KV_HEADS, length, DIM, generator=g).bfloat16().requires_grad_()

    def dense() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None], enable_gqa=True).sum().backward()

    def blockwise(layout: PackedAttention):
        return lambda: packed_sdpa_forward(torch.nn.Module(), q, k, v, None, packed_attention=layout)[0].sum(
            ).backward()

    ms = {"dense mask": timed(dense, reps) * 1e3}
    for kind, layout in block_layouts.items():
        ms[kind] = timed(blockwise(layout), reps) * 1e3
    return ms


WIDTHS = [(32, 20, True), (32, 53, True), (4, 144, False), (16, 96, True), (8, 160, False), (4, 256, False),
          (1, 300, False), (1, 576, False), (8, 512, True), (1, 768, False), (4, 1054, True)]  # blocks, width, causal


def width_sweep(reps: int) -> list[dict]:
    """ms per forward + backward of one layer's SDPA over bf16 blocks, in bf16 and upcast to fp32."""
    rows = []
    for blocks, width, causal in WIDTHS:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(blocks, HEADS, width, DIM, generator=g).bfloat16().requires_grad_()
        kv = torch.randn(blocks, KV_HEADS, width, DIM, generator=g).bfloat16().requires_grad_()
        masks = {"is_causal": True} if causal else {"attn_mask": torch.ones(blocks, 1, width, width,
                                                                             dtype=torch.bool).tril()}

        def run(dtype: torch.dtype, q: torch.Tensor = q, kv: torch.Tensor = kv, masks: dict = masks):
            return lambda: F.scaled_dot_product_attention(q.to(dtype), kv.to(dtype), kv.to(dtype), enable_gqa=True,
                                                          **masks).bfloat16().sum().backward()

        def in_matmuls(q: torch.Tensor = q, kv: torch.Tensor = kv, masks: dict = masks):
            return lambda: attend_in_matmuls(q, kv, kv, masks.get("attn_mask"), DIM ** -0.5).sum().backward()
        routes = {"bf16": run(torch.bfloat16), "fp32": run(torch.float32)}
        if blocks * HEADS * width * width <= MATMUL_ATTENTION_MAX_SCORES:
            routes["matmuls"] = in_matmuls()
        times: dict[str, list[float]] = {name: [] for name in routes}
        for _ in range(reps):
            for name, fn in routes.items():
                times[name].append(timed(fn, 1) * 1e3)
        ms = {k: round(statistics.median(v), 2) for k, v in times.items()}
        rows.append({"blocks": blocks, "width": width, "causal": causal, "ms": ms,
                     "fp32_over_bf16": round(ms["fp32"] / ms["bf16"], 2),
                     "matmuls_over_fp32": round(ms["matmuls"] / ms["fp32"], 2) if "matmuls" in ms else None})
        matmuls = f"matmuls {ms['matmuls']:7.2f} ms ({ms['matmuls'] / ms['fp32']:.2f}x fp32)" if "matmuls" in ms \
            else "matmuls       - (over the score bound)"
        print(f"{blocks:3d} x {width:5d} {'causal' if causal else 'masked'}  bf16 {ms['bf16']:7.2f} ms  "
              f"fp32 {ms['fp32']:7.2f} ms  ({rows[-1]['fp32_over_bf16']:.2f}x)  {matmuls}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--widths", action="store_true",
                        help="the bf16 / fp32 / matmuls sweep over block widths instead")
    args = parser.parse_args()
    retain_freed_host_memory()  # as rlhfkit's CPU processes run (rlhfkit.engine.host_memory)
    record = machine_record()
    print(machine_line(record))
    if args.widths:
        RESULTS.mkdir(exist_ok=True)
        sweep = width_sweep(args.reps)
        (RESULTS / "packed_attention_widths.json").write_text(json.dumps({"machine": record, "rows": sweep},
                                                                         indent=1))
        return
    rows = []
    for name, prompts, samples, prompt_len, response_len in SHAPES:
        block_layouts, allowed, picked = layouts(prompts, samples, prompt_len, response_len)
        ms = measure(allowed, block_layouts, args.reps)
        length = allowed.shape[0]
        best = min(ms[k] for k in block_layouts)
        rows.append({"shape": name, "tokens": length, "ms": {k: round(t, 2) for k, t in ms.items()}, "picked": picked,
                     "picked_over_best": round(ms[picked] / best, 2), "dense_over_picked": round(ms["dense mask"] /
                                                                                                   ms[picked], 2)})
        shared = f"{ms['shared prompts']:8.1f}" if "shared prompts" in ms else "       -"
        print(f"{name:48s} L={length:5d}  dense {ms['dense mask']:8.1f} ms  rows {ms['causal rows']:8.1f}  "
              f"blocks {ms['masked blocks']:8.1f}  shared {shared}  picked {picked} "
              f"({rows[-1]['picked_over_best']:.2f}x the best; dense {rows[-1]['dense_over_picked']:.2f}x it)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packed_attention.json").write_text(json.dumps({"machine": record, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
