"""The sweep engine: a configured Ray Tune Tuner (Optuna ask/tell searcher + trainer trials + MLflow)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import ray
import yaml
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from sweeper import results
from sweeper.inert import effect_caveats, pin_inert
from sweeper.placement import (
    Placement,
    alive_hosts,
    compile_placement,
    driver_host,
    find_slices,
    resolve,
)
from sweeper.progress import ProgressCallback
from sweeper.search import (
    SweepSearch,
    check_sampler,
    check_study,
    close_open_trials,
    make_sampler,
)
from sweeper.space import (
    Space,
    SpaceError,
    assemble,
    check_feasible,
    check_warm_start,
    count_points,
    load_space,
    space_overrides,
)
from sweeper.tracking import (
    Tracker,
    TrackingCallback,
    check_tracking_server,
    default_tracking_uri,
)
from sweeper.trainable import TrialRuntime, failure_result, run_trial
from trainer.events import ENDED, FailureClass, TrialStatus

REPO_RESULTS = Path(__file__).resolve().parents[1] / "results"
MANIFEST = "sweep.json"  # in the sweep folder: what `sweeper resume` needs to reattach
JOURNAL = "tracking_journal.json"  # MLflow writes waiting for the store to come back
ID_MAP = "mlflow_runs.json"  # trial -> MLflow run, and each trial's attempts
# A trial whose Ray worker or host died is retried this many times (a trial fault never is).
INFRA_RETRIES = 2
# Seconds between saves of Tune's experiment state (Tune's default: 10 s or more). A trial
# started within this window of a driver's death is unknown to a resume; its records are
# closed as killed and Tune runs another in its place.
TUNE_STATE_EVERY_S = "2"


@dataclass
class SweepContext:
    """Where a sweep's durable state lives, and who owns it."""

    space: Space
    sweep_id: str
    results_dir: Path
    tracking_uri: str
    tracker: Tracker
    tracking: TrackingCallback
    study_name: str
    optuna_storage: str
    placement: Placement
    storage: str
    concurrency: int
    inert_notes: list[str] = field(default_factory=list)
    placement_notes: list[str] = field(default_factory=list)
    result: SweepResult | None = None
    searcher: Any = None  # the SweepSearch, to close trials an interruption cut off
    interrupted: bool = False
    own_study: bool = True  # False when --study continues a study shared with other sweeps

    @property
    def sweep_dir(self) -> Path:
        return self.results_dir / self.space.name / self.sweep_id


@dataclass
class SweepResult:
    """What a sweep produced: every trial (one row each), the best feasible one, and the record ids."""

    space: str
    sweep_id: str
    trials: pd.DataFrame
    best: dict[str, Any] | None
    experiment_id: str
    parent_run_id: str
    tracking_uri: str
    study_name: str
    optuna_storage: str
    sweep_dir: Path
    counts: dict[str, int] = field(default_factory=dict)
    # Values pinned before sampling, and knobs the trials reported inert/emulated/interpreted.
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C / SIGTERM ended it; its running trials were killed
    journaled: int = 0  # MLflow records still waiting in the journal (the store was down)
    space_used: Space | None = None  # the space as run: fidelity resolved, inert values pinned

    def study(self) -> optuna.Study:
        return optuna.load_study(study_name=self.study_name, storage=self.optuna_storage)


# A run-fidelity trial measures what an estimate only predicts: the measured twin of each.
MEASURED_TWIN = {
    "est_tokens_per_sec_per_chip": "tokens_per_sec_per_chip",
    "est_mfu": "mfu",
    "est_step_time_s": "step_time_median_s",
}


def with_fidelity(space: Space, fidelity: str) -> Space:
    """`auto` made concrete; a run keeps the objective but optimises its measured twin."""
    data = space.model_dump(mode="json")
    data["fidelity"] = fidelity
    if fidelity == "run":
        for objective in filter(None, data["objective"].values()):
            metric = objective["metric"]
            if metric.startswith("est_"):
                if metric not in MEASURED_TWIN:
                    raise SpaceError(
                        f"{metric} is an estimate and the trials will run on the cluster's hardware; "
                        f"use one of {sorted(MEASURED_TWIN.values())} or fidelity compile",
                        field="objective",
                    )
                objective["metric"] = MEASURED_TWIN[metric]
    return Space.model_validate(data)


