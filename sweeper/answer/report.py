"""A sweep's report: one self-contained HTML file (plots inline, nothing fetched from the
network), written beside summary.csv and logged to the sweep's parent run.

What it shows: the trials ranked by the objective; the objective against each knob; the
objective against memory per device with the Pareto front; the knobs' importances (Optuna,
over the trials that ran); the failure map (which knob values led to which failure
class); convergence deltas against their tolerance. Every figure says its fidelity and
hardware: an estimate is labelled an estimate, a CPU measurement a CPU measurement.
"""

from __future__ import annotations

import base64
import html
import io
import json
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the host has

import matplotlib.pyplot as plt
import pandas as pd

from sweeper.answer.table import (
    INTERVAL,
    constant_knobs,
    in_rank_order,
    ranking_figure,
    searched,
)
from sweeper.record.row import (
    KNOB_PREFIX,
    REMEASURED,
    TUNING_FILE,
    Column,
    knob_column,
    knob_columns,
    missing,
    short_names,
)
from sweeper.search.outcomes import Outcome
from sweeper.space.schema import Objective
from trainer.trial.events import FailureClass, TrialStatus
from trainer.trial.files import write_text

REPORT = "report.html"
FAILURE_CLASSES = tuple(c.value for c in FailureClass)
MEMORY = "hbm_per_device_gib"


def _png(figure: plt.Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _label(frame: pd.DataFrame) -> str:
    """The fidelity and hardware every figure of the sweep is at."""
    fidelities = sorted({str(f) for f in frame.get(Column.FIDELITY, []) if not missing(f) and f})
    hardware = sorted({str(h) for h in frame.get(Column.HARDWARE, []) if not missing(h) and h})
    what = {
        "run": "measured",
        "compile": "estimated from the compiled program",
        "estimate": "estimated by formula",
    }
    fidelity = ", ".join(f"{f} ({what.get(f, f)})" for f in fidelities) or "no fidelity"
    return f"fidelity {fidelity} on {', '.join(hardware) or 'no hardware'}"


def _numeric(series: pd.Series) -> bool:
    values = [v for v in series if not missing(v)]
    return bool(values) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    )


def varied(frame: pd.DataFrame) -> dict[str, str]:
    """column -> short name, for the knobs whose value differed between the trials."""
    same = constant_knobs(frame)
    knobs = {c: n for c, n in knob_columns(frame.columns).items() if n not in same}
    names = short_names(knobs.values())
    return {c: names[n] for c, n in knobs.items()}


def objective_by_knob(frame: pd.DataFrame, metric: str, label: str) -> list[str]:
    """One figure per knob that varied: the objective of each trial that ran against the
    knob's value; failures at the bottom, marked."""
    ok = frame[Column.STATUS] == TrialStatus.OK
    out = []
    for column, knob in varied(frame).items():
        figure, axis = plt.subplots(figsize=(6.4, 3.6))
        values = frame[column].map(lambda v: "-" if missing(v) else v)
        order = (
            sorted(set(values), key=lambda v: (str(type(v)), v))
            if not _numeric(frame[column])
            else sorted(set(values) - {"-"}) + (["-"] if "-" in set(values) else [])
        )
        position = {v: i for i, v in enumerate(order)}
        x = values.map(position)
        axis.scatter(x[ok], frame.loc[ok, metric], color="tab:blue", label="ran")
        if (~ok).any():
            floor = frame.loc[ok, metric].min() if ok.any() else 0.0
            axis.scatter(x[~ok], [floor * 0.9] * int((~ok).sum()), marker="x",
                         color="tab:red", label="failed (placed below)")  # fmt: skip
        axis.set_xticks(range(len(order)), [str(v) for v in order], rotation=20, fontsize=9)
        axis.set_xlabel(knob)
        axis.set_ylabel(metric)
        axis.legend(fontsize=8)
        axis.set_title(f"{metric} against {knob} ({label})", fontsize=10)
        out.append(_png(figure))
    return out


