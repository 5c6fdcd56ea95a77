"""The screen's table as a terminal shows it: points the estimate cannot tell apart on one row
(their count beside it), only the knobs that vary among the rows shown, and, where those do
not fit the width beside the figures, the knobs as `name=value` words in a folded column."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich import box
from rich.table import Table

from sweeper.record.row import knob_columns, missing, short_names
from sweeper.search.screen import FITS, unseen_knobs

FIGURES = ("est_hbm_per_device_gib", "est_tokens_per_sec_per_chip")


def grouped(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` (ranked) with the points the estimate cannot tell apart on one row: those that
    differ only in knobs no estimated figure depends on (`unseen_knobs`), `points` counting
    them; the first of each group stands for it, in rank order."""
    unseen = set(unseen_knobs(frame))
    seen = [c for c, n in knob_columns(frame.columns).items() if n not in unseen]
    figures = [c for c in ("verdict", *FIGURES) if c in frame]
    keys = frame[[*seen, *figures]].map(str)  # NaN as "nan": a value like the others
    key = keys.apply(lambda row: "\x1f".join(row), axis=1)  # "verdict" is always among them
    out = frame.drop(columns=[c for c, n in knob_columns(frame.columns).items() if n in unseen])
    counts = key.map(key.value_counts())
    return out.assign(points=counts)[~key.duplicated()]


def screen_table(frame: pd.DataFrame, title: str, top: int, width: int) -> Table:
    """The first `top` rows of the grouped screen, in `width` columns."""
    shown = grouped(frame).head(top)
    every = knob_columns(shown.columns)
    knobs = {c: n for c, n in every.items() if _varies(shown[c])}
    names = short_names(every.values())
    same = [f"{names[n]}={_value(shown[c].iloc[0])}" for c, n in every.items() if c not in knobs]
    many = bool((shown["points"] > 1).any())
    heads = ["rank", *(["points"] if many else []), "GiB/device", "est tokens/s/chip"]
    lines = [_cells(row, many) for _, row in shown.iterrows()]
    values = [[_value(row[c]) for c in knobs] for _, row in shown.iterrows()]
    knob_heads = [names[n] for n in knobs.values()]
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(heads)]
    widths += [max([len(h), *(len(v[i]) for v in values)]) for i, h in enumerate(knob_heads)]
    apart = sum(w + 2 for w in widths) <= width
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)  # fmt: skip
    for head in heads:
        table.add_column(head, justify="right", no_wrap=True)
    if apart:
        for head in knob_heads:
            table.add_column(head, no_wrap=True)
    elif knob_heads:
        table.add_column("knobs", ratio=1, overflow="fold")
    if same and len(shown) > 1:
        table.caption, table.caption_justify = "in every row: " + " ".join(same), "left"
    for line, value in zip(lines, values, strict=True):
        words = " ".join(f"{h}={v}" for h, v in zip(knob_heads, value, strict=True) if v != "-")
        table.add_row(*line, *(value if apart else [words] if knob_heads else []))
    return table


def _varies(column: pd.Series) -> bool:
    return len({_value(v) for v in column}) > 1


def _value(cell: Any) -> str:
    return "-" if missing(cell) else str(cell)


def _cells(row: pd.Series, many: bool) -> list[str]:
    fits = row["verdict"] == FITS
    gib = row.get("est_hbm_per_device_gib")
    tokens = row.get("est_tokens_per_sec_per_chip")
    return [
        f"{row['rank']:.0f}" if fits else str(row["verdict"]).replace("_", " "),
        *([f"{row['points']:,}"] if many else []),
        "-" if gib is None or missing(gib) else f"{gib:.1f}",
        f"{tokens:,.0f}" if fits and not missing(tokens) else "-",
    ]