def place(space: Space) -> tuple[Space, Placement]:
    """Read the Ray cluster: resolve `auto` fidelity and where each trial runs.

    Raises SpaceError, before any trial, when the cluster cannot hold the space's trials.
    """
    hosts = alive_hosts()
    driver = driver_host(hosts)
    if space.fidelity == "auto" and space.is_tpu_target:
        slices, _ = find_slices(hosts, space.target)
        space = with_fidelity(space, "run" if slices else "compile")
    if space.effective_fidelity == "run":
        return space, resolve(space, hosts, driver)
    return space, compile_placement(space, hosts)


def cap_grid(space: Space) -> tuple[Space, list[str]]:
    """A grid sweep runs each point once: more trials than points would repeat them."""
    points = count_points(space)
    if space.search.sampler != "grid" or points is None or space.search.trials <= points:
        return space, []
    search = space.search.model_copy(update={"trials": points})
    note = f"search.trials {space.search.trials} capped at {points}: the grid has {points} points"
    return space.model_copy(update={"search": search}), [note]


def start_ray(address: str | None = None) -> None:
    """Attach to `address`, or start a private local Ray (never a stray cluster in /tmp/ray)."""
    if ray.is_initialized():
        return
    ray.init(
        address=address or "local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
        # Remote nodes import the engine and trainer from the driver's copy of the code.
        runtime_env=shipped_code() if address else None,
    )


def shipped_code() -> dict[str, Any]:
    import sweeper
    import trainer

    return {"py_modules": [str(Path(m.__file__).parent) for m in (sweeper, trainer)]}


def check_flags(space: Space) -> None:
    """An unknown LIBTPU flag would abort every trial that carries it: refuse it before the sweep."""
    if space.target == "local":
        return
    from trainer.config import load_config
    from trainer.flags import unknown_flag

    for key, knob in {"trial": None, **space.knobs}.items():
        values = [None] if knob is None else (knob.values or [])
        for value in values:
            point = {} if knob is None else {key: value}
            try:
                flags = load_config(assemble(space, point)).xla.libtpu_init_args()
            except Exception:
                continue  # invalid points are reported by the knob checks
            rejected = unknown_flag(tuple(flags))
            if rejected:
                field = "trial.xla" if knob is None else f"knobs.{key}"
                raise SpaceError(f"{rejected}; libtpu would abort every trial with it", field=field)


def check_space(
    space: Space, backend: str | None = None, num_devices: int | None = None
) -> tuple[Space, list[str]]:
    """The one validation path of a space, for `sweeper validate` and for every sweep: LIBTPU
    flags, values inert on `backend` pinned away (with a note each), then warm-start points,
    feasibility on `num_devices` and the sampler, on the space as it will be sampled.
    Raises SpaceError naming the field."""
    check_flags(space)
    pinned, notes = pin_inert(space, backend)
    on = f" on {backend}" if backend else ""
    check_warm_start(pinned, why=f" once values inert{on} are pinned away")
    check_feasible(pinned, num_devices)
    try:
        check_sampler(pinned)
    except ValueError as exc:
        message = str(exc).removeprefix("search.sampler: ")
        raise SpaceError(message, field="search.sampler") from None
    return pinned, notes