def memory_unit(values: pd.Series) -> tuple[str, float]:
    """The unit memory reads best in, and the factor from GiB: MiB below 1 GiB."""
    largest = values.abs().max() if len(values) else 0.0
    return ("MiB", 1024.0) if largest < 1 else ("GiB", 1.0)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both counts: less memory and more throughput."""
    front: list[tuple[float, float]] = []
    for memory, value in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or value > front[-1][1]:
            front.append((memory, value))
    return front


def memory_tradeoff(frame: pd.DataFrame, metric: str, label: str) -> str | None:
    """The objective against memory per device, with the Pareto front."""
    if MEMORY not in frame:
        return None
    ran = frame[
        (frame[Column.STATUS] == TrialStatus.OK) & frame[MEMORY].notna() & frame[metric].notna()
    ]
    if ran.empty:
        return None
    unit, factor = memory_unit(ran[MEMORY])
    memory = ran[MEMORY] * factor
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    axis.scatter(memory, ran[metric], color="tab:blue", label="trials that ran")
    front = pareto_front(list(zip(memory, ran[metric], strict=True)))
    axis.plot([m for m, _ in front], [v for _, v in front], color="tab:orange", marker="o",
              label="Pareto front")  # fmt: skip
    for (_, row), m in zip(ran.iterrows(), memory, strict=True):
        axis.annotate(str(row[Column.TRIAL_ID]), (m, row[metric]), fontsize=6)
    axis.set_xlabel(f"memory per device, {unit}")
    axis.set_ylabel(metric)
    axis.legend(fontsize=8)
    axis.set_title(f"{metric} against memory per device ({label})", fontsize=10)
    return _png(figure)


def ladder_plot(frame: pd.DataFrame, metric: str, label: str) -> str | None:
    """A ladder's two rungs side by side: each compiled point's est. tokens/s by the screen
    (analytic estimate) against the compile's, coloured by whether it compiled to fit."""
    screen = "screen_est_tokens_per_sec_per_chip"
    if screen not in frame or metric not in frame:
        return None
    judged = frame[frame[screen].notna()]
    if judged.empty:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    ok = judged[(judged[Column.STATUS] == TrialStatus.OK) & judged[metric].notna()]
    axis.scatter(ok[screen], ok[metric], color="tab:blue", label="compiled, fits")
    failed = judged[judged[Column.STATUS] != TrialStatus.OK]
    for _, row in failed.iterrows():
        axis.axvline(row[screen], color="tab:red", alpha=0.4, linewidth=1)
    if not failed.empty:
        axis.plot([], [], color="tab:red", label="compile failed (oom, invalid): its screen figure")
    for _, row in ok.iterrows():
        rank = row.get("screen_rank")
        label = "" if missing(rank) else f"s{rank:.0f}"  # the screen's rank
        axis.annotate(label, (row[screen], row[metric]), fontsize=6)
    axis.set_xlabel("screen: est. tokens/s per chip (analytic estimate)")
    axis.set_ylabel(f"verify: {metric}")
    axis.legend(fontsize=8)
    axis.set_title(f"The ladder: screen against compile ({label})", fontsize=10)
    return _png(figure)


def remeasure_plot(frame: pd.DataFrame, metric: str, label: str) -> str | None:
    """The points measured again: each one's first and second figure, with their 95%
    intervals where the run has them, so a lead that does not survive shows."""
    again = f"{REMEASURED}{metric}"
    if again not in frame or metric not in frame:
        return None
    both = frame[frame[again].notna() & frame[metric].notna()]
    if both.empty:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 0.9 + 0.6 * len(both)))
    low, high = INTERVAL.get(metric, (None, None))
    for i, (_, row) in enumerate(both.iterrows()):
        for shift, prefix, colour, name in ((-0.12, "", "tab:blue", "first"),
                                            (0.12, REMEASURED, "tab:orange", "again")):  # fmt: skip
            value = row[f"{prefix}{metric}"]
            span = None
            if (
                low
                and not missing(row.get(f"{prefix}{low}"))
                and not missing(row.get(f"{prefix}{high}"))
            ):
                span = [[value - row[f"{prefix}{low}"]], [row[f"{prefix}{high}"] - value]]
            axis.errorbar(value, i + shift, xerr=span, fmt="o", color=colour, capsize=3,
                          label=name if i == 0 else None)  # fmt: skip
    axis.set_yticks(range(len(both)), [str(t) for t in both[Column.TRIAL_ID]], fontsize=8)
    axis.set_ylim(-0.5, len(both) - 0.5)
    axis.set_xlabel(f"{metric} (95% interval of the median step where measured)")
    axis.legend(fontsize=8)
    axis.set_title(f"The best points, measured again ({label})", fontsize=10)
    return _png(figure)


