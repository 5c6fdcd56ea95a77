"""`sweeper tiles SPACE`: what each scoped VMEM limit unlocks. Trial 0's kernels (Splash, and
tokamax's grouped matmuls) are tuned for the space's TPU target under each limit, as
`kernels.tune: compile` tunes them (trainer/compile/tiles/; for a MaxText space, what MaxText
takes tiles for: Splash): the tiles each limit admits, the best of them as the step model
prices them (an estimate, at compile fidelity)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from sweeper.answer.fold import say
from sweeper.cli.app import SetOpt, SpaceArg, TargetOpt, app, console, fail, overrides
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from trainer.trial.config import ConfigError
from trainer.trial.files import trainer_command

# TPU7x's VMEM is 64 MiB a TensorCore; libtpu's default scoped limit is below it.
DEFAULT_LIMITS = (16384, 32768, 49152, 65536)


@app.command()
def tiles(
    space: SpaceArg,
    vmem: Annotated[
        str | None,
        typer.Option(
            "--vmem",
            help="scoped VMEM limits in KiB, comma-separated (default: the space's "
            "xla.scoped_vmem_kib values, else 16, 32, 48 and 64 MiB)",
        ),
    ] = None,
    target: TargetOpt = None,
    set_: SetOpt = None,
) -> None:
    """Tune trial 0's kernel tiles under each scoped VMEM limit and print, per kernel, the
    tiles each limit admits and the best of them as the step model prices them."""
    try:
        loaded = load_space(space, overrides(None, None, None, target, set_))
        if loaded.target.topology is None:
            raise SpaceError(
                "the tuner compiles for a TPU target: use --target tpu7x:2x2x1", field="target"
            )
        limits = _limits(loaded, vmem)
        config = _trial_zero(loaded)
        more = _program_args(loaded)
    except (SpaceError, ValueError) as exc:
        fail(str(exc))
    started = time.perf_counter()
    with _progress() as bar:
        task = bar.add_task(f"tuning under {len(limits)} VMEM limits", total=None)

        def heard(said: dict[str, Any]) -> None:
            """A compile begun, or a limit done (its record): the bar moves to it."""
            if said.get("event") == "tuning":
                per = said["total"]
                bar.update(task, total=said["limits"] * per,
                           completed=said["limit"] * per + said["done"] - 1,
                           description=f"{limits[said['limit']]} KiB: {said['kernel']}")  # fmt: skip
            elif bar.tasks[0].total:  # a limit's record: every compile under it done
                limit = limits.index(said["vmem_kib"]) + 1
                bar.update(task, completed=limit * bar.tasks[0].total / len(limits))

        found = _run(config, limits, bar.console.print, more, heard)
    if not any(record["kernels"] for record in found):  # nothing tuned: no table of refusals
        untuned = sorted({u for r in found for u in r.get("untuned", [])})
        why = "; ".join(untuned) or "its program has no Splash or grouped-matmul kernel"
        say(console, f"{loaded.name}: trial 0 has no kernel the tuner tunes on "
                     f"{loaded.target} ({why})")  # fmt: skip
        return
    console.print(_table(loaded.name, str(loaded.target), found, time.perf_counter() - started))


def _progress() -> Progress:
    """The tuner's compiles begun of about how many, across the limits, and the time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=16),
        MofNCompleteColumn(),
        TextColumn("compiles,"),
        TimeRemainingColumn(),
        TextColumn("left"),
        console=console,
        transient=True,
    )


def _limits(space: Any, given: str | None) -> list[int]:
    if given:
        try:
            return [int(v) for v in given.split(",") if v.strip()]
        except ValueError:
            raise SpaceError(
                f"--vmem {given!r}: KiB as integers, e.g. 16384,65536", field="--vmem"
            ) from None
    knob = space.knobs.get("xla.scoped_vmem_kib")
    return sorted(int(v) for v in knob.values) if knob and knob.values else list(DEFAULT_LIMITS)


def _trial_zero(space: Any) -> dict[str, Any]:
    """Trial 0 (the first warm start, else the space's trial), as the trainer reads it."""
    from sweeper.space.checks import static_check
    from sweeper.space.points import first_point

    try:
        config = static_check(space, first_point(space), space.num_devices)
    except ConfigError as exc:
        raise SpaceError(exc.message, field=exc.field) from None
    data: dict[str, Any] = json.loads(config.to_json())
    data["compile_target"] = str(space.target)
    return data


