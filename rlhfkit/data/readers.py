"""Read datasets (files, ``save_to_disk`` folders, hub names) and blend several with probabilities.

Every row returned here carries three provenance columns so that later errors name the file and row:
``_source`` (the spec as given), ``_row`` (0-based row index within that source) and ``_line``
(1-based line number for JSON-lines files, ``None`` otherwise).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import datasets
import numpy as np

from rlhfkit.data.errors import LINE_COLUMN, PROVENANCE_COLUMNS, ROW_COLUMN, SOURCE_COLUMN
from rlhfkit.errors import DataError

logger = logging.getLogger(__name__)

#: File extension -> `datasets` builder name.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def load_dataset_spec(spec: str, split: str = "train") -> datasets.Dataset:
    """Load one dataset given as a file, a folder or a hub name, with provenance columns added.

    * ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` / ``.arrow`` files (JSON lines are validated line by line);
    * folders written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (``split`` picks the split);
    * other folders and hub names go to ``datasets.load_dataset`` (hub names work where the hub is reachable).

    Raises FileNotFoundError for a missing local-looking path and DataError for unreadable or empty data.
    """
    spec = spec.strip()
    path = os.path.expanduser(spec)
    lines = None
    if os.path.isdir(path):
        ds = _load_folder(path, split)
    elif os.path.isfile(path):
        ds, lines = _load_file(path)
    elif _looks_local(spec):
        raise FileNotFoundError(f"dataset {spec!r}: no such file or folder (working directory {os.getcwd()!r}). "
                                "Check the path given to --dataset / --prompt_data.")
    else:
        ds = _load_hub(spec, split)
    if len(ds) == 0:
        raise DataError(f"dataset {spec!r} is empty (0 rows in split {split!r}); give a file with at least one row.")
    return add_provenance(ds, spec, lines)


def add_provenance(ds: datasets.Dataset, source: str, lines: list[int] | None = None) -> datasets.Dataset:
    """Add ``_source``, ``_row`` and ``_line`` columns (kept as they are if the data already has all three)."""
    if all(c in ds.column_names for c in PROVENANCE_COLUMNS):
        return ds
    ds = ds.remove_columns([c for c in PROVENANCE_COLUMNS if c in ds.column_names])
    n = len(ds)
    if lines is not None and len(lines) != n:
        lines = None  # the reader and our scan disagree: fall back to row numbers rather than report wrong lines
    ds = ds.add_column(SOURCE_COLUMN, [source] * n, feature=datasets.Value("string"))
    ds = ds.add_column(ROW_COLUMN, list(range(n)), feature=datasets.Value("int64"))
    return ds.add_column(LINE_COLUMN, lines if lines is not None else [None] * n, feature=datasets.Value("int64"))


def _looks_local(spec: str) -> bool:
    """True for specs that can only mean a local path (so a missing one is an error, not a hub lookup)."""
    if spec.startswith(("/", "./", "../", "~", ".\\")) or os.path.isabs(spec):
        return True
    if os.path.splitext(spec)[1].lower() in FILE_BUILDERS:
        return True
    return spec.count("/") > 1  # hub names are "name" or "org/name"


def _load_folder(path: str, split: str) -> datasets.Dataset:
    """A ``save_to_disk`` folder (Dataset or DatasetDict), else a folder of data files via ``load_dataset``."""
    is_saved = os.path.exists(os.path.join(path, "state.json")) or os.path.exists(
        os.path.join(path, "dataset_dict.json"))
    if not is_saved:
        return _call_load_dataset(path, split, path)
    try:
        obj = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise DataError(f"{path}: could not load the save_to_disk folder: {e}") from e
    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise DataError(f"{path}: split {split!r} not found; the folder has splits {sorted(obj)}. "
                            "Pick one with --dataset_split / --prompt_split.")
        return obj[split]
    return obj


def _load_file(path: str) -> tuple[datasets.Dataset, list[int] | None]:
    """One data file; JSON is validated first so a bad line is reported with its line number."""
    ext = os.path.splitext(path)[1].lower()
    builder = FILE_BUILDERS.get(ext)
    if builder is None:
        raise DataError(f"{path}: unknown data file type {ext!r}; use one of {sorted(FILE_BUILDERS)} "
                        "or a save_to_disk folder.")
    if os.path.getsize(path) == 0:
        raise DataError(f"dataset {path!r} is empty (0 bytes); give a file with at least one row.")
    lines = None
    if builder == "json":
        lines = _validate_json_file(path)
        if not lines:
            raise DataError(f"dataset {path!r} is empty (no JSON rows); give a file with at least one row.")
        if lines == [0]:  # a JSON array: rows, not lines
            lines = None
    ds = _call_load_dataset(builder, "train", path, data_files=path)
    if builder == "json":
        ds = _repair_mixed_type_columns(ds, path)
    return ds, lines


def _repair_mixed_type_columns(ds: datasets.Dataset, path: str) -> datasets.Dataset:
    """Re-read columns that mix value types (``Json`` features) from the file.

    `datasets` stores such columns as JSON text but does not quote strings, so the string ``"true"`` comes back as
    the boolean True and ``"1"`` as the number 1: a silent change of the data. We put the original values back.
    """
    mixed = [name for name, feature in ds.features.items() if isinstance(feature, datasets.Json)]
    if not mixed:
        return ds
    values: dict[str, list[str]] = {name: [] for name in mixed}
    for row in _iter_json_rows(path):
        for name in mixed:
            values[name].append(json.dumps(row.get(name)))
    for name in mixed:  # add before removing: a table without columns would lose its row count
        tmp = f"{name}__rlhfkit_reread"
        ds = ds.add_column(tmp, values[name], feature=datasets.Json()).remove_columns(name).rename_column(tmp, name)
    return ds


def _iter_json_rows(path: str):
    with open(path, encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):
            f.seek(0)
            yield from json.load(f)
            return
        f.seek(0)
        for text in f:
            if text.strip():
                yield json.loads(text)


def _call_load_dataset(name: str, split: str, what: str, **kwargs) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split=split, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the source named
        if "corresponds to no data" in str(e):  # what `datasets` says for a split with 0 rows
            raise DataError(f"dataset {what!r} is empty (0 rows); give a file with at least one row.") from e
        raise DataError(f"{what}: could not be read ({type(e).__name__}: {e})") from e


def _load_hub(spec: str, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(spec, split=split)
    except Exception as e:  # noqa: BLE001 - re-raised with the spec named
        raise DataError(f"dataset {spec!r}: no local file or folder has this name, and loading it as a hub dataset "
                        f"failed ({type(e).__name__}: {e}). Give a local path, or make the hub reachable.") from e


def _validate_json_file(path: str) -> list[int]:
    """Check a .json/.jsonl file; return the 1-based line numbers of its rows ([0] for a JSON array file)."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}). Save the file as UTF-8.") from None
    if head.startswith("["):
        return _validate_json_array(path)
    return _scan_json_lines(path)


def _validate_json_array(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                        "Fix the file, or write one JSON object per line (.jsonl).") from e
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataError(f"{path}: element {bad} of the JSON array is a {type(rows[bad]).__name__}, not an object.")
    return [0] if rows else []


def _scan_json_lines(path: str) -> list[int]:
    """Parse every line (blank lines are skipped, as `datasets` does); return the line numbers of the rows."""
    lines = []
    with open(path, encoding="utf-8") as f:
        try:
            for number, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                _check_json_line(path, number, text)
                lines.append(number)
        except UnicodeDecodeError as e:
            raise DataError(f"{path} line {len(lines) + 1} or after: not UTF-8 text ({e}). "
                            "Save the file as UTF-8.") from None
    return lines


def _check_json_line(path: str, number: int, text: str) -> None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        snippet = text.strip()[:80]
        raise DataError(f"{path} line {number}: not valid JSON ({e.msg} at column {e.colno}): {snippet!r}. "
                        "Each line of a JSON-lines file must be one complete JSON object; "
                        "fix or delete that line.") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} line {number}: expected a JSON object ({{...}}), got a {type(obj).__name__}. "
                        "Each line must be one object such as {\"input\": ..., \"output\": ...}.")


def parse_list(value: Sequence[str] | str, flag: str) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (empty items are an error naming the flag)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [str(i).strip() for i in items]
    if not items or any(not i for i in items):
        raise DataError(f"{flag}: empty entry in {value!r}; give a comma-separated list without empty items.")
    return items


def parse_probs(probs: Sequence[float] | str | None, count: int, flag: str = "--dataset_probs") -> list[float] | None:
    """Validate mixing probabilities: one per dataset, each >= 0, summing to 1 (tolerance 1e-6)."""
    if probs is None or (isinstance(probs, str) and not probs.strip()):
        return None
    items = parse_list(probs, flag) if isinstance(probs, str) else list(probs)
    try:
        values = [float(p) for p in items]
    except ValueError as e:
        raise DataError(f"{flag}: {probs!r} is not a list of numbers ({e}).") from None
    if len(values) != count:
        raise DataError(f"{flag}: got {len(values)} probabilities for {count} datasets; give exactly one per dataset.")
    if any(v < 0 or not np.isfinite(v) for v in values):
        raise DataError(f"{flag}: probabilities must be finite and >= 0, got {values}.")
    if abs(sum(values) - 1.0) > 1e-6:
        raise DataError(f"{flag}: probabilities must sum to 1, got {values} (sum {sum(values):.6g}).")
    return values


def _parse_max_samples(max_samples: int | float | None) -> int | None:
    if max_samples is None:
        return None
    if max_samples < 1 or int(max_samples) != max_samples:
        raise DataError(f"--max_samples must be a positive whole number, got {max_samples!r}.")
    return int(max_samples)


def blend_datasets(specs: Sequence[str] | str, probs: Sequence[float] | str | None = None, *, split: str = "train",
                   seed: int = 42, max_samples: int | float | None = None,
                   flags: tuple[str, str] = ("--dataset", "--dataset_probs")) -> datasets.Dataset:
    """Load ``--dataset a,b`` and mix them per ``--dataset_probs``, keeping at most ``--max_samples`` rows.

    Without probabilities the sources are concatenated in order and the first ``max_samples`` rows kept.
    With probabilities, ``N = max_samples`` (or the total row count) rows are drawn: each draw picks a source with
    its probability (seeded), and each source yields its rows in a seeded shuffled order, starting a new shuffled pass
    when it runs out (so a small source with a large probability is repeated). Same seed -> same rows, same order.
    ``flags`` names the two flags in error messages (e.g. ``("--prompt_data", "--prompt_data_probs")``).
    """
    spec_list = parse_list(specs, flags[0])
    prob_list = parse_probs(probs, len(spec_list), flags[1])
    limit = _parse_max_samples(max_samples)
    parts = [load_dataset_spec(s, split) for s in spec_list]
    merged = _concatenate(parts, spec_list)
    if prob_list is None or len(parts) == 1:
        total = len(merged) if limit is None else min(limit, len(merged))
        if total < len(merged):
            logger.info("--max_samples %d: keeping the first %d of %d rows", limit, total, len(merged))
        return merged.select(range(total)) if total < len(merged) else merged
    sizes = [len(p) for p in parts]
    indices = _draw_indices(sizes, prob_list, limit or sum(sizes), seed)
    _log_mix(spec_list, sizes, indices)
    return merged.select(indices)


def _draw_indices(sizes: list[int], probs: list[float], total: int, seed: int) -> np.ndarray:
    """Global row indices (into the concatenation of the sources) for ``total`` seeded draws."""
    rng = np.random.default_rng(seed)
    choice = rng.choice(len(sizes), size=total, p=np.asarray(probs) / sum(probs))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(total, dtype=np.int64)
    for i, size in enumerate(sizes):
        where = np.nonzero(choice == i)[0]
        passes = -(-len(where) // size) if len(where) else 0
        order = np.concatenate([rng.permutation(size) for _ in range(passes)]) if passes else np.empty(0, np.int64)
        out[where] = offsets[i] + order[: len(where)]
    return out


def _log_mix(specs: list[str], sizes: list[int], indices: np.ndarray) -> None:
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i, spec in enumerate(specs):
        drawn = indices[(indices >= offsets[i]) & (indices < offsets[i + 1])]
        logger.info("dataset %s: %d rows, %d drawn (%d distinct)", spec, sizes[i], len(drawn), len(np.unique(drawn)))


def _concatenate(parts: list[datasets.Dataset], specs: list[str]) -> datasets.Dataset:
    """Concatenate sources whose columns may differ: a column missing from a source is filled with None."""
    if len(parts) == 1:
        return parts[0]
    features: dict[str, tuple[str, datasets.features.FeatureType]] = {}
    for spec, part in zip(specs, parts):
        for name, feature in part.features.items():
            if name in features and features[name][1] != feature:
                raise DataError(f"column {name!r} has type {features[name][1]} in {features[name][0]} but {feature} "
                                f"in {spec}; make the sources agree on this column's type.")
            features.setdefault(name, (spec, feature))
    aligned = []
    for part in parts:
        for name, (_, feature) in features.items():
            if name not in part.column_names:
                part = part.add_column(name, [None] * len(part), feature=feature)
        aligned.append(part.select_columns(list(features)))
    return datasets.concatenate_datasets(aligned)