def new_sweep_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def prepare(
    space: Space,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    sweep_id: str | None = None,
    storage: str | None = None,
    study: str | None = None,
) -> SweepContext:
    start_ray()
    space, placement = place(space)
    backend = placement.backend if space.effective_fidelity == "run" else None
    space, inert_notes = check_space(space, backend, placement.num_devices)
    space, grid_note = cap_grid(space)
    results_dir = Path(results_dir or REPO_RESULTS).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    storage = storage or str(results_dir)
    tracking_uri = tracking_uri or default_tracking_uri(results_dir)
    check_tracking_server(tracking_uri)
    sweep_id = sweep_id or new_sweep_id()
    optuna_storage = f"sqlite:///{results_dir / 'optuna.db'}"
    study_name = study or f"{space.name}-{sweep_id}"
    try:
        check_study(space, study_name, optuna_storage)
    except ValueError as exc:
        raise SpaceError(str(exc), field="--study") from None
    sweep_dir = results_dir / space.name / sweep_id
    sweep_dir.mkdir(parents=True, exist_ok=True)
    concurrency = min(space.search.concurrency, placement.capacity)
    placement_notes = [f"placement: {placement.description}", *grid_note]
    if concurrency < space.search.concurrency:
        placement_notes.append(
            f"search.concurrency {space.search.concurrency} capped at {concurrency}: "
            f"the cluster holds {placement.capacity} such trial{'s' if placement.capacity > 1 else ''} at once"
        )
    tracker = Tracker(
        tracking_uri, space, sweep_id, results_dir / "mlartifacts", sweep_dir / JOURNAL
    )
    tracker.start_sweep(
        yaml.safe_dump(space.model_dump(mode="json"), sort_keys=False),
        {
            "target": space.target,
            "fidelity": space.effective_fidelity,
            "sampler": space.search.sampler,
            "backend": placement.backend,
            "placement": placement.description,
            "inert": "; ".join(inert_notes) or "none",
        },
    )
    return SweepContext(
        space=space,
        sweep_id=sweep_id,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        tracker=tracker,
        tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
        study_name=study_name,
        optuna_storage=optuna_storage,
        placement=placement,
        storage=storage,
        concurrency=concurrency,
        inert_notes=inert_notes,
        placement_notes=placement_notes,
        own_study=study is None,
    )


def build_tuner(
    space: Space | str | Path,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    callbacks: list[tune.Callback] | None = None,
    progress: bool = False,
    context: SweepContext | None = None,
    storage: str | None = None,
    study: str | None = None,
    **overrides: Any,
) -> tune.Tuner:
    """A ready Tuner for this space; pipelines may add callbacks and run it on their own cluster.

    Uses the Ray the caller initialized (its own cluster), or starts a private local one.
    The cluster is read here: trials reserve what the placement says (a whole TPU slice,
    the driver host's GPUs, or its CPU cores), and a target the cluster lacks is refused.
    `storage` is a path every node sees (Tune's experiment state and the convergence
    cache); default results_dir. `study` continues an existing Optuna study (points it
    measured are reused, not run again). The sweep's MLflow parent run is opened here and
    closed when the Tuner's experiment ends.
    """
    if not isinstance(space, Space):
        space = load_space(space, space_overrides(overrides))
    elif overrides:
        raise TypeError(
            "overrides apply when the space is loaded: pass a path or name, or edit the Space"
        )
    ctx = context or prepare(
        space, results_dir=results_dir, tracking_uri=tracking_uri, storage=storage, study=study
    )
    finalize(ctx)
    write_manifest(ctx)
    trainable, tune_config, run_config = tuner_parts(ctx, callbacks, progress)
    tuner = tune.Tuner(trainable, tune_config=tune_config, run_config=run_config)
    tuner.sweep_context = ctx  # for run_sweep and pipelines that want the ids
    return tuner


def finalize(ctx: SweepContext) -> None:
    """The trial base every trial of the sweep shares: where the trainers run, the cache."""
    space = ctx.space
    base = space.base_trial()
    if space.effective_fidelity == "run":
        base["backend"] = ctx.placement.backend  # the trainers run where the sweep reserved
    # The convergence reference cache lives in the sweep's storage, which every node reads.
    base.setdefault("convergence", {}).setdefault("cache_dir", f"{ctx.storage}/cache")
    ctx.space = space.model_copy(update={"trial": {k: v for k, v in base.items() if k != "model"}})


