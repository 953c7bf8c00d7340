"""Data errors that say what was wrong, where (file, line or row, key) and what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhfkit.errors import DataError

#: Columns the readers add to every row so that later errors can name the file and row.
SOURCE_COLUMN = "_source"
ROW_COLUMN = "_row"
LINE_COLUMN = "_line"
PROVENANCE_COLUMNS = (SOURCE_COLUMN, ROW_COLUMN, LINE_COLUMN)


def where(row: Mapping[str, Any]) -> str:
    """Human-readable location of a row: ``"a.jsonl line 3"`` or ``"b.parquet row 2 (0-based)"``."""
    source = row.get(SOURCE_COLUMN, "<in-memory data>")
    line = row.get(LINE_COLUMN)
    if line is not None and line >= 1:
        return f"{source} line {line}"
    index = row.get(ROW_COLUMN)
    if index is None:
        return f"{source} (unknown row)"
    return f"{source} row {index} (0-based)"


def data_keys(row: Mapping[str, Any]) -> list[str]:
    """The user's keys of a row (without the provenance columns)."""
    return [k for k in row if k not in PROVENANCE_COLUMNS]


def row_error(row: Mapping[str, Any], message: str) -> DataError:
    """A DataError prefixed with the row's location."""
    return DataError(f"{where(row)}: {message}")
