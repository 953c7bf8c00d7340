"""Vision-language RL building blocks on a tiny random Idefics3 (rlhfkit/models/tiny_vlm.py).

Reference for log-probs: transformers' fp32 forward with the processor's pixel tensors, log softmax in float64."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from rlhfkit.data.images import row_images
from rlhfkit.errors import ConfigError
from rlhfkit.models.tiny_vlm import IMAGE_SEQ_LEN
from rlhfkit.models.vision import (
    freeze_vision_tower,
    image_placeholder,
    is_vision_tower_param,
    load_processor,
    load_vlm,
    vision_prompt,
    vlm_response_log_probs,
    without_vision_tower,
)
from rlhfkit.rollout.types import SamplingConfig


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_image_rows_decode_paths_base64_and_data_urls_and_bad_rows_name_the_row(tmp_path):
    (tmp_path / "red.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    b64 = base64.b64encode(png((0, 255, 0))).decode()
    row = {"images": ["red.png", b64, f"data:image/png;base64,{b64}"]}
    images = row_images(row, 0, "images", max_images=3, base_dir=str(tmp_path))
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 255, 0), (0, 255, 0)]
    assert row_images({"prompt": "no image"}, 1, "images", max_images=1) == []
    with pytest.raises(ConfigError, match=r"row 7, 'images'\[0\]: cannot read the image \(file .*broken.png\)"):
        row_images({"images": "broken.png"}, 7, "images", max_images=1, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"row 3, 'images'\[1\]: image file .*missing.png does not exist"):
        row_images({"images": ["red.png", "missing.png"]}, 3, "images", max_images=2, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"row 5: 3 images under 'images' but --max_images_per_prompt is 2"):
        row_images(row, 5, "images", max_images=2, base_dir=str(tmp_path))


def chat_text(processor, question: str, n_images: int = 1) -> str:
    content = image_placeholder(processor) * n_images + question
    return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)


def train_one_step(model, prompt, response: list[int]) -> None:
    """One SGD step on -sum log p(response | prompt with its image)."""
    model.train()
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = -vlm_response_log_probs(model, prompt.input_ids, response, prompt.pixel).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    model.eval()


def test_frozen_vision_tower_does_not_train_and_is_not_sent(tiny_vlm_dir):
    from PIL import Image

    model, processor = load_vlm(tiny_vlm_dir), load_processor(tiny_vlm_dir)
    names = [n for n, _ in model.named_parameters()]
    vision = [n for n in names if is_vision_tower_param(n)]
    assert vision and all(n.startswith("model.vision_model.") for n in vision)
    assert not any(is_vision_tower_param(n) for n in names if "connector" in n or "text_model" in n)
    assert freeze_vision_tower(model) == len(vision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompt = vision_prompt(processor, chat_text(processor, "Colour?"), [Image.new("RGB", (40, 30), (255, 0, 0))])
    assert prompt.input_ids.count(model.config.image_token_id) == IMAGE_SEQ_LEN
    train_one_step(model, prompt, processor.tokenizer(" red")["input_ids"])
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in vision)
    assert any(not torch.equal(before[n], after[n]) for n in names if "connector" in n)
    sent = [n for n, _ in without_vision_tower(model.named_parameters())]
    assert sent and not any(is_vision_tower_param(n) for n in sent) and len(sent) == len(names) - len(vision)


@pytest.mark.slow  # the session's VLM engine (~60 s to start on a loaded 2-core machine, shared with test_ppo_vision)
def test_engine_log_probs_equal_the_trainers_with_images_before_and_after_a_sync(ray_cluster, tiny_vlm_dir,
                                                                                vlm_engine):
    """vLLM expands the image placeholders to the processor's ids and samples with log-probs the trainer's forward
    (pixel_values + expanded ids) reproduces within 1e-4, before and after a sync that leaves the vision tower out."""
    from PIL import Image

    from rlhfkit.rollout.weight_sync import sync_weights

    model, processor = load_vlm(tiny_vlm_dir), load_processor(tiny_vlm_dir)
    images = [Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (24, 32), (0, 0, 255))]
    prompts = [vision_prompt(processor, chat_text(processor, f"Colour {i}?"), [im]) for i, im in enumerate(images)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, n=1, seed=3)
    engine = vlm_engine

    def check() -> list[float]:
        samples = ray_cluster.get(engine.generate.remote([p.prompt_ids for p in prompts], sampling,
                                                         [p.images for p in prompts]))
        worst = 0.0
        for sample, prompt in zip(samples, prompts):
            assert sample.prompt_ids == prompt.input_ids  # vLLM's expansion is the processor's
            with torch.no_grad():
                want = vlm_response_log_probs(model, prompt.input_ids, sample.response_ids, prompt.pixel).double()
            worst = max(worst, (torch.tensor(sample.response_logprobs, dtype=torch.float64) - want).abs().max().item())
        assert worst < 1e-4, worst
        return [lp for s in samples for lp in s.response_logprobs]

    loaded = check()
    freeze_vision_tower(model)
    train_one_step(model, prompts[0], processor.tokenizer(" red red")["input_ids"])
    stats = sync_weights([engine], without_vision_tower(model.named_parameters()), keep_vision_tower=True)
    assert stats.tensors == sum(1 for n, _ in model.named_parameters() if not is_vision_tower_param(n))
    synced = check()
    assert synced != loaded  # the sync changed the engine (responses or their log-probs moved)
