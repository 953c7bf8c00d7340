"""Images of a prompt row (`--image_key`): file paths, base64 strings or `data:image/...;base64,` URLs -> PIL images.

A row's image column holds one image (a string) or a list of them. Relative paths are resolved against the data
file's folder. An image that cannot be read, or a row with more than `--max_images_per_prompt` images, raises
`ConfigError` naming the row, the key and the file: a bad row never turns into a text-only prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Sequence
from typing import Any

from rlhfkit.errors import ConfigError

_DATA_URL_PREFIX = "data:"
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


def row_images(row: dict[str, Any], row_index: int, image_key: str, max_images: int,
               base_dir: str | None = None) -> list[Any]:
    """The decoded RGB PIL images of `row[image_key]` (an empty list when the key is absent or empty).

    Raises ConfigError naming `row_index` for an unreadable image or more than `max_images` images.
    """
    value = row.get(image_key)
    if value is None or value == "" or value == []:
        return []
    items: Sequence[Any] = value if isinstance(value, (list, tuple)) else [value]
    if len(items) > max_images:
        raise ConfigError(
            f"row {row_index}: {len(items)} images under {image_key!r} but --max_images_per_prompt is {max_images}; "
            "raise --max_images_per_prompt or drop images from the row")
    return [load_image(item, f"row {row_index}, {image_key!r}[{i}]", base_dir) for i, item in enumerate(items)]


def load_image(item: Any, where: str, base_dir: str | None = None) -> Any:
    """One image as an RGB PIL image: a PIL image, a path, a base64 string or a data URL; `where` names it in errors."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, dict) and "bytes" in item:  # the `datasets` Image feature's storage form
        item = item["bytes"] if item["bytes"] is not None else item.get("path")
    if isinstance(item, bytes):
        raw, source = item, "raw bytes"
    elif isinstance(item, str):
        raw, source = _read_string(item, where, base_dir)
    else:
        raise ConfigError(f"{where}: an image must be a path, a base64 string or a data URL, got {type(item).__name__}")
    try:
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read the image ({source}): {exc}") from exc


def _read_string(item: str, where: str, base_dir: str | None) -> tuple[bytes, str]:
    if item.startswith(_DATA_URL_PREFIX):
        header, _, payload = item.partition(",")
        if ";base64" not in header or not payload:
            raise ConfigError(f"{where}: a data URL image must be `data:image/<type>;base64,<data>`")
        return _b64(payload, where), "data URL"
    path = item if os.path.isabs(item) or base_dir is None else os.path.join(base_dir, item)
    if os.path.exists(path):
        with open(path, "rb") as handle:
            return handle.read(), f"file {path}"
    if os.path.splitext(item)[1].lower() in _IMAGE_SUFFIXES or "/" in item[:1]:
        raise ConfigError(f"{where}: image file {path} does not exist")
    return _b64(item, where), "base64 string"


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{where}: not a readable image path and not valid base64 ({exc})") from exc
