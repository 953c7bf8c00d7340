"""Calibrate the weight-sync check (`rlhfkit.rl.sync_check`): engine-vs-trainer log-prob noise per precision and
probe, against the size of the faults the check exists for. One process: a real vLLM engine and the trainer's
forward (transformers, weights in the compute dtype, as FSDP2's mixed precision computes).

    python benchmarks/sync_check_noise.py --model embedded:smollm2-135m-instruct --dtype bf16

Faults are injected into the *engine* through the real in-place weight update (`rlhfkit.rollout.worker_ext`):
- flip:  one matrix loaded with its rows reversed (model.layers.1.self_attn.o_proj), every name reported loaded;
- stale: one decoder layer's weights left at the previous step's values (a parameter the sync missed);
- lm_head: a tied lm_head left at the previous step's values (the bug `_reprocess_tied_modules` fixed).
A "previous step" is the weights minus one simulated Adam update of size `--update` per element (sign noise).
Prints, per probe kind: the clean noise (start, and after a sync of updated weights) and each fault's statistic.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--update", type=float, default=1e-3, help="per-element size of the simulated update")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a tiny random-init model (the tests' fixture) instead")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.data.synthetic import arithmetic_rows
    from rlhfkit.models.loading import resolve_pretrain
    from rlhfkit.rollout.vllm_engine import VLLMEngine

    if args.tiny:
        import tempfile

        from rlhfkit.models.tiny import build_tiny_causal_lm

        args.model = "tiny (2 layers, hidden 64)"
        path = build_tiny_causal_lm(tempfile.mkdtemp())
    else:
        path = resolve_pretrain(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    base = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    engine = VLLMEngine(path, dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
                        kv_cache_memory_bytes=512 << 20, max_model_len=512)
    rows = arithmetic_rows(args.prompts + 1, seed=1, system="You are a helpful assistant.")
    prompts = []
    for r in rows:
        ids = tok.apply_chat_template(r["input"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

    def hf_log_probs(weights: dict[str, torch.Tensor], prompt: list[int], response: list[int],
                     head: torch.Tensor | None = None) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        model.load_state_dict(weights, strict=False)
        if head is not None:  # an lm_head apart from the (tied) embedding
            model.lm_head.weight = torch.nn.Parameter(head.clone())
        model.to(dtype).eval()
        seq = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[:, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1)[0].gather(-1, seq[0, len(prompt):, None])[:, 0].tolist()

    def push(weights: dict[str, torch.Tensor]) -> None:
        engine.begin_weight_update()
        engine.load_weight_bucket([(n, t.to(dtype)) for n, t in weights.items()])
        engine.finish_weight_update()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    updated = {n: t + args.update * torch.randn(t.shape, generator=gen).sign() for n, t in start.items()}
    updated2 = {n: t + args.update * torch.randn(t.shape, generator=gen).sign() for n, t in updated.items()}
    probes: dict[str, list[tuple[list[int], list[int]]]] = {"other prompt": [
        (p, prompts[i + 1][-16:]) for i, p in enumerate(prompts[:-1])]}
    for kind, temperature in (("greedy", 0.0), ("sampled T=1", 1.0)):
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:-1]],
                                   SamplingParams(max_tokens=16, temperature=temperature, seed=3), use_tqdm=False)
        probes[kind] = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts[:-1], outs)]

    layer = "model.layers.1."
    flip = layer + "self_attn.o_proj.weight"
    cases = {  # name: (engine weights, trainer weights, engine scored by HF with the old head instead of vLLM)
        "clean start": (start, start, False),
        "clean after sync": (updated, updated, False),
        "clean after 2nd sync": (updated2, updated2, False),
        "flip o_proj rows": ({n: (t.flip(0) if n == flip else t) for n, t in updated.items()}, updated, False),
        "stale layer 1": ({n: (start[n] if n.startswith(layer) else t) for n, t in updated.items()}, updated, False),
        "stale tied lm_head (HF)": (updated, updated, True),
    }
    for case, (engine_w, trainer_w, old_head) in cases.items():
        push(engine_w)
        for kind, pairs in probes.items():
            diffs = []
            for prompt, response in pairs:
                trainer = hf_log_probs(trainer_w, prompt, response)
                scored = (hf_log_probs(engine_w, prompt, response, head=start["model.embed_tokens.weight"])
                          if old_head else engine.score([prompt], [response])[0])
                diffs += [abs(a - b) for a, b in zip(scored, trainer)]
            d = torch.tensor(diffs)
            print(json.dumps({"case": case, "probe": kind, "mean": round(d.mean().item(), 5),
                              "median": round(d.median().item(), 5), "max": round(d.max().item(), 5)}), flush=True)
    print(f"model {args.model} dtype {args.dtype} update {args.update} at {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
