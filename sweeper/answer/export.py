"""A trial of a sweep, exported as what runs it elsewhere: MaxText's command line (the program
TPU7x teams run), the environment its flags go in, or a trial configuration that
`python -m trainer` reruns to the same program.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pandas as pd

from sweeper.answer.fold import folded
from sweeper.record.manifest import Found, results_dir_of, sweeper_command
from sweeper.record.row import REMEASURED, Column, TrialRow, knob_columns, missing, ranking_of
from sweeper.space.checks import static_check
from sweeper.space.errors import SpaceError
from sweeper.space.points import in_words, maxtext_knobs
from sweeper.space.schema import Knob, Space
from trainer.trial.config import TrialConfig
from trainer.trial.hardware import Backend
from trainer.trial.maxtext import MaxTextProgram, program_settings, to_maxtext

FORMATS = ("maxtext", "env", "trial")
# MaxText 0.2.5's pip package: its training entry point, and where its base config is.
MAXTEXT_TRAIN = "maxtext.trainers.pre_train.train"
MAXTEXT_BASE = "\"$(python3 -c 'import maxtext;print(*maxtext.__path__)')/configs/base.yml\""
WIDTH = 80  # the export's lines, its comments folded to it (a shell word may run past it)


def trial_config(
    space: Space, point: dict[str, Any], num_devices: int, cpu_cores: int | None = None
) -> TrialConfig:
    """The trial's configuration as it ran, made self-contained: its device count is in it
    (on CPU the trainer then makes that many simulated devices itself), and for a CPU trial
    pinned to cores by its sweep, how many (the trainer pins itself so)."""
    config = static_check(space, point, num_devices)
    if space.target.is_local:
        config = config.model_copy(update={"num_devices": num_devices, "cpu_cores": cpu_cores})
    return config


def cores_of(cell: Any) -> int | None:
    """How many cores a trial's row says it was pinned to (`cores`: "0,1"); None if none."""
    text = "" if missing(cell) else str(cell)
    if not text or not all(part.strip().isdigit() for part in text.split(",")):
        return None  # not pinned, or `unpinned`
    return len(text.split(","))


def xla_flags(config: TrialConfig) -> str:
    """The XLA_FLAGS a CPU trial's process needs for its simulated devices."""
    if config.backend == "cpu" and config.num_devices:
        return f"--xla_force_host_platform_device_count={config.num_devices}"
    return ""


def export(
    config: TrialConfig,
    fmt: str,
    header: list[str],
    maxtext: tuple[MaxTextProgram, dict[str, Any]] | None = None,
) -> str:
    """The text of one export format for `config`; `header` lines say which trial it is;
    `maxtext`: a MaxText sweep's program and the trial's `maxtext.*` knobs (its settings)."""
    if fmt == "trial":
        return config.to_json() + "\n"
    comments = "".join(f"# {line}\n" for said in header for line in folded(said, WIDTH - 2))
    if fmt == "env":
        flags = " ".join(config.xla.libtpu_init_args())
        return (
            f"{comments}LIBTPU_INIT_ARGS={shlex.quote(flags)}\n"
            f"XLA_FLAGS={shlex.quote(xla_flags(config))}\n"
        )
    if fmt != "maxtext":
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    platform = config.backend if config.backend != "auto" else "tpu"
    # The command that trains on the target's TPUs: compile_topology is train_compile's.
    config = config.model_copy(update={"compile_target": None})
    settings = (
        program_settings(config, *maxtext, Backend(platform))
        if maxtext
        else to_maxtext(config, Backend(platform))
    )
    lines = [
        f"{comments}# MaxText 0.2.5 (pip install 'maxtext[tpu]==0.2.5'), one process per host."
    ]
    if settings.unmapped:
        lines.append("# Not carried over: MaxText has no setting for")
        for u in settings.unmapped:
            said = folded(f"{u.field} = {json.dumps(u.value)}: {u.why}", WIDTH - 4)
            lines += [f"#   {line}" for line in said]
    lines.append(f"export LIBTPU_INIT_ARGS={flag_words(settings.libtpu_init_args)}")
    command = [f"python3 -m {MAXTEXT_TRAIN}", MAXTEXT_BASE, "run_name=sweeper-export"]
    command += [shlex.quote(arg) for arg in settings.argv()]
    lines.append(" \\\n  ".join(command))
    return "\n".join(lines) + "\n"