def _program_args(space: Any) -> list[str]:
    """For a MaxText space, its trial's request: the tuner tunes what MaxText takes tiles for."""
    if space.program != "maxtext":
        return []
    from sweeper.execute.programs import program_of

    return program_of(space).args(space, {})


def _run(
    config: dict[str, Any],
    limits: list[int],
    say: Callable[[str], None],
    more: list[str],
    heard: Callable[[dict[str, Any]], None] = lambda said: None,
) -> list[dict[str, Any]]:
    """The tuner in a child process (libtpu is loaded there), one record per limit; `heard`
    is told of each compile it begins and of each record."""
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sweeper-tiles-") as tmp:
        path = Path(tmp) / "trial.json"
        path.write_text(json.dumps(config))
        argv = trainer_command(path, ["--tiles-vmem", ",".join(map(str, limits)), *more])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("event") == "failure":  # the trial cannot be built: whose field, why
                proc.kill()
                fail(f"{record.get('field') or 'trial'}: {record.get('message', '')}")
            heard(record)
            if record.get("event") == "tuning":
                continue
            took = "read from the cache" if record["cached"] else f"{record['seconds']:.0f} s"
            say(f"{record['vmem_kib']} KiB: {len(record['kernels'])} kernels tuned ({took})")
            found.append(record)
        code = proc.wait()
        if code:  # a crash, not the user's to fix: its last words
            said = proc.stderr.read()[-1500:] if proc.stderr else ""
            console.print(f"[red]error:[/red] the tuner failed (exit {code}): {said}")
            raise typer.Exit(1)
    return found


def _table(name: str, target: str, found: list[dict[str, Any]], took: float) -> Table:
    """One row per kernel, one column per limit: the chosen tiles, their priced time per call
    and how many candidates the compiler refused, and, where the choice is not trial 0's own
    tiles, those and their price (or the refusal); the last rows sum one call of each."""
    table = Table(title=f"{name}: trial 0's kernel tiles per scoped VMEM limit on {target} "
                        f"(tuned in {took:.0f} s; times are the step model's, per call)")  # fmt: skip
    table.add_column("kernel")
    for record in found:
        table.add_column(f"{record['vmem_kib'] // 1024} MiB", justify="right")
    kernels = list(dict.fromkeys(k["kernel"] for r in found for k in r["kernels"]))
    totals = [0.0] * len(found)
    own: list[float | None] = [0.0] * len(found)  # trial 0's tiles, None once one is refused
    for kernel in kernels:
        cells = []
        for i, record in enumerate(found):
            tuned = next((k for k in record["kernels"] if k["kernel"] == kernel), None)
            given, before = _given_seconds(tuned), own[i]
            cells.append(_cell(tuned, given, totals, i))
            own[i] = before + given if before is not None and given is not None else None
        table.add_row(kernel, *cells)
    table.add_row("all, one call each", *(f"{t * 1e6:,.1f} µs" if t else "-" for t in totals))
    table.add_row("trial 0's own tiles", *(f"{t * 1e6:,.1f} µs" if t else "refused" for t in own))
    untuned = {u for r in found for u in r.get("untuned", [])}
    if untuned:
        table.caption = "not tuned: " + "; ".join(sorted(untuned))
    return table


def _cell(tuned: dict[str, Any] | None, given: float | None, totals: list[float], i: int) -> str:
    """The chosen tiles, their price and refusals; beside them trial 0's own (priced `given`)."""
    if tuned is None:
        return "-"
    times = {tuple(t["blocks"]): t["seconds"] for t in tuned["tried"]}
    refused = sum(1 for t in tuned["tried"] if t["failure"])
    seconds = times.get(tuple(tuned["chosen"]))
    if seconds is None:
        return f"none fits ({refused} refused)"
    totals[i] += seconds
    tiles = "x".join(map(str, tuned["chosen"]))
    cell = f"{tiles} {seconds * 1e6:,.1f} µs ({refused}/{len(tuned['tried'])} refused)"
    if tuned["chosen"] == tuned["given"]:
        return cell + "\n= trial 0's own"
    price = f"{given * 1e6:,.1f} µs ({seconds / given:.3f}x)" if given else "refused"
    return cell + f"\ntrial 0's {'x'.join(map(str, tuned['given']))}: {price}"


def _given_seconds(tuned: dict[str, Any] | None) -> float | None:
    """Trial 0's own tiles' priced time per call (None where refused or not tuned)."""
    if tuned is None:
        return None
    given = tuple(tuned["given"])
    return next((t["seconds"] for t in tuned["tried"] if tuple(t["blocks"]) == given), None)
