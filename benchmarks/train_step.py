"""The demo's policy training step on SmolLM2-135M in one process, per precision path, with a profile of where the
time goes: what `perf/mfu_training` measures inside `rlhfkit ppo`, without Ray or vLLM around it.

    .venv/bin/python benchmarks/train_step.py [--steps 4] [--paths fp32,fsdp-bf16,bf16-master]
        [--response_len 24] [--profile]

One step = the demo's mini-batch: 4 prompts x 8 samples (prompt 45 tokens, response 24), each prompt's 8 samples
packed into one row (`rlhfkit.rl.packing`), forward with `packed_response_log_probs` (entropy too), a GRPO-shaped
token-mean loss, backward, then the optimizer step. Paths:
  fp32        fp32 weights and compute (what auto picks without native bf16): a TrainEngine built with the demo's
              config, as the actor worker builds it, stepped by its optimizer_step()
  bf16-master the same TrainEngine at bf16: bf16 weights for compute, fp32 masters in the optimizer, gradients summed
              in fp32 (`rlhfkit.engine.master_weights`: what rlhfkit does on one rank in half precision)
  fsdp-bf16   FSDP2 `MixedPrecisionPolicy(param bf16, reduce fp32)` on one gloo rank (what two ranks do)
Reports the median step time (alternating paths, one sitting) and TFLOP/s against the precision's ceiling
(`benchmarks/machine.py`). Writes benchmarks/results/train_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from machine import machine_line, machine_record

RESULTS = Path(__file__).parent / "results"
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 4, 8, 45, 24


def batches(vocab: int, seed: int = 0, prompts_per_micro: int = 4,
            response_len: int = RESPONSE_LEN) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of `prompts_per_micro` prompts' 8 samples each (the demo: 4, --micro_train_batch_size 32),
    left-padded prompt + right-padded response (the worker's layout), every response `response_len` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(PROMPTS):
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=g)
        rows = torch.cat([prompt.expand(SAMPLES, -1), torch.randint(0, vocab, (SAMPLES, response_len), generator=g)], 1)
        out.append({"sequences": rows, "attention_mask": torch.ones_like(rows),
                    "action_mask": torch.ones(SAMPLES, response_len, dtype=torch.bool),
                    "advantages": torch.randn(SAMPLES, response_len, generator=g)})
    return [{key: torch.cat([mb[key] for mb in out[i:i + prompts_per_micro]]) for key in out[0]}
            for i in range(0, len(out), prompts_per_micro)]


def demo_config(model_dir: str) -> Any:
    """The demo's ppo config (`rlhfkit.cli.demo.DEMO_FLAGS`: its lr, AdamW, clip, rounding, seed), parsed as the
    command parses it."""
    from rlhfkit.cli.demo import DEMO_FLAGS
    from rlhfkit.config.parse import flags_to_argv, parse_config

    return parse_config("ppo", argv=flags_to_argv({**DEMO_FLAGS, "pretrain": model_dir, "prompt_data": "unused"}))


def build(path_name: str, model_dir: str) -> tuple[Any, torch.dtype]:
    """(what steps, compute dtype): a TrainEngine built as the actor worker builds it (`rlhfkit.rl.worker`), or for
    fsdp-bf16 a model and optimizer of its own."""
    from rlhfkit.config.optim_options import role_learning_rate
    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.packed_attention import use_packed_attention

    model = load_causal_lm(model_dir)
    use_packed_attention(model)  # as the workers' packed strategy does (rl/forward.py)
    if path_name == "fsdp-bf16":  # what shard_model did on one rank before the masters (2 ranks still do this)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from rlhfkit.engine.fsdp import decoder_layers

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        return FsdpStep(model, torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)), torch.bfloat16
    cfg = demo_config(model_dir)
    dtype = {"fp32": "fp32", "bf16-master": "bf16"}[path_name]
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    engine = TrainEngine(model, dataclasses.replace(cfg, param_dtype=dtype), dist, total_steps=1000,
                         learning_rate=role_learning_rate(cfg, "actor"), role="actor")
    return engine, torch.float32 if dtype == "fp32" else torch.bfloat16


class FsdpStep:
    """The fsdp-bf16 path's model and optimizer, stepped plainly (clip, step, zero): TrainEngine cannot build this path
    (on one rank in bf16 it uses master weights), so this is not its step (which folds the clip into fused AdamW)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def step(engine: Any, mask_dtype: torch.dtype, mbs: list[dict[str, torch.Tensor]]) -> None:
    """One optimizer step over `mbs`: forward with log-probs and entropy, a token-mean policy loss, backward; then
    the engine's optimizer step (clip, AdamW, and for bf16-master the masters' rounding into the compute copy)."""
    from rlhfkit.rl.packing import pack_rollout, packed_response_log_probs

    tokens = sum(float(mb["action_mask"].sum()) for mb in mbs)
    for mb in mbs:
        packed = pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])
        log_probs, _ = packed_response_log_probs(engine.model, packed, 1.0, mask_dtype=mask_dtype, with_entropy=True)
        ratio = torch.exp(log_probs - log_probs.detach())
        loss = -(ratio * mb["advantages"] * mb["action_mask"]).sum() / tokens
        loss.backward()
    engine.optimizer_step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--paths", default="fp32,fsdp-bf16,bf16-master")
    parser.add_argument("--prompts_per_micro", type=int, default=4,
                        help="prompts (of 8 samples) per micro-batch: 4 is the demo's --micro_train_batch_size 32")
    parser.add_argument("--response_len", type=int, default=RESPONSE_LEN,
                        help="tokens per response: 24 is the demo's --generate_max_len; its answers average fewer")
    parser.add_argument("--profile", action="store_true", help="a torch.profiler table per path (one step)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from rlhfkit.engine.host_memory import retain_freed_host_memory

    retain_freed_host_memory()  # as every training process does (rlhfkit.engine.host_memory)
    from rlhfkit.models.loading import resolve_pretrain
    from rlhfkit.observability.mfu import FlopModel  # noqa: F401  (the same FLOP count as perf/mfu_training)

    record = machine_record()
    print(machine_line(record))
    model_dir = resolve_pretrain("embedded:smollm2-135m-instruct")
    paths = args.paths.split(",")
    built = {p: build(p, model_dir) for p in paths}
    vocab = built[paths[0]][0].model.config.vocab_size
    mbs = batches(vocab, prompts_per_micro=args.prompts_per_micro, response_len=args.response_len)
    params = sum(p.numel() for p in built[paths[0]][0].model.parameters())
    packed_tokens = PROMPTS * (PROMPT_LEN + SAMPLES * args.response_len)
    flops = 6 * params * packed_tokens  # forward + backward over the packed tokens (an upper bound: the head runs on
    # the kept positions only)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for p in paths:  # warm-up
        step(*built[p], mbs)
    for _ in range(args.steps):
        for p in paths:  # alternating
            began = time.perf_counter()
            step(*built[p], mbs)
            times[p].append(time.perf_counter() - began)
    rows = []
    for p in paths:
        ceiling = record["bf16_gflops"] if built[p][1] == torch.bfloat16 else record["fp32_gflops"]
        med = statistics.median(times[p])
        rows.append({"path": p, "median_s": round(med, 3), "gflops": round(flops / med / 1e9, 1),
                     "of_ceiling": round(flops / med / 1e9 / ceiling, 3), "times": [round(t, 3) for t in times[p]]})
        print(f"{p:12s} median {med:.3f} s  {flops / med / 1e9:7.1f} GFLOP/s  {rows[-1]['of_ceiling']:.1%} of "
              f"its ceiling ({ceiling:.0f})  steps {rows[-1]['times']}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for p in paths:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(*built[p], mbs)
            print(f"\n== {p}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step.json").write_text(json.dumps({"machine": record, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