def settings_words(settings: dict[str, Any]) -> str:
    """`name=value` words, one each: a string as it is, other values as JSON without spaces."""

    def word(v: Any) -> str:
        return v if isinstance(v, str) and " " not in v else json.dumps(v, separators=(",", ":"))

    return " ".join(f"{k}={word(v)}" for k, v in settings.items())


def flag_words(flags: list[str]) -> str:
    """LIBTPU_INIT_ARGS's value for a shell: quoted on one line where that fits WIDTH, else
    a flag a line inside double quotes (bash drops each backslash-newline: one value)."""
    quoted = shlex.quote(" ".join(flags))
    if len(f"export LIBTPU_INIT_ARGS={quoted}") <= WIDTH or any(
        c in f for f in flags for c in '"$`\\'
    ):
        return quoted
    return '"\\\n' + " \\\n".join(flags) + '"'


def sampled(knob: Knob, cell: Any) -> Any:
    """A knob's value as sampled, from its results-table cell (which CSV made text)."""
    if missing(cell):
        return None
    if knob.values is not None:
        for value in knob.values:
            if value == cell or str(value) == str(cell) or json.dumps(value) == str(cell):
                return value
        raise SpaceError(f"{in_words(cell)} is not a value of this knob ({in_words(knob.values)})")
    number = float(cell)
    return int(number) if knob.kind == "int" else number


def export_trial(found: Found, frame: pd.DataFrame, trial_id: str | None, fmt: str) -> str:
    """One trial of a sweep (its best by default) in format `fmt`."""
    manifest = found.manifest
    assert manifest is not None, "a sweep found by id has a manifest"
    space = manifest.space
    trial_id = trial_id or manifest.ending.best_trial
    if not trial_id:
        raise SpaceError(
            f"sweep {manifest.sweep_id} has no best trial (none ended well); name one with --trial",
            field="--trial",
        )
    rows = frame[frame[Column.TRIAL_ID].astype(str) == str(trial_id)] if not frame.empty else frame
    if rows.empty:
        raise SpaceError(
            f"no trial {trial_id!r} in sweep {manifest.sweep_id} (`"
            f"{sweeper_command('show', manifest.sweep_id, results_dir=results_dir_of(found.path))}"
            "` lists them)",
            field="--trial",
        )
    row = rows.iloc[0]
    point = {}
    for column, name in knob_columns(frame.columns).items():
        value = sampled(space.knobs[name], row[column])
        if value is not None:
            point[name] = value
    config = trial_config(space, point, space.num_devices, cores_of(row.get(Column.CORES)))
    tuned = TrialRow.from_record({str(k): v for k, v in row.items()}).tuned
    if tuned:  # the tiles kernels.tune chose are the ones the trial ran
        kernels = config.kernels.tuned(tuned).model_copy(update={"tune": "off"})
        config = config.model_copy(update={"kernels": kernels})
    metric = space.objective.primary.metric
    value = row.get(metric)
    shown = "-" if missing(value) else f"{value:,.1f}"
    again: Any = row.get(f"{REMEASURED}{metric}")
    if not missing(value) and not missing(again):  # ranked by the mean of both
        shown += f" (measured again {again:,.1f}; their mean {ranking_of(value, again):,.1f})"
    header = [
        f"trial {trial_id} of sweep {manifest.sweep_id} ({space.name}): {metric} {shown}, "
        f"status {row[Column.STATUS]}, fidelity {row.get('fidelity') or '-'} on "
        f"{row.get('hardware') or '-'}",
        f"knobs: {settings_words(point)}",
        *([f"kernel tiles as kernels.tune chose them: {settings_words(tuned)}"] if tuned else []),
    ]
    program = (
        (space.maxtext_program(), maxtext_knobs(point)) if space.program == "maxtext" else None
    )
    return export(config, fmt, header, program)
