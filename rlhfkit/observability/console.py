"""What a person watches: the derived-quantities table at start, and a progress bar."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm


def print_derived_table(title: str, rows: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        table.add_row(key, str(value))
    Console(stderr=True).print(table)


def progress_bar(total: int, initial: int, enabled: bool, desc: str) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)
