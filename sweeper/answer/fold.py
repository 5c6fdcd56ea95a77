"""Words folded to the terminal's width, a command in backquotes never broken: a person copies
it whole. A note, an error or a progress line is said in lines of at most the width, the
lines after the first indented under it; a command longer than the width stands alone on a
line of its own (a terminal folds it; a copy from it is still one command)."""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape
from rich.text import Text

# A word: a backquoted span with what clings to it (`(`cmd`),`), else a run of non-spaces.
WORD = re.compile(r"[^\s`]*`[^`]*`[^\s`]*|\S+")
INDENT = 2


def folded(text: str, width: int, first: int = 0, indent: int = INDENT) -> list[str]:
    """`text`'s lines folded at spaces to `width` columns, the first line after `first`
    columns already used (a lead such as `note `), the others indented by `indent`."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line, used = "", first if not lines else 0
        for word in WORD.findall(paragraph):
            room = width - used - (len(line) + 1 if line else 0)
            if line and len(word) > room:
                lines.append(line)
                line, used = " " * indent + word, 0
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return lines


def say(console: Console, text: str, lead: str = "", indent: int = INDENT) -> None:
    """`text` (plain words, never markup) after `lead` (markup, e.g. `[yellow]note[/yellow] `)
    on `console`, folded to its width, the lines after the first indented by `indent`."""
    used = Text.from_markup(lead).cell_len
    lines = folded(text, max(console.width, 20), first=used, indent=indent)
    console.print(lead + escape("\n".join(lines)), soft_wrap=True)
