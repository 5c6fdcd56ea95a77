"""Every command of the README's table as a user types it, from a folder of their own, at a
terminal of 80 columns: exit 0, no traceback, and no line past 80 columns but a command or
path printed whole on a line of its own (to copy it, it is never broken). Before, `screen`
cut every column (`per…`, `bfl…`), `show`'s notes ran to 334 characters on one line and
`export`'s header to 189.

With SWEEPER_TRANSCRIPT=FILE the transcript is written there (docs/columns_80.md is one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DATA, REPO

WIDTH = 80
SWEEP = "20261206-180103-144f"  # the v5e sweep the chip left (committed)
RECIPE = DATA / "tpu_recipes/training/ironwood/llama3.1-70b/8k-fp8-tpu7x-4x4x4/xpk/run_recipe.sh"
# A line past the width is one unbreakable thing, indented or not: a backquoted command or a
# word (a path, a URL, a shell word), with what clings to it, or a shell line's `\`.
WHOLE = re.compile(r"\s*(#\s*)?[^\s`]*(`[^`]+`|\S+)[^\s`]*( \\)?\s*")


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH and not WHOLE.fullmatch(line)]


def test_too_wide_lets_only_a_whole_command_or_path_past_the_width():
    assert _too_wide("x " * 41) and not _too_wide("y" * 120)
    assert not _too_wide("  `" + "sweeper show 20261206 --results-dir " + "d" * 60 + "`")
    assert _too_wide("resume: `sweeper resume " + "d" * 70 + "` continues it")


def test_a_note_folds_at_spaces_and_never_inside_a_command():
    from sweeper.answer.fold import folded

    command = "`sweeper export 20261206-180103-144f --format maxtext --results-dir sweeps`"
    lines = folded(f"export: {command} (or env, trial) " + "word " * 30, WIDTH, first=5)
    assert f"  {command}" in lines  # whole, on a line of its own
    assert all(len(line) <= WIDTH for line in lines if command not in line)
    assert len(lines[0]) <= WIDTH - 5 and all(line.startswith("  ") for line in lines[1:])
    assert " ".join(" ".join(lines).split()) == " ".join(
        f"export: {command} (or env, trial) {'word ' * 30}".split()
    )  # nothing lost, nothing added


@pytest.mark.timeout(30, method="thread")  # broken, it never returns
def test_a_progress_bar_over_the_clis_console_does_not_print_itself_forever(capsys):
    """rich's Live (a progress bar, a status) proxies sys.stdout through its console; the
    CLI's console wrote to sys.stdout as it found it, so each write printed itself again:
    `sweeper tiles` in a terminal spun at full CPU, printing nothing, until killed."""
    from rich.console import Console
    from rich.progress import Progress

    from sweeper.answer.streams import PipeSafe

    console = Console(file=PipeSafe(), force_terminal=True)  # the CLI's, in a terminal
    with Progress(console=console, transient=True) as bar:
        bar.add_task("tuning", total=2)
        print("said beside the bar")
    assert "said beside the bar" in capsys.readouterr().out


def test_the_screen_puts_points_the_estimate_cannot_tell_apart_on_one_row():
    from sweeper.answer.screened import grouped
    from sweeper.search.screen import screen, unseen_knobs
    from sweeper.space.load import load_space

    frame = screen(load_space("llama31_70b_8k_tpu7x"))
    rows = grouped(frame)
    unseen = unseen_knobs(frame)
    assert unseen and not any(f"knob:{k}" in rows for k in unseen)
    assert rows["points"].sum() == len(frame) and len(rows) < len(frame)
    top = rows.iloc[0]  # the best row stands for every point with its knobs and figures
    assert top["points"] == 2 ** len(unseen)  # two values each


def test_every_command_fits_80_columns_from_a_folder_of_ones_own(tmp_path):
    here = tmp_path / "mine"
    here.mkdir()
    shutil.copytree(REPO / "results" / "v5e", here / "sweeps")
    env = {**os.environ, "COLUMNS": str(WIDTH),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "SWEEPER_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    given = ("--results-dir", "sweeps")
    commands = [
        ("validate", "smoke"),
        ("validate", "llama31_70b_8k_tpu7x"),
        ("screen", "llama31_70b_8k_tpu7x", "--top", "6"),
        ("plan", "--model", "llama3-8b", "--seq", "8192", "--target", "tpu7x:2x2x2",
         "--space", "planned.yaml"),
        ("import", str(RECIPE), "-o", "recipe.yaml"),
        ("validate", "recipe.yaml"),
        ("tiles", "smoke", "--target", "tpu7x:2x2x1"),
        ("run", "smoke", "--trials", "2", "--executor", "host", "--set", "trial.steps=5",
         "--set", "search.remeasure=0", "--set", "constraints.convergence=false", *given),
        ("list", *given),
        ("show", SWEEP, *given),
        ("export", SWEEP, "--format", "maxtext", *given),
        ("export", SWEEP, "--format", "env", *given),
        ("export", SWEEP, "--format", "trial", *given),
        ("report", SWEEP, *given),
        ("show", "19990101", *given),  # an error a user meets: exit 2, said in words
    ]  # fmt: skip
    transcript = []
    for args in commands:
        if args[0] == "list":  # the sweep just run, ended: resumed, it says so
            ran = next(p.name for p in (here / "sweeps" / "smoke").iterdir())
            _say(here, env, ("resume", ran, *given), transcript)
        _say(here, env, args, transcript, expected=2 if args[1] == "19990101" else 0)
    if os.environ.get("SWEEPER_TRANSCRIPT"):
        Path(os.environ["SWEEPER_TRANSCRIPT"]).write_text("\n".join(transcript))


def _say(here: Path, env: dict[str, str], args: tuple[str, ...], transcript: list[str],
         expected: int = 0) -> None:  # fmt: skip
    """`sweeper ARGS` run from `here`: its exit as `expected`, no traceback, nothing too wide."""
    done = subprocess.run([sys.executable, "-m", "sweeper.cli", *args], capture_output=True,
                          text=True, cwd=here, env=env, timeout=600)  # fmt: skip
    said = done.stdout + done.stderr
    transcript.append(f"$ sweeper {' '.join(args)}\n{said}")
    assert done.returncode == expected, (args, said[-3000:])
    assert "Traceback" not in said, (args, said[-3000:])
    assert _too_wide(said) == [], (args, _too_wide(said))