def tuner_parts(
    ctx: SweepContext,
    callbacks: list[tune.Callback] | None = None,
    progress: bool = False,
    recorded: dict[str, dict[str, Any]] | None = None,
) -> tuple[Any, tune.TuneConfig, tune.RunConfig]:
    """The trainable, Tune config (searcher, scheduler) and run config (callbacks) of a sweep."""
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", TUNE_STATE_EVERY_S)
    space, placement = ctx.space, ctx.placement
    runtime = TrialRuntime(placement=placement, timeout_s=space.search.trial_timeout_s)
    objective = space.objective
    single = objective.secondary is None
    searcher = SweepSearch(
        space,
        sweep_id=ctx.sweep_id,
        metric=objective.primary.metric if single else objective.metrics,
        mode=objective.primary.mode if single else objective.modes,
        sampler=make_sampler(space),
        study_name=ctx.study_name,
        storage=optuna.storages.RDBStorage(ctx.optuna_storage),
        points_to_evaluate=space.search.warm_start or None,
    )
    ctx.searcher = searcher
    scheduler = None
    if space.search.early_stopping and single:
        steps = int(space.trial.get("steps", 20))
        scheduler = ASHAScheduler(
            time_attr="training_iteration",
            metric=objective.primary.metric,
            mode=objective.primary.mode,
            max_t=steps + 1,
            grace_period=max(3, steps // 4),
        )
    all_callbacks: list[tune.Callback] = [ctx.tracking, FinishCallback(ctx)]
    if progress:
        all_callbacks.append(ProgressCallback(space))
    all_callbacks += callbacks or []
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, space=space, runtime=runtime, recorded=recorded or {}),
        placement.trial_resources,
    )
    tune_config = tune.TuneConfig(
        search_alg=searcher,
        scheduler=scheduler,
        num_samples=space.search.trials,
        max_concurrent_trials=ctx.concurrency,
        time_budget_s=space.search.time_budget_s,
        reuse_actors=False,
        trial_dirname_creator=lambda trial: f"trial_{trial.trial_id}",
    )
    run_config = tune.RunConfig(
        name=ctx.study_name if ctx.own_study else f"{ctx.study_name}-{ctx.sweep_id}",
        storage_path=f"{ctx.storage}/ray",
        callbacks=all_callbacks,
        # A trial whose worker or host died is retried; a trial fault is a result, never raised.
        failure_config=tune.FailureConfig(max_failures=INFRA_RETRIES, fail_fast=False),
        verbose=0,
    )
    return trainable, tune_config, run_config


def write_manifest(ctx: SweepContext) -> None:
    manifest = {
        "sweep_id": ctx.sweep_id,
        "space": ctx.space.model_dump(mode="json"),
        "study_name": ctx.study_name,
        "own_study": ctx.own_study,
        "optuna_storage": ctx.optuna_storage,
        "tracking_uri": ctx.tracking_uri,
        "experiment_id": ctx.tracker.experiment_id,
        "parent_run_id": ctx.tracker.parent_run_id,
        "storage": ctx.storage,
        "inert_notes": ctx.inert_notes,
    }
    ctx.sweep_dir.mkdir(parents=True, exist_ok=True)
    (ctx.sweep_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))


class FinishCallback(tune.Callback):
    """Closes the sweep when Tune's experiment ends: summary files and the parent run."""

    def __init__(self, ctx: SweepContext):
        self.ctx = ctx

    def on_experiment_end(self, trials, **info):
        # Trials that started and never completed were cut off by Ctrl-C / SIGTERM (Tune
        # marks them TERMINATED when it stops them): close their records.
        tracking = self.ctx.tracking
        cut = [
            t
            for t in trials
            if t.trial_id in tracking.run_ids
            and t.trial_id not in tracking.finished
            and t.status != "ERROR"
            and (t.last_result or {}).get("trial_status") not in ENDED
        ]
        for trial in cut:
            self.ctx.tracking.kill(trial)
        if self.ctx.searcher is not None:
            self.ctx.searcher.fail_unfinished("killed: the sweep was interrupted")
        self.ctx.interrupted = bool(cut)
        self.ctx.result = finish(self.ctx, trials)


def _best(frame: pd.DataFrame, space: Space) -> dict[str, Any] | None:
    primary = space.objective.primary
    ok = frame[frame["status"] == TrialStatus.OK] if not frame.empty else frame
    if ok.empty:
        return None
    ranked = ok.sort_values(primary.metric, ascending=primary.mode == "min")
    return ranked.iloc[0].to_dict()


def close_leftovers(ctx: SweepContext) -> list[str]:
    """Close what a killed driver left open: Optuna trials and MLflow runs still RUNNING."""
    notes = []
    study = optuna.load_study(study_name=ctx.study_name, storage=ctx.optuna_storage)
    closed = close_open_trials(study, ctx.sweep_id, ctx.own_study)
    if closed:
        notes.append(f"closed {closed} Optuna trial(s) a killed driver left RUNNING (FAIL)")
    if not len(ctx.tracker.journal):
        killed = ctx.tracker.close_leftovers()
        if killed:
            notes.append(f"closed {killed} MLflow run(s) a killed driver left RUNNING (KILLED)")
    return notes