def history_plot(frame: pd.DataFrame, metric: str, maximize: bool, label: str) -> str | None:
    """The search's progress: each trial's objective in the order the trials started, and
    the best so far."""
    if "started_at" not in frame or frame.empty:
        return None
    ordered = frame.sort_values("started_at", na_position="last").reset_index(drop=True)
    values = [None if missing(v) else float(v) for v in ordered[metric]]
    if all(v is None for v in values):
        return None
    best, best_so_far = None, []
    for value in values:
        if value is not None and (best is None or (value > best if maximize else value < best)):
            best = value
        best_so_far.append(best)
    figure, axis = plt.subplots(figsize=(6.4, 3.2))
    xs = range(1, len(values) + 1)
    axis.scatter([x for x, v in zip(xs, values, strict=True) if v is not None],
                 [v for v in values if v is not None], color="tab:blue", label="trial")  # fmt: skip
    axis.step(list(xs), [b if b is not None else float("nan") for b in best_so_far],
              where="post", color="tab:orange", label="best so far")  # fmt: skip
    axis.set_xlabel("trial, in the order they started")
    axis.set_ylabel(metric)
    axis.legend(fontsize=8)
    axis.set_title(f"search progress ({label})", fontsize=10)
    return _png(figure)


def importances_plot(importances: dict[str, float], label: str) -> str | None:
    if not importances:
        return None
    names = list(importances)[::-1]
    figure, axis = plt.subplots(figsize=(6.4, 0.4 * len(names) + 1.2))
    axis.barh(names, [importances[n] for n in names], color="tab:green")
    axis.set_xlabel("importance (Optuna's fANOVA over the trials that ran)")
    axis.set_title(f"knob importances ({label})", fontsize=10)
    return _png(figure)


def failure_map(frame: pd.DataFrame, label: str) -> str | None:
    """For each knob value, how many trials ended in each failure class."""
    if Column.STATUS not in frame:
        return None
    failed = frame[frame[Column.STATUS] != TrialStatus.OK]
    knobs = varied(searched(frame))
    if failed.empty or not knobs:
        return None
    rows, cells = [], []
    classes = [c for c in FAILURE_CLASSES if c in set(failed[Column.FAILURE_CLASS])]
    classes += sorted({c for c in failed[Column.FAILURE_CLASS] if c and c not in classes})
    if not classes:
        classes = ["(killed or stopped)"]
    for column, knob in knobs.items():
        for value in sorted({str(v) for v in frame[column]}):
            of_value = failed[failed[column].map(str) == value]
            rows.append(f"{knob}={value}")
            cells.append(
                [int((of_value[Column.FAILURE_CLASS].fillna("") == c).sum()) for c in classes]
                if classes != ["(killed or stopped)"]
                else [len(of_value)]
            )
    figure, axis = plt.subplots(figsize=(1.2 * len(classes) + 3, 0.35 * len(rows) + 1.5))
    image = axis.imshow(cells, cmap="Reds", aspect="auto")
    axis.set_xticks(range(len(classes)), classes, rotation=30, fontsize=8)
    axis.set_yticks(range(len(rows)), rows, fontsize=8)
    for i, row in enumerate(cells):
        for j, count in enumerate(row):
            if count:
                axis.text(j, i, str(count), ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axis, label="failed trials")
    axis.set_title(f"failures by knob value ({label})", fontsize=10)
    return _png(figure)


