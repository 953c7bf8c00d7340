"""Online RL step time on the embedded SmolLM2-135M-Instruct: rlhfkit's per-stage table, rollout tokens/s through
rlhfkit beside raw `vllm.LLM.generate` on the same prompts, weight-sync seconds, and (when `trl` is installed)
TRL's GRPOTrainer on the same configuration, all in one run.

    .venv/bin/python benchmarks/rl_step.py [--steps 3] [--skip_trl]
    (TRL row: .venv/bin/pip install trl 'torch==2.13.0' first; it is a benchmark-only dependency)

Configuration (the demo's): 8 prompts x 8 samples, 24 new tokens, GRPO, trainer and engine at the precision
`auto` picks on this machine (bf16 with native bf16, else fp32); raw vLLM and TRL run at the same precision.
Prints a table and writes benchmarks/results/rl_step.json. Target: rollout overhead vs raw vLLM at most 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from machine import machine_line, machine_record

RESULTS = Path(__file__).parent / "results"
PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 24
STAGES = ("generation", "reward", "log_probs", "training", "weight_sync", "step")


def rlhfkit_steps(steps: int, run_dir: Path) -> list[dict]:
    from rlhfkit.cli.demo import build_parser, demo_argv
    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.ppo_trainer import train_ppo

    args = build_parser().parse_args(["--steps", str(steps), "--eval_prompts", "8"])
    argv = [a for a in demo_argv(args, run_dir) if a]
    cut = argv.index("--eval_dataset")
    argv = argv[:cut] + argv[cut + 2:]  # no eval: time the training steps only
    train_ppo(parse_config("ppo", None, argv))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def raw_vllm_tokens_per_s(path: str, prompt_ids: list[list[int]], repeats: int, dtype: str) -> float:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, dtype=dtype, max_model_len=256, enforce_eager=True, enable_chunked_prefill=False,
              kv_cache_memory_bytes=1 << 30, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, n=1, logprobs=0)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids for _ in range(SAMPLES)]
    llm.generate(requests[:8], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        began = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(tokens / (time.perf_counter() - began))
    return statistics.mean(rates)


def trl_step_seconds(path: str, prompts: list[str], steps: int, bf16: bool) -> float | None:
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    import datasets

    def reward(completions, **_):
        return [float(any(ch.isdigit() for ch in str(c))) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                            max_completion_length=NEW_TOKENS, max_steps=steps, logging_steps=1, report_to=[],
                            learning_rate=3e-6, use_cpu=True, save_strategy="no", bf16=bf16)
        data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts * steps]})
        trainer = GRPOTrainer(model=path, reward_funcs=reward, args=config, train_dataset=data)
        began = time.perf_counter()
        trainer.train()
        return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip_trl", action="store_true")
    args = parser.parse_args()
    from rlhfkit.data.synthetic import arithmetic_rows
    from rlhfkit.models.loading import load_tokenizer, resolve_pretrain

    path = resolve_pretrain("embedded:smollm2-135m-instruct")
    machine = machine_record()
    print(machine_line(machine))
    with tempfile.TemporaryDirectory() as tmp:
        rows = rlhfkit_steps(args.steps, Path(tmp) / "run")
    train_rows = [r for r in rows if "time/step" in r]
    measured = train_rows[1:] or train_rows  # step 1 includes engine warm-up
    stage = {s: statistics.mean(r[f"time/{s}"] for r in measured) for s in STAGES}
    tokens = statistics.mean(r["rollout/response_length_mean"] * PROMPTS * SAMPLES for r in measured)
    ours = tokens / stage["generation"]
    tokenizer = load_tokenizer(path)
    questions = [r["input"] for r in arithmetic_rows(PROMPTS, seed=1)]
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for q in questions]
    raw = raw_vllm_tokens_per_s(path, prompt_ids, repeats=3,
                                dtype="bfloat16" if machine["precision"] == "bf16" else "float32")
    trl = None if args.skip_trl else trl_step_seconds(path, questions, steps=2, bf16=machine["precision"] == "bf16")
    result = {"machine": machine, "model": "embedded:smollm2-135m-instruct", "prompts": PROMPTS, "samples": SAMPLES,
              "new_tokens": NEW_TOKENS, "steps_measured": len(measured), "stage_seconds": stage,
              "rollout_tokens_per_s_rlhfkit": ours, "rollout_tokens_per_s_raw_vllm": raw,
              "rollout_overhead": 1 - ours / raw, "weight_sync_seconds": stage["weight_sync"],
              "trl_grpo_step_seconds": trl, "trl_over_rlhfkit": trl / stage["step"] if trl else None}
    print("\nstage            seconds/step")
    for name, secs in stage.items():
        print(f"{name:<16} {secs:>10.2f}")
    print(f"\nrollout tokens/s: rlhfkit {ours:.0f}, raw vLLM {raw:.0f} (overhead {result['rollout_overhead']:.1%})")
    if trl:
        print(f"TRL GRPOTrainer: {trl:.1f} s/step = {trl / stage['step']:.2f} x rlhfkit")
    else:
        print("TRL GRPOTrainer: not measured (pip install trl, or --skip_trl given)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rl_step.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
