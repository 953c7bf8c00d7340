"""Checkpoint files that are never unpickled into code: plain data and tensors, read with `weights_only=True`.

`torch.load(path, weights_only=False)` runs whatever a crafted file's pickle asks for (`__reduce__`), so a
checkpoint folder someone hands you could run code at `--load_checkpoint`. rlhfkit writes its non-DCP state (the
scheduler, each rank's RNG states, the rollouts an --async_train run generated ahead) with `save_state`: the object
is first encoded into what torch's restricted unpickler accepts (dicts, lists, tuples, str, int, float, bool, None,
tensors), with a tagged dict for each numpy array or scalar, set, PIL image (PNG bytes) and dataclass of a fixed list
(`register_dataclasses`); anything else is refused when saving. `load_state` reads it back with `weights_only=True`: a
file that holds anything else (a crafted pickle, or the pickled format of older rlhfkit versions) is refused with
`UnsafeCheckpointError` naming the file, before any of its objects is built.

A file of the old pickled format that you trust (you wrote it) can be converted once with `convert_trusted(path)`
(this one call unpickles it).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhfkit.errors import UnsafeCheckpointError

FORMAT_KEY = "__rlhfkit_state_format__"
FORMAT = 1
_TAG = "__rlhfkit_"  # dict keys starting with it are tags; a user dict holding one is wrapped (_DICT)
_DICT, _DATACLASS, _NDARRAY, _NPSCALAR, _SET, _IMAGE = (f"{_TAG}{k}__" for k in
                                                       ("dict", "dataclass", "ndarray", "npscalar", "set", "image"))


_SAFE_DATACLASSES: dict[str, type] = {}


def register_dataclasses(*classes: type) -> None:
    """Allow these dataclasses in saved state (rebuilt from their fields on load). The layer that owns them
    registers them (rlhfkit.rl.async_rollout: the pending rollouts), so this module imports nothing above it."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        _SAFE_DATACLASSES[f"{cls.__module__}.{cls.__qualname__}"] = cls


def _passthrough(obj: Any) -> bool:
    return obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device,
                                           torch.Size)) and not isinstance(obj, np.generic)


