"""Images in `rlhfkit ppo` without Ray or engines: the prompt data (--image_key), the set-up refusals, and the pixel
tensors per experience row (rlhfkit/rl/vision_batch.py) against transformers' forward of each row alone."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError

HERE = Path(__file__).parent


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def ppo_cfg(model: str, data: str, **flags):
    base = {"pretrain": model, "prompt_data": data, "input_key": "prompt", "image_key": "image",
            "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
            "advantage_estimator": "group_norm", "n_samples_per_prompt": 2, "prompt_max_len": 128}
    return parse_config("ppo", None, flags_to_argv({**base, **flags}))


def write_rows(folder: Path, rows: list[dict]) -> str:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_image_prompts_load_and_a_bad_row_is_an_error_naming_the_file_row_and_key(tiny_vlm_dir, tmp_path):
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.rl.setup import load_prompts
    from rlhfkit.rl.vision_batch import VisionInputs

    (tmp_path / "red.png").write_bytes(png((255, 0, 0)))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    b64 = base64.b64encode(png((0, 0, 255))).decode()
    good = [{"prompt": "Colour?", "image": "red.png"}, {"prompt": "Colour?", "image": b64},
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Shape?"}]}],
             "image": [b64]}, {"prompt": "No picture"}]
    vision, tokenizer = VisionInputs.load(tiny_vlm_dir), load_tokenizer(tiny_vlm_dir)
    data = write_rows(tmp_path, good)
    cfg = ppo_cfg(tiny_vlm_dir, data, image_key="image", max_images_per_prompt=1)
    prompts = load_prompts(cfg, tokenizer, data, "train")
    assert [len(p["images"]) for p in prompts] == [1, 1, 1, 0]
    assert [p["images"][0].getpixel((0, 0)) for p in prompts[:3]] == [(255, 0, 0), (0, 0, 255), (0, 0, 255)]
    assert [p["prompt"].count("<image>") for p in prompts] == [1, 1, 1, 0]
    assert [p["prompt_ids"].count(vision.image_token_id) for p in prompts] == [1, 1, 1, 0]  # unexpanded
    assert "<image>Shape?" in prompts[2]["prompt"]
    for rows, message in [
        (good[:2] + [{"prompt": "Colour?", "image": "broken.png"}], r"prompts.jsonl: row 2, 'image'\[0\]: cannot read"),
        ([{"prompt": "Colour?", "image": "gone.png"}], r"prompts.jsonl: row 0, 'image'\[0\]: image file .* not exist"),
        ([{"prompt": "Colour?", "image": "@@not base64@@"}], r"prompts.jsonl: row 0, 'image'\[0\]: not a readable"),
        (good[:1] + [{"prompt": "Colour?", "image": ["red.png", b64]}], r"row 1: 2 images under 'image' but "
                                                                           r"--max_images_per_prompt is 1"),
        ([{"prompt": "<image> and <image>?", "image": "red.png"}], r"row 0: the prompt holds 2 '<image>' "
                                                                    r"placeholders but 'image' has 1 images"),
    ]:
        data = write_rows(tmp_path, rows)
        with pytest.raises(ConfigError, match=message):
            load_prompts(cfg, tokenizer, data, "train")
    # --max_images_per_prompt 2: the row with 2 images loads with both; a row with 3 is refused
    two = write_rows(tmp_path, [{"prompt": "Colour?", "image": ["red.png", b64]}])
    wide = ppo_cfg(tiny_vlm_dir, two, image_key="image", max_images_per_prompt=2)
    (prompt,) = load_prompts(wide, tokenizer, two, "train")
    assert [image.getpixel((0, 0)) for image in prompt["images"]] == [(255, 0, 0), (0, 0, 255)]
    three = write_rows(tmp_path, [{"prompt": "Colour?", "image": ["red.png", b64, b64]}])
    with pytest.raises(ConfigError, match=r"row 0: 3 images under 'image' but --max_images_per_prompt is 2"):
        load_prompts(wide, tokenizer, three, "train")


@pytest.mark.parametrize(("flags", "message"), [
    ({"packing_samples": True}, "--packing_samples with --image_key is not supported"),
    ({"reward_pretrain": "rm"}, "--reward_pretrain with --image_key is not supported"),
    ({"advantage_estimator": "gae"}, "--advantage_estimator gae with --image_key is not supported"),
    ({"remote_rm_url": None, "agent_func_path": "agent.py"}, "--agent_func_path with --image_key"),
    ({"async_train": True, "partial_rollout": True}, "--partial_rollout with --image_key"),
    ({"ring_attn_size": 2, "actor_num_gpus_per_node": 2}, "--ring_attn_size with --image_key"),
    ({"lora_rank": 4}, "--lora_rank with --image_key"),
    ({"rollout_backend": "hf"}, "--rollout_backend hf with --image_key"),
    ({"max_images_per_prompt": 0}, "--max_images_per_prompt 0: must be >= 1"),
])
def test_what_images_cannot_go_with_is_refused_naming_the_flag(flags, message, tiny_vlm_dir):
    from rlhfkit.rl.validate import validate_rl

    with pytest.raises(ConfigError, match=message):
        validate_rl(ppo_cfg(tiny_vlm_dir, "p.jsonl", **flags))


def test_image_key_needs_a_vision_language_model(tiny_model_dir, tiny_vlm_dir):
    from rlhfkit.rl.vision_batch import check_vision_model, keeps_vision_tower

    with pytest.raises(ConfigError, match=r"--image_key image: --pretrain .* is not a vision-language model"):
        check_vision_model(ppo_cfg(tiny_model_dir, "p.jsonl"))
    check_vision_model(ppo_cfg(tiny_vlm_dir, "p.jsonl"))
    assert keeps_vision_tower(ppo_cfg(tiny_vlm_dir, "p.jsonl"))
    trained_tower = parse_config("ppo", None, ["--pretrain", tiny_vlm_dir, "--no-freeze_vision_tower"])
    assert not keeps_vision_tower(trained_tower)
    assert not keeps_vision_tower(ppo_cfg(tiny_model_dir, "p.jsonl"))


def test_pixel_rows_follow_their_rows_through_slicing_and_batched_forwards_equal_each_row_alone(tiny_vlm_dir):
    """Rows of three prompts (red 40x30, none, blue 24x32 images) x 2 samples, shuffled like a mini-batch, cut into
    micro-batches of 2 and run the way the actor's forward does (left padding, position ids from the mask,
    `pixel_inputs`): each row's response log-probs equal transformers' forward of that row alone with its own
    image (`vlm_response_log_probs`, float64 compare, 1e-5)."""
    from PIL import Image

    from rlhfkit.models.positions import position_ids
    from rlhfkit.models.vision import load_vlm, vision_prompt, vlm_response_log_probs
    from rlhfkit.rl.experience import build_experience, trim_padding
    from rlhfkit.rl.vision_batch import VisionInputs, attach_pixels, pixel_inputs
    from rlhfkit.rl.worker import micro_batches

    vision, model = VisionInputs.load(tiny_vlm_dir), load_vlm(tiny_vlm_dir)
    tok = vision.processor.tokenizer
    images = [[Image.new("RGB", (40, 30), (255, 0, 0))], [], [Image.new("RGB", (24, 32), (0, 0, 255))]]
    texts = [tok.apply_chat_template([{"role": "user", "content": "<image>" * len(im) + q}], tokenize=False,
                                     add_generation_prompt=True) for im, q in zip(images, ["Colour?", "Hi", "What?"])]
    prompts = [{"prompt": t, "images": im} for t, im in zip(texts, images)]
    encoded = [vision_prompt(vision.processor, t, im) for t, im in zip(texts, images)]
    responses = [[tok.convert_tokens_to_ids(w) for w in ws] for ws in (["a", "b", "c"], ["d"], ["e", "f"],
                                                                         ["g", "h", "i", "j"], ["k"], ["l", "m"])]
    samples = [SimpleNamespace(prompt_index=k // 2, prompt_ids=encoded[k // 2].input_ids) for k in range(6)]
    exp = build_experience([s.prompt_ids for s in samples], responses, [[0.0] * len(r) for r in responses],
                           [s.prompt_index for s in samples], tok.pad_token_id)
    attach_pixels(exp, SimpleNamespace(samples=samples, prompts=prompts), vision)
    assert exp.pixel_values.shape[:2] == (6, 1) and not exp.pixel_values[2:4].any()  # the text-only prompt's rows
    order = [3, 0, 5, 2, 1, 4]
    batch = exp.select(order).tensors()
    with torch.no_grad():
        for start, mb in zip(range(0, 6, 2), micro_batches(batch, 2)):
            mb = trim_padding(mb)
            seq, mask, width = mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1]
            extra = pixel_inputs(mb)
            assert bool(extra) == any(samples[r].prompt_index != 1 for r in order[start:start + 2])
            logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                           logits_to_keep=width + 1, **extra).logits[:, :-1].float()
            got = torch.log_softmax(logits, -1).gather(-1, seq[:, -width:, None])[..., 0]
            for i, row in enumerate(order[start:start + 2]):
                want = vlm_response_log_probs(model, samples[row].prompt_ids, responses[row],
                                              encoded[samples[row].prompt_index].pixel)
                n = len(responses[row])
                assert torch.allclose(got[i, :n].double(), want.double(), atol=1e-5), (row, got[i, :n], want)
