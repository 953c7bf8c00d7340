"""The trainers on a real GPU (issue #32): one prepared check for a lent GPU machine (torch + transformers there; no
Ray, no vLLM, nothing downloadable), run by `benchmarks/gpu_check.sh`.

    python benchmarks/gpu_check.py prepare .gpucheck        # here, on the CPU machine: tokenizer files + data
    python benchmarks/gpu_check.py run .gpucheck OUT [--only sft,dpo] [--steps 8]   # there, on the GPU

`run` builds random-init models from configs (no weights travel): the tiny test model and a 0.8B Llama-shaped one
(hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, MLP 5632, SmolLM2's 49,152-token vocabulary, tied embeddings),
then runs `rlhfkit sft`, `rm` and `dpo` at `--param_dtype auto` through `torchrun --nproc_per_node 1` on both, and
TRL's SFT and DPO trainers on the 0.8B model at the same shapes in bf16 (fp32 weights + bf16 autocast, as rlhfkit's
fp32 masters + bf16 compute), each in its own process, one after the other. It prints one table (median step time
after 2 warm-up steps, tokens/s, MFU against the card's dense bf16 peak, peak GPU memory) plus each command's
pass/fail, writes it to OUT/gpu_check.md and OUT/gpu_check.json, and runs tests/engine/test_gpu.py.

Tokens/s and MFU are computed the same way for both sides: the non-pad tokens of the step's rows (counted with the
tokenizer's chat template) and the usual 6N FLOPs per trained token (`rlhfkit.observability.mfu.FlopModel`; DPO's
reference forward is not counted on either side: both score the reference once, before training).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # rlhfkit from the carried tree

BATCH, MICRO, MAX_LEN, LR, WARMUP = 32, 8, 512, 1e-5, 2
# Dense bf16 tensor-core peak per card (NVIDIA's data sheets, without sparsity); MFU is against this figure
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
WORDS = ("apple river stone cloud green seven window garden silver music paper orange quiet yellow tiger mountain "
         "ocean bright candle forest winter summer copper violet rabbit thunder marble lemon shadow harbor").split()


# ---------------------------------------------------------------------------------------------------------- prepare
def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prepare(folder: Path) -> None:
    """SmolLM2's tokenizer as files, and the data: SFT rows of ~480 tokens, preference pairs of ~2 x 300."""
    from rlhfkit.models.tiny import tiny_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(str(folder / "tok"))
    rng = random.Random(0)
    rows = 20 * BATCH  # enough for --steps up to 20
    sft = [{"input": "Continue the list: " + _sentence(rng, 60), "output": _sentence(rng, 380)} for _ in range(rows)]
    pref = [{"prompt": "Name things you see: " + _sentence(rng, 60), "chosen": _sentence(rng, 200),
             "rejected": _sentence(rng, 200)} for _ in range(rows)]
    for name, data in (("sft.jsonl", sft), ("pref.jsonl", pref)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in data))
    longest = max(_tokens_sft(tokenizer, r) for r in sft[:64])
    print(f"prepared {folder}: tokenizer, {rows} SFT rows (longest of the first 64: {longest} tokens), {rows} pairs")


# -------------------------------------------------------------------------------------------------------------- run
def _chat_tokens(tokenizer: Any, prompt: str, response: str) -> int:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": response}], tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def _tokens_sft(tokenizer: Any, row: dict) -> int:
    return _chat_tokens(tokenizer, row["input"], row["output"])


def _tokens_pair(tokenizer: Any, row: dict) -> int:
    return sum(_chat_tokens(tokenizer, row["prompt"], row[side]) for side in ("chosen", "rejected"))


def build_models(folder: Path, work: Path) -> dict[str, str]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhfkit.models.tiny import build_tiny_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tok"), local_files_only=True)
    tiny = build_tiny_causal_lm(str(work / "tiny"), tokenizer=tokenizer)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(work / "llama-0.8b"))  # bf16 on disk, as HF checkpoints are
    tokenizer.save_pretrained(str(work / "llama-0.8b"))
    del model
    torch.cuda.empty_cache()
    return {"tiny": tiny, "llama-0.8b": str(work / "llama-0.8b")}


def rlhfkit_argv(command: str, model: str, folder: Path, out: Path, steps: int) -> list[str]:
    common = ["--pretrain", model, "--apply_chat_template", "--max_len", str(MAX_LEN), "--train_batch_size",
              str(BATCH), "--micro_train_batch_size", str(MICRO), "--max_epochs", "1", "--max_samples",
              str(steps * BATCH), "--learning_rate", str(LR), "--lr_warmup_ratio", "0", "--lr_scheduler", "constant",
              "--param_dtype", "auto", "--run_dir", str(out / "run"), "--save_path", str(out / "hf")]
    if command == "sft":
        return [command, *common, "--dataset", str(folder / "sft.jsonl"), "--input_key", "input", "--output_key",
                "output"]
    pref = ["--dataset", str(folder / "pref.jsonl"), "--prompt_key", "prompt", "--chosen_key", "chosen",
            "--rejected_key", "rejected"]
    return [command, *common, *pref, *(["--beta", "0.1"] if command == "dpo" else [])]


