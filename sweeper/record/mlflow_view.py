"""What a person sees when they open a sweep in the MLflow UI: its experiment marked as model
training (MLflow 3's UI opens a GenAI overview otherwise), the space's description, and a
shared view of the sweep's runs: its trials sorted by the objective, the objective, memory
and knob columns chosen, charts of the objective against the knobs.

MLflow's web app reads a shared view from the experiment tag `mlflow.sharedViewState.KEY`
(JSON) when its URL carries `viewStateShareKey=KEY` (read from MLflow 3.17.2's bundle and
checked in headless Chromium). Names here: MLflow's own.
"""

from __future__ import annotations

import json
from typing import Any

from sweeper.record.row import RANKING, REMEASURED, short_names
from sweeper.space.schema import Space

EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
# MLflow 3.17's web app takes its workflow (GenAI or model training: the sidebar, the tabs, an
# experiment's landing page) from this URL parameter, else from the browser's local storage,
# else GenAI; its feature flag reads the experiment kind from that workflow, not from the
# experiment's tag (read from its bundle: the WorkflowType context, `Z0 = () => true`).
WORKFLOW = "workflowType=machine_learning"
NOTE = "mlflow.note.content"  # an experiment's or a run's description
VIEW_PREFIX = "mlflow.sharedViewState."
KNOB_PARAM = "knob."  # a sampled knob, as a run's param
TUNED_PARAM = "tuned."  # a kernel tile kernels.tune chose, as a run's param
TRIAL_PARAM = "trial."  # the rest of the trial's configuration, as a run's params
# The trial tags a person compares (status and failure, the verdict, where the figures are from).
TAG_COLUMNS = ("status", "failure_class", "convergence", "fidelity", "hardware", "remeasured")
SHOWN = 1000  # runs a chart compares


def experiment_tags(space: Space) -> dict[str, str]:
    description = space.description or f"Sweep space {space.name}."
    goal = ", ".join(f"{o.mode} {o.metric}" for o in space.objective.all)
    return {
        EXPERIMENT_KIND: MODEL_TRAINING,
        NOTE: f"{description}\n\nTarget {space.target}, fidelity {space.effective_fidelity}; "
        f"objective: {goal}. Each sweep is a parent run; its trials are its children.",
    }


def view_key(sweep_id: str) -> str:
    return f"sweep-{sweep_id}"


def _metric(name: str) -> str:
    return f"metrics.`{name}`"


def view_state(space: Space, sweep_id: str, parent_run_id: str) -> dict[str, Any]:
    """The sweep's runs table and charts, as MLflow's UI keeps a shared view."""
    objective = space.objective.primary
    mfu = "mfu" if space.effective_fidelity == "run" else "est_mfu"
    # Measuring points again, the trials rank by `ranking_<metric>` (the mean of a point's two
    # figures): sorted by it, as every other view ranks them.
    again = (
        [f"{REMEASURED}{objective.metric}", f"{RANKING}{objective.metric}"]
        if space.search.remeasure_count(space.effective_fidelity)
        else []
    )
    metrics = [objective.metric, *again, *space.objective.metrics, mfu, "hbm_per_device_gib"]
    varied = varied_knobs(space)
    params = [f"{KNOB_PARAM}{k}" for k in varied]
    charts = _charts(objective.metric, varied, params)
    columns = [
        *(_metric(m) for m in dict.fromkeys(metrics)),
        *(f"params.`{p}`" for p in params),
        *(f"tags.`{t}`" for t in TAG_COLUMNS),
    ]
    return {
        "searchFilter": f"tags.`sweeper.sweep_id` = '{sweep_id}'",
        "orderByKey": _metric(again[-1] if again else objective.metric),
        "orderByAsc": objective.mode == "min",
        "selectedColumns": columns,
        "columnOrder": columns,  # the objective first (the UI sorts them by name otherwise)
        "runsExpanded": {parent_run_id: True},
        # Every trial in the charts (the app's default shows the first 10 runs).
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": "sweeper",
                "name": "Sweep",
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isExpanded": True,
            }
        ],
    }


def _charts(metric: str, varied: list[str], params: list[str]) -> list[dict[str, Any]]:
    """The objective as bars, against memory, against each knob that varies (one chart
    each), and the knobs in parallel coordinates."""
    against = {"yaxis": {"key": metric, "type": "METRIC"}, "runsCountToCompare": SHOWN}
    charts: list[dict[str, Any]] = [
        _chart("objective", "BAR", metricKey=metric, runsCountToCompare=SHOWN),
        _chart(
            "memory", "SCATTER", xaxis={"key": "hbm_per_device_gib", "type": "METRIC"}, **against
        ),
        *(
            _chart(
                f"knob-{name}",
                "SCATTER",
                xaxis={"key": f"{KNOB_PARAM}{name}", "type": "PARAM"},
                **against,
            )
            for name in varied
        ),
    ]
    if params:
        charts.append(
            _chart(
                "knobs",
                "PARALLEL",
                selectedParams=params,
                selectedMetrics=[metric],
                showAllRuns=True,
            )
        )
    return charts


def _chart(uuid: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"uuid": uuid, "type": kind, "metricSectionId": "sweeper", "deleted": False,
            "isGenerated": False, **fields}  # fmt: skip


def view_tag(space: Space, sweep_id: str, parent_run_id: str) -> dict[str, str]:
    state = view_state(space, sweep_id, parent_run_id)
    return {f"{VIEW_PREFIX}{view_key(sweep_id)}": json.dumps(state)}


def runs_url(base: str, experiment_id: str, sweep_id: str, charts: bool = False) -> str:
    """The sweep's runs in the MLflow UI at `base` (http://host:port), in its model-training
    workflow (the app keeps the `workflowType` parameter on its own links)."""
    mode = "&compareRunsMode=CHART" if charts else ""
    return (
        f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
        f"?viewStateShareKey={view_key(sweep_id)}&{WORKFLOW}{mode}"
    )


def experiments_url(base: str) -> str:
    """The MLflow UI's list of experiments, in its model-training workflow."""
    return f"{base.rstrip('/')}/#/experiments?{WORKFLOW}"


def varied_knobs(space: Space) -> list[str]:
    """The knobs whose value can differ between the sweep's trials (more than one value)."""
    return [
        name
        for name, knob in space.knobs.items()
        if (values := knob.candidates()) is None or len(values) > 1
    ]


def run_name(trial_id: str, point: dict[str, Any], varied: list[str] | None = None) -> str:
    """A trial's run name: its id and the values of the knobs that vary in the sweep (last
    part of each knob's name, the whole name where two would read alike)."""
    point = {k: v for k, v in point.items() if varied is None or k in varied}
    short = short_names(point)
    parts = [f"{short[k]}={v}" for k, v in point.items()]
    return " ".join([trial_id, *parts])