def encode(obj: Any, where: str = "state") -> Any:
    """`obj` as dicts/lists/tuples/primitives/tensors (see the module docstring); TypeError for anything else."""
    if _passthrough(obj):
        return obj
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: str(obj.dtype), "shape": list(obj.shape), "data": _array_tensor(obj, where)}
    if isinstance(obj, np.generic):
        return {_NPSCALAR: str(obj.dtype), "data": _array_tensor(np.asarray(obj), where)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if name not in _SAFE_DATACLASSES:
            raise TypeError(f"{where}: a {name} cannot be saved in a checkpoint (not one of the known dataclasses)")
        return {_DATACLASS: name, "fields": {f.name: encode(getattr(obj, f.name), f"{where}.{f.name}")
                                             for f in dataclasses.fields(obj)}}
    if type(obj) is dict:
        out = {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_DICT: out} if any(isinstance(k, str) and k.startswith(_TAG) for k in obj) else out
    if type(obj) is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(encode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if type(obj) in (set, frozenset):
        return {_SET: type(obj).__name__, "items": [encode(v, f"{where}{{}}") for v in obj]}
    if type(obj).__module__.startswith("PIL.") and hasattr(obj, "save"):
        buf = io.BytesIO()
        obj.save(buf, format="PNG")
        return {_IMAGE: "png", "data": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be saved in a checkpoint "
                    "(only plain data, tensors, numpy arrays and rlhfkit's rollout dataclasses)")


def _array_tensor(arr: np.ndarray, where: str) -> torch.Tensor:
    arr = np.ascontiguousarray(arr).reshape(-1)
    if arr.dtype.kind == "u" and arr.dtype.itemsize > 1:  # uint16/32/64: torch's support is partial; exact in int64
        if arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >= 2**63:
            return torch.from_numpy(arr.view(np.int64).copy())
        return torch.from_numpy(arr.astype(np.int64))
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{where}: a numpy array of dtype {arr.dtype} cannot be saved in a checkpoint")
    return torch.from_numpy(arr.copy())


def decode(obj: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(decode(v) for v in obj)
    if not isinstance(obj, dict):
        return obj
    if _DICT in obj and len(obj) == 1:
        return {k: decode(v) for k, v in obj[_DICT].items()}
    if _NDARRAY in obj:
        dtype = np.dtype(obj[_NDARRAY])
        data = obj["data"].numpy()
        arr = data.view(dtype) if data.dtype.itemsize == dtype.itemsize and dtype.kind == "u" else data.astype(dtype)
        return arr.reshape(obj["shape"]).copy()
    if _NPSCALAR in obj:
        return obj["data"].numpy().astype(np.dtype(obj[_NPSCALAR]))[0]
    if _DATACLASS in obj:
        cls = _SAFE_DATACLASSES.get(obj[_DATACLASS])
        if cls is None:
            raise UnsafeCheckpointError(f"unknown dataclass {obj[_DATACLASS]!r} in a checkpoint")
        fields = {k: decode(v) for k, v in obj["fields"].items()}
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        made = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                object.__setattr__(made, k, v)
        return made
    if _SET in obj:
        return (frozenset if obj[_SET] == "frozenset" else set)(decode(v) for v in obj["items"])
    if _IMAGE in obj:
        from PIL import Image

        image = Image.open(io.BytesIO(obj["data"].numpy().tobytes()), formats=["PNG"])
        image.load()
        return image
    return {k: decode(v) for k, v in obj.items()}


def save_state(obj: Any, path: str | Path) -> None:
    """Write `obj` to `path` in the safe format (`load_state` reads it)."""
    torch.save({FORMAT_KEY: FORMAT, "state": encode(obj, Path(path).name)}, path)


def load_state(path: str | Path, what: str) -> Any:
    """Read a file `save_state` wrote, never unpickling code. `what` names the file's role in the errors.

    A file without the format key (older rlhfkit) is returned as it loads when it holds plain data only (an old
    scheduler.pt does); anything else is refused with UnsafeCheckpointError."""
    path = Path(path)
    try:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as err:
        raise UnsafeCheckpointError(
            f"{path}: refused to load {what}: it holds something other than plain data and tensors, so it is not "
            "unpickled (loading it could run code). A checkpoint written by rlhfkit before safe checkpoints (#29) "
            "stores it pickled: if you wrote it yourself and trust it, convert it once with `python -c \"from "
            f"rlhfkit.engine.safe_state import convert_trusted; convert_trusted('{path}')\"` and resume again; "
            f"otherwise resume from a newer checkpoint or start fresh. ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if isinstance(loaded, dict) and loaded.get(FORMAT_KEY) == FORMAT:
        return decode(loaded["state"])
    return loaded


def convert_trusted(path: str | Path) -> None:
    """Rewrite an old pickled checkpoint file in the safe format. This unpickles it: only for files you trust."""
    obj = torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 -- the caller trusts this file
    if isinstance(obj, dict) and obj.get(FORMAT_KEY) == FORMAT:
        return
    save_state(obj, path)


_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    _DCP_META: {"Metadata", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle (`FileSystemReader.read_metadata` runs `pickle.load`): read it with only DCP's
    metadata classes, torch dtypes/layouts/memory formats, torch.Size and paths allowed."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def _safe_reader(folder: str | Path, refused: list[UnsafeCheckpointError]) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                try:
                    metadata = _MetadataUnpickler(stream).load()
                except (pickle.UnpicklingError, AttributeError, TypeError, ValueError, EOFError) as err:
                    refused.append(UnsafeCheckpointError(
                        f"{path}: refused to load the torch.distributed.checkpoint metadata: it holds objects other "
                        f"than DCP's metadata classes, so it is not unpickled (loading it could run code); resume "
                        f"from another checkpoint or start fresh. ({err})"))
                    raise refused[-1] from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))


def dcp_load(state: dict[str, Any], folder: str | Path) -> None:
    """`torch.distributed.checkpoint.load(state, checkpoint_id=folder)` with the `.metadata` pickle read by a
    restricted unpickler (the tensor files DCP itself reads with `torch.load(weights_only=True)`)."""
    import torch.distributed.checkpoint as dcp

    refused: list[UnsafeCheckpointError] = []
    try:
        dcp.load(state, storage_reader=_safe_reader(folder, refused))
    except BaseException:  # DCP wraps the reader's refusal in a CheckpointException, a BaseException: raise ours
        if refused:
            raise refused[0] from None
        raise