def run_rlhfkit(command: str, model: str, folder: Path, work: Path, steps: int) -> dict[str, Any]:
    out = work / f"rlhfkit-{command}-{Path(model).name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "rlhfkit",
           *rlhfkit_argv(command, model, folder, out, steps)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    result: dict[str, Any] = {"wall_s": time.perf_counter() - began, "ok": done.returncode == 0}
    if done.returncode != 0:  # the child's own traceback comes before torchrun's summary
        err = done.stderr or done.stdout
        child = err.split("ChildFailedError")[0]
        result["error"] = child[-3000:] if child.strip() else err[-3000:]
        return result
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "train/step_seconds" in r]
    seconds = [r["train/step_seconds"] for r in steps_rows]
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    result.update(step_seconds=seconds, step_median=statistics.median(seconds[WARMUP:] or seconds),
                  own_tokens_per_s=statistics.median([r["train/tokens_per_s"] for r in steps_rows][WARMUP:] or [0]),
                  peak_gpu_mb=max((r.get("train/peak_memory_mb", 0.0) for r in steps_rows), default=None),
                  losses=[r["train/loss"] for r in steps_rows], precision=manifest.get("precision"))
    return result


def run_trl(kind: str, model: str, folder: Path, work: Path, steps: int) -> dict[str, Any]:
    spec = {"kind": kind, "model": model, "data": str(folder / ("sft.jsonl" if kind == "sft" else "pref.jsonl")),
            "lr": LR, "steps": steps, "seed": 0, "precision": "bf16", "micro": MICRO, "batch": BATCH,
            "max_len": MAX_LEN, "beta": 0.1, "warmup": WARMUP, "work": str(work / f"trl-{kind}"), "device": "cuda"}
    Path(spec["work"]).mkdir(parents=True, exist_ok=True)
    spec_file, result_file = Path(spec["work"]) / "spec.json", Path(spec["work"]) / "result.json"
    spec_file.write_text(json.dumps(spec))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers_trl.py"), str(spec_file),
                           str(result_file)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    result = json.loads(result_file.read_text()) if result_file.exists() else {"error": done.stderr[-2500:]}
    result["wall_s"] = time.perf_counter() - began
    result["ok"] = result.get("error") is None and done.returncode == 0
    return result


def card_peak() -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name()
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def table(results: list[dict[str, Any]], card: str) -> str:
    lines = [f"GPU check on {card} ({time.strftime('%Y-%m-%d')}); batch {BATCH} rows (micro {MICRO}), max_len "
             f"{MAX_LEN}, median step after {WARMUP} warm-up steps; MFU against the card's dense bf16 peak", "",
             "| framework | command | model | precision | ok | step s | tokens/s | MFU | peak GPU MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        step = r.get("step_median")
        cells = [r["framework"], r["command"], r["model"], r.get("dtype", ""), "pass" if r["ok"] else "FAIL",
                 f"{step:.3f}" if step else "", f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "",
                 f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "",
                 f"{r['peak_gpu_mb']:,.0f}" if r.get("peak_gpu_mb") else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(folder: Path, out: Path, only: set[str] | None, steps: int) -> int:
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from rlhfkit.observability.mfu import FlopModel

    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu_check")
    work.mkdir(parents=True, exist_ok=True)
    card, peak = card_peak()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, {card}",
          flush=True)
    models = build_models(folder, work)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tok"), local_files_only=True)
    sft_rows = [json.loads(x) for x in (folder / "sft.jsonl").read_text().splitlines()][:BATCH * steps]
    pref_rows = [json.loads(x) for x in (folder / "pref.jsonl").read_text().splitlines()][:BATCH * steps]
    tokens_per_row = {"sft": statistics.mean(_tokens_sft(tokenizer, r) for r in sft_rows[:BATCH]),
                      "pairs": statistics.mean(_tokens_pair(tokenizer, r) for r in pref_rows[:BATCH])}
    results: list[dict[str, Any]] = []

    def record(framework: str, command: str, model_name: str, result: dict[str, Any]) -> None:
        config = AutoConfig.from_pretrained(models[model_name])
        with torch.device("meta"):
            params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        tokens = tokens_per_row["sft" if command == "sft" else "pairs"] * BATCH
        step = result.get("step_median")
        row = {"framework": framework, "command": command, "model": model_name, **result}
        if step:
            row["tokens_per_s"] = tokens / step
            flops = FlopModel.from_config(config, params).training(tokens, tokens)
            row["mfu"] = flops / step / (peak * 1e12) if peak else None
        precision = result.get("precision") or {}
        row["dtype"] = precision.get("dtype", "") if framework == "rlhfkit" else "bf16 (autocast, fp32 weights)"
        results.append(row)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"{framework:8s} {command:4s} {model_name:11s} ok={row['ok']} step={step} "
              f"tokens/s={row.get('tokens_per_s')} mfu={row.get('mfu')} peak_mb={row.get('peak_gpu_mb')}",
              flush=True)
        if not row["ok"]:
            print(row.get("error", ""), flush=True)

    for model_name in ("tiny", "llama-0.8b"):
        for command in ("sft", "rm", "dpo"):
            if only and command not in only:
                continue
            try:
                record("rlhfkit", command, model_name, run_rlhfkit(command, models[model_name], folder, work, steps))
            except Exception:
                record("rlhfkit", command, model_name, {"ok": False, "error": traceback.format_exc(limit=4)})
    for command in ("sft", "dpo"):
        if only and f"trl-{command}" not in only:
            continue
        try:
            record("TRL", command, "llama-0.8b", run_trl(command, models["llama-0.8b"], folder, work, steps))
        except Exception:
            record("TRL", command, "llama-0.8b", {"ok": False, "error": traceback.format_exc(limit=4)})
    text = table(results, card)
    (out / "gpu_check.md").write_text(text + "\n")
    print(text, flush=True)
    return 0 if all(r["ok"] for r in results) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("prepare", "run"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path, nargs="?", default=Path("gpu_check_out"))
    parser.add_argument("--only", default="", help="comma-separated: sft, rm, dpo (rlhfkit), trl-sft, trl-dpo")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.mode == "prepare":
        prepare(args.folder)
        return
    sys.exit(run(args.folder, args.out, set(args.only.split(",")) - {""} or None, args.steps))


if __name__ == "__main__":
    main()