def convergence_plot(frame: pd.DataFrame, label: str) -> str | None:
    """Each checked trial's final loss against its reference, on the deltas' own scale; the
    tolerance drawn where the scale reaches it and stated where it does not."""
    if "convergence_relative_delta" not in frame:
        return None
    checked = frame[frame["convergence_relative_delta"].notna()]
    if checked.empty:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 3.4))
    ids = [str(t) for t in checked[Column.TRIAL_ID]]
    deltas = list(checked["convergence_relative_delta"] * 100)
    colors = [
        "tab:blue" if p is True or p == 1 else "tab:red" for p in checked[Column.CONVERGENCE_PASSED]
    ]
    axis.bar(ids, deltas, color=colors)
    tolerance = float(checked["convergence_tolerance"].max() * 100)
    reach = max(max(abs(d) for d in deltas), 1e-6) * 1.4
    if tolerance <= reach * 2:  # within reach of the deltas' scale: drawn
        reach = max(reach, tolerance * 1.15)
        for sign in (1, -1):
            axis.axhline(sign * tolerance, color="gray", linestyle="--")
        axis.text(0.01, 0.97, f"tolerance +-{tolerance:.3g}%", transform=axis.transAxes,
                  fontsize=8, va="top", color="gray")  # fmt: skip
    else:
        axis.text(0.01, 0.97, f"tolerance +-{tolerance:.3g}%: {tolerance / reach:,.0f}x beyond "
                  "this scale", transform=axis.transAxes, fontsize=8, va="top", color="gray")  # fmt: skip
    axis.set_ylim(-reach, reach)
    axis.axhline(0, color="black", linewidth=0.6)
    axis.set_ylabel("final loss against the reference, %")
    axis.tick_params(axis="x", labelrotation=45, labelsize=7)
    axis.set_title(f"convergence: loss against the bf16 reference ({label})", fontsize=10)
    return _png(figure)


def convergence_words(frame: pd.DataFrame) -> str:
    """What the check's verdict means in this sweep: how wide its tolerance was."""
    if "convergence_tolerance" not in frame or frame["convergence_tolerance"].isna().all():
        return ""
    tolerance = frame["convergence_tolerance"].dropna()
    low, high = tolerance.min() * 100, tolerance.max() * 100
    width = f"+-{high:.3g}%" if low == high else f"+-{low:.3g}% to +-{high:.3g}%"
    deltas = frame.get("convergence_relative_delta", pd.Series(dtype=float)).dropna().abs()
    largest = f"; the largest |delta| was {deltas.max() * 100:.3g}%" if len(deltas) else ""
    loose = (
        " A tolerance this wide passes large losses: read `passed` as `did not diverge`."
        if high >= 5
        else ""
    )
    return (
        f"A trial passes when its final loss lies within {width} of its recipe's reference "
        f"run (the tolerance: 3x the recipe's seed noise, unless the space sets one){largest}."
        f"{loose}"
    )