def finish(ctx: SweepContext, trials: list | None = None) -> SweepResult:
    """Summary files, notes and the parent run, from Tune's trials (restored ones included)."""
    tracking = ctx.tracking
    rows = results.rows(
        trials if trials is not None else tracking.seen.values(),
        tracking.finals,
        tracking.run_id,
        tracking.attempts,
    )
    frame = pd.DataFrame(rows)
    counts = {"total": len(frame)}
    if not frame.empty:
        counts.update(frame["status"].value_counts().to_dict())
    best = _best(frame, ctx.space)
    ctx.sweep_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(ctx.sweep_dir / "summary.csv", index=False)
    if best:
        point = {
            k.removeprefix("knob:"): v
            for k, v in best.items()
            if k.startswith("knob:") and not _missing(v)
        }
        (ctx.sweep_dir / "best.yaml").write_text(
            yaml.safe_dump(
                {
                    "trial_id": best["trial_id"],
                    "knobs": point,
                    "trial": assemble(ctx.space, point),
                    ctx.space.objective.primary.metric: float(
                        best[ctx.space.objective.primary.metric]
                    ),
                    "fidelity": best.get("fidelity"),
                    "hardware": best.get("hardware"),
                },
                sort_keys=False,
            )
        )
    notes = [
        *ctx.placement_notes,
        *(f"pinned: {n}" for n in ctx.inert_notes),
        *effect_caveats(list(frame["effects"]) if "effects" in frame else []),
    ]
    if "reused_from" in frame and frame["reused_from"].notna().any():
        reused = int(frame["reused_from"].notna().sum())
        notes.append(f"reused: {reused} trial(s) asked for a point this study had measured")
    if ctx.interrupted:
        notes.append("interrupted: trials still running were killed and recorded as such")
    notes += close_leftovers(ctx)
    ctx.tracker.flush()  # a store back by now: the outage is in the notes MLflow keeps
    notes += ctx.tracker.outages
    told = len(ctx.tracker.outages)
    ctx.tracker.finish_sweep(
        best, counts, status="KILLED" if ctx.interrupted else "FINISHED", notes=notes
    )
    journaled = ctx.tracker.flush()
    notes += ctx.tracker.outages[told:]
    if journaled:
        notes.append(
            f"tracking store still unreachable: {journaled} MLflow records wait in "
            f"{ctx.tracker.journal.path}; `sweeper resume {ctx.sweep_id}` replays them once it answers"
        )
    return SweepResult(
        space=ctx.space.name,
        sweep_id=ctx.sweep_id,
        trials=frame,
        best=best,
        experiment_id=ctx.tracker.experiment_id,
        parent_run_id=ctx.tracker.parent_run_id,
        tracking_uri=ctx.tracking_uri,
        study_name=ctx.study_name,
        optuna_storage=ctx.optuna_storage,
        sweep_dir=ctx.sweep_dir,
        notes=notes,
        counts=counts,
        interrupted=ctx.interrupted,
        journaled=journaled,
        space_used=ctx.space,
    )


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def run_sweep(
    space: Space | str | Path | None = None,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    progress: bool = False,
    callbacks: list[tune.Callback] | None = None,
    storage: str | None = None,
    study: str | None = None,
    resume: str | None = None,
    **overrides: Any,
) -> SweepResult:
    """Run a whole sweep and return its result; overrides are dotted space keys (`search.trials=4`).

    `resume=SWEEP_ID` continues a sweep whose driver died or was stopped instead.
    """
    if resume is not None:
        if space is not None or overrides:
            raise TypeError("resume continues a sweep as it was: pass no space or overrides")
        tuner = restore_tuner(resume, results_dir=results_dir, tracking_uri=tracking_uri,
                              progress=progress, callbacks=callbacks)  # fmt: skip
    else:
        tuner = build_tuner(
            space,
            results_dir=results_dir,
            tracking_uri=tracking_uri,
            progress=progress,
            callbacks=callbacks,
            storage=storage,
            study=study,
            **overrides,
        )
    ctx: SweepContext = tuner.sweep_context
    tuner.fit()
    return ctx.result or finish(ctx)


