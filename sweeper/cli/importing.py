"""`sweeper import`: the MaxText command a team runs today becomes a space whose trial 0 is
that command (sweeper/space/command.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from sweeper.cli.app import app, console, fail
from sweeper.cli.planning import write_space
from sweeper.record.manifest import sweeper_command
from sweeper.space.errors import SpaceError


class _Dumper(yaml.SafeDumper):
    """A space as a person would write it: no anchors, a command's lines as a block."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


@app.command("import")
def import_(
    command: Annotated[
        str,
        typer.Argument(
            help="a MaxText command line (quoted), or a file holding one: a tpu-recipes "
            "run_recipe.sh, an xpk workload command; LIBTPU_INIT_ARGS and XLA_FLAGS are read too"
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="the space to write (default: NAME.yaml)")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option("--target", help="its TPU topology, e.g. tpu7x:4x4x4 (xpk's --tpu-type)"),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="the space's name")] = None,
) -> None:
    """Make a space from a MaxText command: trial 0 is the command, setting for setting.

    What the engine's vocabulary maps becomes the trial's settings and knobs around the
    command's values (batch, remat placements, FP8, Splash layouts and blocks, scoped VMEM,
    mesh); every setting is kept in the space's recipe record, and `sweeper export --format
    maxtext` of trial 0 gives the command back."""
    from sweeper.space.command import load_text, read_command, space_of, where

    source: Path | None = None
    text = ""
    try:
        text, source = load_text(command)
        found = read_command(text)
        model = found.settings.get("model_name", "model")
        seq = found.settings.get("max_target_length", "")
        name = name or f"{model}_{seq}_imported".replace(".", "").replace("-", "_").strip("_")
        data = space_of(found, name, target)
    except SpaceError as exc:
        fail(where(exc, text, source))
    path = output or Path(f"{name}.yaml")
    recipe = data["maxtext"]["recipe"]
    header = [
        f"Imported by `sweeper import` from a MaxText command ({len(recipe['settings'])} "
        "settings): trial 0 is that command.",
        "maxtext.recipe is the command as read: each trial runs it, changed only where its",
        "knobs map differently (`sweeper export ID --format maxtext` prints it).",
        *(f"changed: {c}" for c in recipe.get("changes", [])),
        *(f"not modeled by the estimate: {u}" for u in recipe.get("unmodeled", [])),
    ]
    text = "".join(f"# {line}\n" for line in header)
    text += yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100, default_flow_style=None)
    write_space(path, text, "-o", "sweeper import")
    _say(path, name, data)


WIDTH = 80  # what the import prints fits a terminal of 80 columns


def _print(text: str, head: str = "", style: str = "", indent: str = "  ") -> None:
    """One item of the summary, wrapped to WIDTH (words and paths whole), `head` styled."""
    from rich.text import Text

    width = min(WIDTH, console.width)
    lines = textwrap.wrap(
        f"{indent}{head}{' ' if head else ''}{text}",
        width=width,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    for i, line in enumerate(lines):
        out = Text(line)
        if i == 0 and head and style:
            out.stylize(style, len(indent), len(indent) + len(head))
        console.print(out, soft_wrap=True)


def _say(path: Path, name: str, data: dict[str, Any]) -> None:
    """What the import wrote: its settings, each knob around the command, what changed."""
    recipe = data["maxtext"]["recipe"]
    _print(f"wrote {path}: space {name!r}, trial 0 is the command", indent="")
    flags = len(recipe.get("libtpu_init_args", []))
    _print(
        f"{len(recipe['settings'])} settings kept; {flags} libtpu flags; target "
        f"{data['target']} at compile fidelity"
    )
    (start,) = data["search"]["warm_start"]
    for key, knob in data["knobs"].items():
        values = ", ".join(str(v) for v in knob["values"])
        said = f"the command: {start[key]}" if key in start else f"when {_when(knob)}"
        _print(f"{key}: {values} ({said})", head="knob")
    for change in recipe.get("changes", []):
        _print(change, head="changed", style="yellow")
    for feature in recipe.get("unmodeled", []):
        _print(f"by the estimate: {feature}", head="not modeled", style="yellow")
    _print(
        f"next: `{sweeper_command('validate', str(path))}`, `{sweeper_command('run', str(path))}`",
        indent="",
    )


def _when(knob: dict[str, Any]) -> str:
    return " and ".join(f"{k}={v}" for k, v in knob.get("when", {}).items())