def ranked_table(frame: pd.DataFrame, metric: str, maximize: bool, rows: int = 20) -> str:
    """The trials best first; knobs that never varied are stated once above the table."""
    frame = searched(frame)  # a re-measurement shows as its point's second figure
    knobs = varied(frame)
    unit, factor = memory_unit(frame[MEMORY].dropna() if MEMORY in frame else pd.Series())
    memory = f"memory/device, {unit}"
    frame = frame.assign(**{memory: frame[MEMORY] * factor}) if MEMORY in frame else frame
    again = f"{REMEASURED}{metric}"
    mean = "mean of both measurements"  # what a point measured again ranks by
    if again in frame and frame[again].notna().any():
        frame = frame.assign(**{mean: ranking_figure(frame, metric).where(frame[again].notna())})
    columns = ["trial_id", "status", "failure_class", metric, again, mean, memory,
               "convergence_passed", "screen_rank", "screen_compiled_for", "verify_rank",
               *knobs]  # fmt: skip
    order = Objective(metric=metric, mode="max" if maximize else "min")
    shown = in_rank_order(frame, order).head(rows)
    head = "".join(
        f"<th>{html.escape(knobs.get(c, c))}</th>" for c in columns if c in frame.columns
    )
    body = []
    for _, row in shown.iterrows():
        cells = []
        for column in columns:
            if column not in frame.columns:
                continue
            value = row[column]
            text = (
                ""
                if missing(value)
                else f"{value:.0f}"  # a rank (a float where some trials have none)
                if column.endswith("_rank")
                else f"{value:,.2f}"
                if isinstance(value, float)
                else value
            )
            cells.append(f"<td>{html.escape(str(text))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    same = constant_knobs(frame)
    names = short_names(same)
    held = (
        "<p class='note'>the same in every trial: "
        + html.escape(", ".join(f"{names[k]}={v}" for k, v in same.items()))
        + "</p>"
        if same
        else ""
    )
    return f"{held}<table><tr>{head}</tr>{''.join(body)}</table>"


def tuned_table(frame: pd.DataFrame, metric: str) -> str | None:
    """The kernel tiles `kernels.tune` chose in each trial that tuned: one column a trial,
    one row a setting (Splash's blocks, tokamax's tiles per weight and pass, Megablox's),
    under the trial's objective and its scoped VMEM limit where that varied: what each limit
    unlocked. None without any."""
    if Column.TUNED not in frame:
        return None
    rows = [(r, json.loads(r[Column.TUNED])) for _, r in frame.iterrows()
            if isinstance(r[Column.TUNED], str) and r[Column.TUNED]]  # fmt: skip
    if not rows:
        return None
    settings = sorted({k for _, t in rows for k in t})
    vmem = knob_column("xla.scoped_vmem_kib")
    front = [metric, *([vmem] if vmem in frame else [])]
    head = "<th></th>" + "".join(f"<th>{html.escape(str(r['trial_id']))}</th>" for r, _ in rows)
    body = []
    for name in front + settings:
        cells = [row[name] if name in front else tuned.get(name, "") for row, tuned in rows]
        text = [
            "" if missing(v) else f"{v:,.2f}" if isinstance(v, float) else str(v) for v in cells
        ]
        label = html.escape(name.removeprefix(KNOB_PREFIX))
        body.append(f"<tr><th>{label}</th>" + "".join(f"<td>{html.escape(t)}</td>" for t in text)
                    + "</tr>")  # fmt: skip
    note = (
        "<p class='note'>each kernel compiled alone with candidate tiles under the trial's "
        "scoped VMEM limit, the compiler's refusals dropped, the rest priced by the step model "
        "(compile fidelity: estimates) or timed by tune-jax on the trial's TPU (run fidelity); "
        f"every candidate is in the trial's {TUNING_FILE} and its MLflow run</p>"
    )
    return f"{note}<table><tr>{head}</tr>{''.join(body)}</table>"


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;
font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}
h2{margin-top:1.6em}.note{color:#555;font-size:13px}img{max-width:100%}"""


def render(
    frame: pd.DataFrame,
    *,
    title: str,
    metric: str,
    maximize: bool,
    notes: list[str],
    importances: dict[str, float],
) -> str:
    """The report as one HTML document."""
    label = _label(frame)
    sections = [
        (
            "Ranked trials",
            ranked_table(frame, metric, maximize) if not frame.empty else "<p>no trials</p>",
        ),
    ]
    tuned = tuned_table(frame, metric)
    if tuned:
        sections.append(("Kernel tiles the tuner chose", tuned))
    search = searched(frame)  # the search's own trials; re-measurements have their figure
    figures: dict[str, str | list[str] | None] = {
        "The objective against each knob that varied": objective_by_knob(search, metric, label),
        "Throughput against memory": memory_tradeoff(search, metric, label),
        "Search progress": history_plot(search, metric, maximize, label),
        "Knob importances": importances_plot(importances, label),
        "Failure map": failure_map(frame, label),
        "Convergence": convergence_plot(frame, label),
    }
    if f"{REMEASURED}{metric}" in frame:
        figures["The best points, measured again"] = remeasure_plot(frame, metric, label)
    if "screen_rank" in frame:  # a ladder's sweep
        figures["The ladder: screen against compile"] = ladder_plot(frame, metric, label)
    words = {
        "Convergence": convergence_words(frame),
        "Knob importances": importance_words(frame, importances),
    }
    for name, png in figures.items():
        pngs = png if isinstance(png, list) else [png] if png else []
        body = (
            "".join(
                f'<img alt="{html.escape(name)}" src="data:image/png;base64,{one}">' for one in pngs
            )
            or '<p class="note">nothing to plot in this sweep</p>'
        )
        if words.get(name):
            body = f"<p class='note'>{html.escape(words[name])}</p>{body}"
        sections.append((name, body))
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    parts = "".join(f"<h2>{html.escape(h)}</h2>{b}" for h, b in sections)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p class='note'>{html.escape(label)}; objective {html.escape(metric)} "
        f"({'higher' if maximize else 'lower'} is better)</p>{parts}"
        f"<h2>Notes</h2><ul>{notes_html}</ul></body></html>"
    )


