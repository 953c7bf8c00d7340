"""GRPO on images: a vision-language policy learns to answer in the colour of the shape it is shown.

Run:  python examples/vlm/grpo_colours.py --steps 12 [--pretrain DIR]   (docs/multimodal.md has the measured numbers)

Each step draws `--prompts` coloured shapes (circle or square, red / green / blue, random place and size) with PIL,
asks "<image>What colour is the shape?", samples `--n` answers per image with vLLM (images as multi_modal_data,
token ids in and out), scores them with a verifier, and takes one GRPO step with the trainer (transformers forward
with the processor's pixel tensors); the vision tower is frozen and left out of the weight sync.

Verifier (what a tiny random model can learn): a random-init model cannot spell colour names, so the reward is the
fraction of answer tokens whose id lies in the colour's class, `id % 3 == colour index` (red 0, green 1, blue 2). A
policy that ignores the image scores 1/3 on average; only one that reads the image can do better. With a trained
model (`--pretrain` a SmolVLM folder) use `--verifier word` (1 if the answer names the colour).

GRPO loss (one on-policy update per rollout, so the ratio is 1 and the clipped objective reduces to):
    L = -(1 / sum_i |y_i|) * sum_i sum_t A_i * log pi(y_i,t | x_i, image_i, y_i,<t),
    A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-6)   (rlhfkit.algorithms.advantages.group_normalize).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from ppo_colours import COLOURS, draw_shape  # the same drawings (examples/vlm/ppo_colours.py)


def draw(rng: random.Random) -> tuple[object, int]:
    """One coloured shape (`draw_shape`) and its colour index (red 0, green 1, blue 2)."""
    image, name = draw_shape(rng)
    return image, list(COLOURS).index(name)


def reward(response_ids: list[int], text: str, colour: int, verifier: str) -> float:
    """The verifier: `ids` -> share of tokens with id % 3 == colour; `word` -> 1.0 if the colour's name is said."""
    if verifier == "word":
        return float(list(COLOURS)[colour] in text.lower())
    return sum(1 for t in response_ids if t % 3 == colour) / max(len(response_ids), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain", default=None, help="a vision-language HF folder (default: build the tiny one)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--verifier", choices=["ids", "word"], default="ids")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from rlhfkit.algorithms.advantages import group_normalize
    from rlhfkit.models.vision import (
        freeze_vision_tower,
        image_placeholder,
        load_processor,
        load_vlm,
        vision_prompt,
        vlm_response_log_probs,
        without_vision_tower,
    )
    from rlhfkit.rollout.types import SamplingConfig
    from rlhfkit.rollout.vllm_engine import VLLMEngine

    torch.manual_seed(args.seed)
    path = args.pretrain
    if path is None:
        from rlhfkit.models.tiny_vlm import build_tiny_vlm

        path = build_tiny_vlm(tempfile.mkdtemp(prefix="tiny-vlm-"))
    model, processor = load_vlm(path), load_processor(path)
    freeze_vision_tower(model)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    start = time.perf_counter()
    engine = VLLMEngine(path, kv_cache_memory_bytes=64 * 2**20, max_model_len=512, dtype="float32", seed=args.seed)
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    question = image_placeholder(processor) + "What colour is the shape?"
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                   add_generation_prompt=True)
    rng = random.Random(args.seed)
    for step in range(args.steps):
        t0 = time.perf_counter()
        drawn = [draw(rng) for _ in range(args.prompts)]
        prompts = [vision_prompt(processor, text, [image]) for image, _ in drawn]
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n, seed=step * 1000)
        samples = engine.generate([p.prompt_ids for p in prompts], sampling, [p.images for p in prompts])
        t_gen = time.perf_counter() - t0
        rewards = torch.tensor([reward(s.response_ids, processor.tokenizer.decode(s.response_ids),
                                       drawn[s.prompt_index][1], args.verifier) for s in samples])
        advantages = group_normalize(rewards, args.n)
        model.train()
        tokens = sum(len(s.response_ids) for s in samples)
        worst_gap = 0.0
        for sample, adv in zip(samples, advantages):
            prompt = prompts[sample.prompt_index]
            log_probs = vlm_response_log_probs(model, prompt.input_ids, sample.response_ids, prompt.pixel)
            gap = (log_probs.detach() - torch.tensor(sample.response_logprobs)).abs().max().item()
            worst_gap = max(worst_gap, gap)
            (-(adv * log_probs).sum() / tokens).backward()
        optim.step()
        optim.zero_grad()
        model.eval()
        t_sync = time.perf_counter()
        engine.begin_weight_update(keep_vision_tower=True)
        engine.load_weight_bucket(list(without_vision_tower((n, p.detach()) for n, p in model.named_parameters())))
        engine.finish_weight_update()
        now = time.perf_counter()
        print(f"step {step + 1}: reward {rewards.mean():.3f}  time {now - t0:.2f} s (generate {t_gen:.2f}, "
              f"sync {now - t_sync:.2f})  max |engine - trainer| log-prob {worst_gap:.1e}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
