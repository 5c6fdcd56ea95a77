"""Commands that judge a space before any trial: `screen` every point by the estimate, `plan` a
mesh, remat policy and batch for a model on a target."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from sweeper.answer.fold import say
from sweeper.cli.app import SetOpt, SpaceArg, TargetOpt, app, console, fail, overrides
from sweeper.record.manifest import sweeper_command
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space

if TYPE_CHECKING:
    from trainer.estimate.plan import Recommendation


@app.command()
def screen(
    space: SpaceArg,
    sample: Annotated[
        int | None, typer.Option("--sample", min=1, help="screen this many random points")
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="rows to print")] = 15,
    out: Annotated[Path | None, typer.Option("--out", help="write every row as CSV")] = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Judge every point of a space by the analytic estimate, in this process (fidelity
    estimate): valid or not, fits the target's memory or not, est. tokens/s and rank."""
    import time

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from sweeper.answer.screened import screen_table
    from sweeper.search.screen import FITS, verdict_counts
    from sweeper.search.screen import screen as screen_space

    try:
        loaded = load_space(space, overrides(None, None, None, target, set_))
        started = time.perf_counter()
        with Progress(TextColumn("screening"), BarColumn(bar_width=16), MofNCompleteColumn(),
                      TextColumn("points,"), TimeRemainingColumn(), TextColumn("left"),
                      console=console, transient=True) as bar:  # fmt: skip
            task = bar.add_task("screen", total=None)
            frame = screen_space(loaded, sample,
                                 progress=lambda done, of: bar.update(task, completed=done, total=of))  # fmt: skip
    except (SpaceError, ValueError) as exc:
        fail(str(exc))
    took = time.perf_counter() - started
    title = (f"{loaded.name}: {len(frame):,} points screened in {took:.2f} s "
             f"({verdict_counts(frame)}); fidelity estimate on {loaded.target}")  # fmt: skip
    if (frame["verdict"] == FITS).any():
        console.print(screen_table(frame, title, top, console.width))
    else:  # no row to rank: the reasons below say why
        say(console, f"{title}: no point to rank")
    _screen_notes(frame, loaded)
    if out is not None:
        frame.to_csv(out, index=False)
        console.print(f"wrote {out}")


def _screen_notes(frame: Any, space: Any) -> None:
    """Below the screen's table: why points were left out, the knobs the estimate cannot
    tell apart, and what its figures are of."""
    from sweeper.search.screen import FITS, caveats, unseen_knobs

    if "why" in frame:  # the commonest reasons points were left out
        why = frame.loc[(frame["verdict"] != FITS) & frame["why"].fillna("").ne(""), "why"]
        for reason, count in why.value_counts().head(3).items():
            say(console, f"{count:,} point{'s' if count > 1 else ''}: {reason}")
    unseen = unseen_knobs(frame)
    if unseen:
        say(
            console,
            f"the estimate does not tell the values of {', '.join(unseen)} apart: a row "
            "stands for the points that differ only in them (a compile tells them apart: "
            "fidelity compile; the ladder's verify rung explores them by TPE)",
            "note: ",
        )
    for caveat in caveats(space):
        say(console, caveat, "[yellow]note[/yellow]: ")


@app.command()
def plan(
    model: Annotated[
        str, typer.Option("--model", help="a model preset, e.g. llama3-8b, mixtral-8x7b")
    ],
    seq: Annotated[int, typer.Option("--seq", help="sequence length")] = 8192,
    target: Annotated[
        str, typer.Option("--target", help="TPU topology, e.g. tpu7x:4x4x4")
    ] = "tpu7x:4x4x4",
    space: Annotated[
        Path | None,
        typer.Option("--space", help="write a compile-fidelity space starting from the advice"),
    ] = None,
    compile_: Annotated[
        bool, typer.Option("--compile", help="compile the advice for the target (minutes)")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="compile timeout, seconds")] = 3600,
) -> None:
    """Advise a mesh, remat policy and batch for a model on a target (estimates).

    Every candidate the trainer accepts is estimated; the fastest that fits is advised, with
    FP8 and batch advice. --space writes a space starting there; --compile checks it."""
    import yaml

    from sweeper.search.plan import space_for
    from trainer.estimate.plan import recommend
    from trainer.trial.hardware import Topology

    spec = {"preset": model}
    try:
        Topology.parse(target)
        rec = recommend(spec, seq, target)
    except ValueError as exc:
        fail(str(exc))
    _print_advice(rec, target)
    if space is not None:
        name = f"plan_{model}_{seq}".replace(".", "").replace("-", "_")
        write_space(
            space,
            yaml.safe_dump(space_for(rec, spec, seq, target, name), sort_keys=False),
            "--space",
            "sweeper plan",
        )
        run = sweeper_command("run", str(space))
        say(console, f"wrote {space}: trial 0 is the advice (`{run}`)")
    if compile_:
        _compile_advice(rec, spec, seq, target, timeout)


def write_space(path: Path, text: str, option: str, made_by: str) -> None:
    """Write the space only once the engine takes it: a temporary file beside `path`, loaded,
    then moved into place (nothing is left where a space would not validate)."""
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_space(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (mkstemp's is 0600)
        os.replace(tmp, path)
    except SpaceError as exc:
        fail(
            f"{option} {path}: the space {made_by} wrote does not validate ({exc}); nothing "
            f"was written: this is a fault of `{made_by}`, please report it"
        )
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """The process's umask (read by setting it, then set back)."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _print_advice(rec: Recommendation, target: str) -> None:
    say(console, f"{rec.workload} on {target}: primary {rec.primary}; secondary {rec.secondary}")
    say(console, f"advice: {rec.best.describe()} (fidelity: estimate)")
    for reason in rec.reasons:
        say(console, reason, "  - ", indent=4)
    table = Table("mesh, remat, batch", "GiB/device", "tokens/s/chip", box=box.SIMPLE_HEAD,
                  title="next that fit (estimate)", title_justify="left")  # fmt: skip
    for alt in rec.alternatives[:5]:
        table.add_row(alt.describe(), f"{alt.gib:.1f}", f"{alt.tokens:,.0f}")
    console.print(table)


def _compile_advice(
    rec: Recommendation, spec: dict[str, Any], seq: int, target: str, timeout: float
) -> None:
    from sweeper.search.plan import compile_advice

    with console.status(f"compiling the advice for {target} with libtpu (minutes)"):
        got = compile_advice(rec, spec, seq, target, timeout)
    if got["status"] != "ok":
        console.print(f"compile: {got['status']}: {got['message']}")
        raise typer.Exit(1)
    console.print(
        f"compile: {got['hbm_per_device_gib']:.1f} GiB per device (estimate "
        f"{rec.best.gib:.1f}), fits: {got['fits']}; {got['est_tokens_per_sec_per_chip']:,.0f} "
        f"tokens/s/chip from the compiled program (estimate, fidelity compile), "
        f"{got['compile_s']:.0f} s"
    )
