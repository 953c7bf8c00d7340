"""GRPO on images through `rlhfkit ppo`: a vision-language policy learns to answer in the colour of the shape shown.

Run:  python examples/vlm/ppo_colours.py [--pretrain DIR] [--prompts 96] [--out runs/vlm-colours] [-- more ppo flags]
(docs/multimodal.md has the numbers measured on a 2-core CPU)

It draws `--prompts` coloured shapes (a red, green or blue circle or square on a white 64x64 canvas, random place and
size), writes them beside a prompt file (half as PNG files named by relative path, half inline as base64 strings),
and runs `rlhfkit ppo --image_key image` with the verifier examples/vlm/colours_reward.py: GRPO (group_norm), 4
answers per image, the vision tower frozen and left out of the weight sync. Without --pretrain it builds the tiny
random Idefics3 (rlhfkit/models/tiny_vlm.py); with a SmolVLM folder the same command trains a real model.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}


def draw_shape(rng: random.Random) -> tuple[Any, str]:
    """A white 64x64 canvas with one coloured circle or square (a PIL image) and the colour's name."""
    from PIL import Image, ImageDraw

    name = rng.choice(list(COLOURS))
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    size = rng.randint(20, 44)
    x, y = rng.randint(0, 64 - size), rng.randint(0, 64 - size)
    pen = ImageDraw.Draw(image)
    (pen.ellipse if rng.random() < 0.5 else pen.rectangle)([x, y, x + size, y + size], fill=COLOURS[name])
    return image, name


def draw(rng: random.Random) -> tuple[bytes, str]:
    """`draw_shape` as PNG bytes, and the colour's name."""
    image, name = draw_shape(rng)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), name


def write_data(folder: Path, count: int, seed: int) -> Path:
    """`count` rows {"prompt", "image", "label"}; even rows name a PNG file, odd rows hold the image as base64."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        png, name = draw(rng)
        if i % 2 == 0:
            (folder / "images" / f"{i}.png").write_bytes(png)
            image = f"images/{i}.png"
        else:
            image = base64.b64encode(png).decode()
        rows.append({"prompt": "What colour is the shape?", "image": image, "label": name})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the rest for `rlhfkit ppo`: everything it does not know, and everything after `--`
    (argparse keeps that `--` among the rest; it is dropped here, `rlhfkit ppo` would refuse it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain", default=None, help="a vision-language HF folder (default: the tiny one)")
    parser.add_argument("--prompts", type=int, default=96, help="images (8 per step: 12 steps by default)")
    parser.add_argument("--out", default="runs/vlm-colours")
    parser.add_argument("--seed", type=int, default=0)
    args, extra = parser.parse_known_args(argv)
    if "--" in extra:
        cut = extra.index("--")
        extra = extra[:cut] + extra[cut + 1:]
    return args, extra


def main() -> None:
    args, extra = parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pretrain = args.pretrain
    if pretrain is None:
        from rlhfkit.models.tiny_vlm import build_tiny_vlm

        pretrain = build_tiny_vlm(str(out / "tiny_vlm"), seed=args.seed)
    data = write_data(out / "data", args.prompts, args.seed)
    flags = ["--pretrain", pretrain, "--prompt_data", str(data), "--input_key", "prompt", "--label_key", "label",
             "--image_key", "image", "--max_images_per_prompt", "1", "--freeze_vision_tower",
             "--apply_chat_template", "--remote_rm_url", str(HERE / "colours_reward.py"),
             "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
             "--train_batch_size", "32", "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16",
             "--generate_max_len", "8", "--prompt_max_len", "128", "--actor_learning_rate", "3e-3",
             "--lr_warmup_ratio", "0", "--init_kl_coef", "0", "--num_episodes", "1", "--param_dtype", "fp32",
             "--vllm_kv_cache_mb", "64", "--seed", str(args.seed), "--run_dir", str(out / "run"),
             "--save_path", str(out / "model"), "--ckpt_path", str(out / "ckpt"), *extra]
    print("rlhfkit ppo " + " ".join(flags), flush=True)
    subprocess.run([sys.executable, "-m", "rlhfkit", "ppo", *flags], check=True, env={**os.environ})
    summarise(out / "run" / "metrics.jsonl")


def summarise(metrics: Path) -> None:
    """Time per step and mean reward of the first and last three steps, from the run's metrics.jsonl."""
    import statistics

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    rewards = [round(r["rollout/reward_mean"], 3) for r in steps]
    times = [r["time/step"] for r in steps if "time/step" in r]
    print(f"steps {len(steps)}; time per step median {statistics.median(times):.1f} s (range {min(times):.1f}-"
          f"{max(times):.1f}); reward first 3 {rewards[:3]}, last 3 {rewards[-3:]}; "
          f"max |engine - trainer| log-prob {max(r.get('rollout/logprob_abs_diff_max', 0.0) for r in steps):.2g}")


if __name__ == "__main__":
    main()