def importances_of(study: Any, sweep_id: str) -> dict[str, float]:
    """Optuna's knob importances over this sweep's trials that ran (its fANOVA), for the knobs
    whose value differed between them (a knob held at one value explains nothing, though the
    forest would apportion it a share); empty when fewer than two ran or no knob varied."""
    import optuna

    ran = [
        t
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if t.user_attrs.get("sweep_id") == sweep_id and t.user_attrs.get("outcome") == Outcome.OK
    ]
    if len(ran) < 2 or len(study.directions) != 1 or len({t.value for t in ran}) < 2:
        return {}  # one value: nothing for a knob to explain
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created" line
    try:
        alone = optuna.create_study(direction=study.direction)
    finally:
        optuna.logging.set_verbosity(verbosity)
    alone.add_trials(ran)
    names = sorted({name for t in ran for name in t.params})
    varied = [n for n in names if len({repr(t.params.get(n)) for t in ran}) > 1]
    if not varied:
        return {}
    try:
        with warnings.catch_warnings():
            # fANOVA's warning that a value ran in fewer than 2 trials: the report says it in
            # words (importance_words), not as a UserWarning on the terminal.
            warnings.filterwarnings("ignore", "Some regimes for parameter", UserWarning)
            return dict(optuna.importance.get_param_importances(alone, params=varied))
    except (RuntimeError, ValueError):  # a single distinct point: nothing to apportion
        return {}


def importance_words(frame: pd.DataFrame, importances: dict[str, float]) -> str:
    """What the importances rest on, where some value of a knob they rank ran in fewer than
    two of the trials that ended well (each such value's share is then a guess)."""
    ok = searched(frame)
    ok = ok[ok[Column.STATUS] == TrialStatus.OK] if Column.STATUS in ok else ok.iloc[:0]
    thin = []
    for column, name in knob_columns(ok.columns).items():
        if name not in importances:
            continue
        counts = ok[column][~ok[column].map(missing)].map(str).value_counts()  # where active
        few = sorted(str(v) for v, n in counts.items() if n < 2)
        if few:
            thin.append(f"{name} ({', '.join(few)})")
    if not thin:
        return ""
    return (
        "some values ran in fewer than two of the trials that ended well, so the shares of "
        f"their knobs are rough: {'; '.join(thin)}"
    )


def write_report(
    sweep_dir: Path,
    frame: pd.DataFrame,
    *,
    title: str,
    metric: str,
    maximize: bool,
    notes: list[str],
    importances: dict[str, float],
) -> Path:
    path = sweep_dir / REPORT
    text = render(
        frame, title=title, metric=metric, maximize=maximize, notes=notes, importances=importances
    )
    return write_text(path, text)
