"""The benchmarks' compact tables: 80 columns wide, no vertical rules, columns one space apart,
the caption under them from the left."""

from __future__ import annotations

from rich import box
from rich.table import Table


def compact(title: str, caption: str | None = None) -> Table:
    return Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=0, show_edge=False,
                 caption_justify="left")  # fmt: skip