def find_sweep(sweep_id: str, results_dir: Path) -> Path:
    found = sorted(results_dir.glob(f"*/{sweep_id}/{MANIFEST}"))
    if not found:
        known = sorted(p.parent.name for p in results_dir.glob(f"*/*/{MANIFEST}"))[-5:]
        raise SpaceError(
            f"no sweep {sweep_id!r} under {results_dir} (latest: {', '.join(known) or 'none'}); "
            "pass the id `sweeper run` printed, and the same --results-dir",
            file="sweeper resume",
            field="SWEEP_ID",
        )
    return found[0].parent


def resume_context(
    sweep_id: str, results_dir: Path | None = None, tracking_uri: str | None = None
) -> SweepContext:
    """The context of a sweep begun earlier: its space, study, MLflow runs and Tune state."""
    results_dir = Path(results_dir or REPO_RESULTS).resolve()
    sweep_dir = find_sweep(sweep_id, results_dir)
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    space = Space.model_validate(manifest["space"])
    start_ray()
    _, placement = place(space)
    tracking_uri = tracking_uri or manifest["tracking_uri"]
    check_tracking_server(tracking_uri)
    tracker = Tracker(tracking_uri, space, sweep_id, results_dir / "mlartifacts",
                      sweep_dir / JOURNAL, parent_run_id=manifest["parent_run_id"])  # fmt: skip
    tracker.tag(
        tracker.parent_run_id, {"resumed_at": dt.datetime.now().isoformat(timespec="seconds")}
    )
    ctx = SweepContext(
        space=space,
        sweep_id=sweep_id,
        results_dir=results_dir,
        tracking_uri=tracking_uri,
        tracker=tracker,
        tracking=TrackingCallback(tracker, sweep_dir / ID_MAP),
        study_name=manifest["study_name"],
        optuna_storage=manifest["optuna_storage"],
        placement=placement,
        storage=manifest["storage"],
        concurrency=min(space.search.concurrency, placement.capacity),
        inert_notes=manifest["inert_notes"],
        placement_notes=[f"placement: {placement.description}", f"resumed sweep {sweep_id}"],
        own_study=manifest["own_study"],
    )
    return ctx


def recorded_results(ctx: SweepContext) -> dict[str, dict[str, Any]]:
    """Trials Tune will restart that must not run again, by Tune trial id, with their result.

    Told to Optuna before the driver died (Tune's checkpoint is older): their stored
    result. Interrupted once already (attempts >= 2): a failure; a trial is retried once.
    """
    recorded: dict[str, dict[str, Any]] = {}
    study = optuna.load_study(study_name=ctx.study_name, storage=ctx.optuna_storage)
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        tune_id = attrs.get("tune_trial_id")
        if not tune_id or attrs.get("sweep_id") != ctx.sweep_id:
            continue
        if trial.state.is_finished() and "result" in attrs:
            recorded[tune_id] = attrs["result"]
        elif not trial.state.is_finished() and ctx.tracking.attempts.get(tune_id, 0) >= 2:
            recorded[tune_id] = failure_result(
                FailureClass.CRASHED,
                "interrupted twice (the sweep's driver died while it ran); not retried again",
            )
    return recorded


def restore_tuner(
    sweep_id: str,
    *,
    results_dir: Path | None = None,
    tracking_uri: str | None = None,
    progress: bool = False,
    callbacks: list[tune.Callback] | None = None,
) -> tune.Tuner:
    """Tune's experiment, the Optuna study and the MLflow runs of `sweep_id`, reattached.

    Finished trials stay finished; trials the driver's death cut off run again once.
    """
    ctx = resume_context(sweep_id, results_dir, tracking_uri)
    trainable, _, run_config = tuner_parts(ctx, callbacks, progress, recorded_results(ctx))
    ctx.searcher = None  # Tune restores its own searcher (the pickled one, with its state)
    path = f"{run_config.storage_path}/{run_config.name}"
    if not tune.Tuner.can_restore(path):
        raise SpaceError(
            f"sweep {sweep_id}: no Tune experiment state at {path} (did the first trial start?)",
            file="sweeper resume",
            field="SWEEP_ID",
        )
    tuner = tune.Tuner.restore(
        path, trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
    )
    # Tune revives the callbacks pickled when the sweep began, with their memory of then;
    # the resumed sweep reports to callbacks rebuilt from the durable records instead.
    restored = tuner._local_tuner.get_run_config()
    restored.callbacks = run_config.callbacks
    restored.failure_config = run_config.failure_config
    tuner.sweep_context = ctx
    return tuner
