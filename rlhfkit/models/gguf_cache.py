"""Convert a GGUF file once into a cached Hugging Face folder, safely across concurrent processes.

transformers can load a GGUF file (it dequantizes to float), but a model loaded that way refuses
``save_pretrained`` and every load pays the dequantization again. So the first use converts: load from
GGUF, build a fresh model from its config, copy the state dict, save safetensors (float32, because
dequantized Q4/Q8 values are not exactly representable in bf16) together with the tokenizer and its chat
template. Later uses find the folder and return it.

Cache layout: ``$RLHFKIT_CACHE`` (default ``~/.cache/rlhfkit``) ``/gguf/<stem>-<key>/`` where ``key`` is the
SHA-256 of the GGUF file's bytes: an edited file converts again, and the same file reached by another path (a fresh
virtual environment, a CI clone) reuses the one conversion instead of adding another 0.5 GB folder per path.
A conversion is written to a temporary folder beside the final one and renamed into place; an ``flock`` lets a
second process wait for the first instead of converting the same file twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DONE_MARKER = "rlhfkit_gguf_source.json"
# Number of conversions this process has run; tests use it to prove the cache is reused.
conversion_count = 0


def cache_root() -> Path:
    """The rlhfkit cache folder: ``$RLHFKIT_CACHE`` or ``~/.cache/rlhfkit``."""
    return Path(os.environ.get("RLHFKIT_CACHE") or Path.home() / ".cache" / "rlhfkit").expanduser()


# (absolute path, size, mtime_ns) -> content digest, so one process hashes a file once.
_digests: dict[tuple[str, int, int], str] = {}


def content_digest(path: Path) -> str:
    """SHA-256 of the file's bytes (hex), remembered for as long as its path, size and mtime stay the same."""
    stat = path.stat()
    memo_key = (str(path), stat.st_size, stat.st_mtime_ns)
    if memo_key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        _digests[memo_key] = digest.hexdigest()
    return _digests[memo_key]


def cached_folder_for(gguf_path: str | os.PathLike) -> Path:
    """The cache folder a GGUF file converts into (keyed by the file's content, not its path)."""
    path = Path(gguf_path).resolve()
    return cache_root() / "gguf" / f"{path.stem}-{content_digest(path)[:16]}"


def is_converted(folder: Path) -> bool:
    """True if ``folder`` holds a finished conversion (the marker is written last, before the rename)."""
    return (folder / DONE_MARKER).is_file()


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf_cached(gguf_path: str | os.PathLike) -> Path:
    """Return the cached HF folder for ``gguf_path``, converting it first if no finished conversion exists."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    final = cached_folder_for(gguf_path)
    if is_converted(final):
        return final
    with _file_lock(final.with_name(final.name + ".lock")):
        if is_converted(final):  # another process finished while we waited for the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            convert_gguf(gguf_path, tmp)
            if final.exists():  # a stale, unfinished folder (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return final


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert one GGUF file into an HF folder (float32 safetensors + tokenizer with chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    global conversion_count
    started = time.perf_counter()
    gguf_path = Path(gguf_path).resolve()
    out = Path(out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if not tokenizer.chat_template:
        template = read_gguf_chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    from_gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    config = from_gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the fresh model holds plain float weights
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(from_gguf.state_dict(), strict=True)
    fresh.tie_weights()
    del from_gguf
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {
        "gguf_path": str(gguf_path),
        "size": gguf_path.stat().st_size,
        "mtime_ns": gguf_path.stat().st_mtime_ns,
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / DONE_MARKER).write_text(json.dumps(source, indent=2) + "\n")
    _make_readable(out)
    conversion_count += 1
    return out


def _make_readable(folder: Path) -> None:
    """mkdtemp creates a 0700 folder; a shared cache should be readable by every user of the machine."""
    folder.chmod(0o755)
    for item in folder.iterdir():
        item.chmod(0o644)


def read_gguf_chat_template(gguf_path: str | os.PathLike) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF file's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()
