"""A search space as typed data: its knobs, objective, constraints, search and resources, and
the space itself with the checks that need nothing but the space (files and trial
configurations are checked in `sweeper.space.load` and `sweeper.space.checks`)."""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any, Literal

from pydantic import Field, PlainSerializer, PlainValidator, WithJsonSchema, model_validator

from sweeper.space.file import MAX_CANDIDATES
from trainer.trial.config import RECIPE_HYPERPARAMETERS, TrialConfig
from trainer.trial.events import MEASURED_METRICS, Fidelity
from trainer.trial.hardware import Backend, Target, Topology
from trainer.trial.maxtext import KNOB_PREFIX, MaxTextProgram, check_knob_key
from trainer.trial.schema import Frozen

MAX_TRIALS = 100_000


def _target(value: Any) -> Target:
    if isinstance(value, Target):
        return value
    if not isinstance(value, str):
        raise ValueError("a target is text: local, gpu:N, or a TPU topology such as tpu7x:4x4x4")
    return Target.parse(value)


# A space's target: written as text, held parsed (`Target.parse`, the one reader).
TargetField = Annotated[
    Target,
    PlainValidator(_target),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string"}),
]


class Knob(Frozen):
    """One searchable trial-config key: categorical `values`, or an int/float range."""

    values: list[Any] | None = Field(default=None, max_length=MAX_CANDIDATES)
    """categorical choices."""
    low: float | None = Field(default=None, allow_inf_nan=False)
    """range low end (inclusive)."""
    high: float | None = Field(default=None, allow_inf_nan=False)
    """range high end (inclusive)."""
    step: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """range step."""
    log: bool = False
    """sample the range on a log scale."""
    type: Literal["categorical", "int", "float"] | None = None
    """force int or float for a range (default: int when every bound is whole)."""
    when: dict[str, Any] = Field(
        default_factory=dict,
        description="active only when these knobs have these values (a list: any of them)",
    )

    def met_by(self, point: dict[str, Any]) -> bool:
        """Whether `point` meets this knob's condition (it is then sampled)."""
        return all(
            point.get(k) in v if isinstance(v, list) else point.get(k) == v
            for k, v in self.when.items()
        )

    def condition_point(self) -> dict[str, Any]:
        """One point of the knobs its condition names that meets it (a list's first value)."""
        return {k: v[0] if isinstance(v, list) else v for k, v in self.when.items()}

    @model_validator(mode="after")
    def _check(self) -> Knob:
        if self.values is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either values or low/high, not both")
            if not self.values:
                raise ValueError("values must not be empty")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give values (categorical) or both low and high (range)")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("log ranges need low > 0")
        if self.log and self.step is not None:
            raise ValueError("step and log cannot be combined")
        return self

    @property
    def kind(self) -> str:
        if self.values is not None:
            return "categorical"
        if self.type:
            return self.type
        low, high = self.bounds
        ints = all(float(v).is_integer() for v in (low, high, self.step or 1))
        return "int" if ints else "float"

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high) of a range knob (the validator made sure a range has both)."""
        if self.low is None or self.high is None:
            raise ValueError("a categorical knob has values, not bounds")
        return self.low, self.high

    def candidates(self) -> list[Any] | None:
        """Every value when the knob is discrete; None when continuous."""
        if self.values is not None:
            return list(self.values)
        low, high = self.bounds
        if self.kind == "int":
            step = max(1, int(self.step or 1))
            if self.log or (high - low) / step >= MAX_CANDIDATES:
                return None
            return list(range(int(low), int(high) + 1, step))  # bounds inclusive (Optuna)
        if self.step is not None:
            n = math.floor((high - low) / self.step + 1e-9) + 1
            return [low + i * self.step for i in range(n)] if n <= MAX_CANDIDATES else None
        return None

    def extremes(self) -> list[Any]:
        """Every value of a discrete knob; a range's ends otherwise."""
        return self.candidates() or list(self.bounds)


class Objective(Frozen):
    metric: str = "tokens_per_sec_per_chip"
    """a trial result to optimize (measured by runs, est_* by estimate/compile)."""
    mode: Literal["max", "min"] = "max"
    """max or min."""


class Objectives(Frozen):
    primary: Objective = Objective()
    """what Optuna optimizes."""
    secondary: Objective | None = None
    """a second objective: makes a multi-objective (Pareto) study."""

    @property
    def metrics(self) -> list[str]:
        return [o.metric for o in self.all]

    @property
    def modes(self) -> list[str]:
        return [o.mode for o in self.all]

    @property
    def all(self) -> list[Objective]:
        return [self.primary] + ([self.secondary] if self.secondary else [])


class Constraints(Frozen):
    convergence: bool = True
    """trials must pass the loss check (sets trial convergence.enabled)."""
    tolerance: float | None = Field(default=None, gt=0)
    """relative loss tolerance of the check (default: 3x the recipe's seed noise, measured by
    its reference runs)."""
    max_memory_per_device_gib: float | None = Field(default=None, gt=0)
    """memory budget per device; more is oom_hbm."""


class Ladder(Frozen):
    """Three prices of an answer, spent in order: every point screened by the analytic
    estimate in this process, the best compiled for the target, the best of those run."""

    screen: int | None = Field(default=None, gt=0, le=1_000_000)
    """points screened (drawn at random with search.seed; default every point of the space)."""
    verify: int = Field(default=8, gt=0, le=MAX_TRIALS)
    """the best screened points that fit, compiled for the target (the verify rung's trials)."""
    edge: float | None = Field(default=None, ge=0, le=1)
    """also compile a point the screen judged within this fraction of the HBM limit (either
    side) when its est. tokens/s would place it among the `verify` best: the estimate's memory
    error could flip its verdict (default: that error as measured for the space's model,
    0.1 dense, 0.35 mixture-of-experts; docs/search.md)."""
    run: int = Field(default=0, ge=0, le=MAX_TRIALS)
    """the best compiled points run on the target's slices (a run-fidelity sweep of them)."""


class Search(Frozen):
    sampler: Literal["tpe", "gp", "cmaes", "random", "grid", "nsga2"] = "tpe"
    """Optuna sampler."""
    trials: int = Field(default=8, gt=0, le=MAX_TRIALS)
    """trials to run."""
    concurrency: int = Field(default=1, gt=0, le=4096)
    """trials at once."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """sampler seed."""
    startup_trials: int | None = Field(default=None, ge=0, le=MAX_TRIALS)
    """random trials before the model-based sampler takes over (default trials/3, at most 10)."""
    time_budget_s: float | None = Field(default=None, gt=0, le=365 * 86400)
    """stop starting trials after this long."""
    trial_timeout_s: float = Field(default=900, gt=0, le=7 * 86400)
    """a trial running longer is killed (failure class timeout)."""
    early_stopping: bool = False
    """ASHA: stop trials whose running throughput trails (single objective only)."""
    warm_start: list[dict[str, Any]] = Field(default_factory=list)
    """points (knob -> value) evaluated first."""
    ladder: Ladder | None = None
    """screen every point by the estimate, compile the best (`verify`), run the best of those
    (`run`): trials and sampler are then the ladder's (sweeper/ladder.py)."""
    remeasure: int | None = Field(default=None, ge=0, le=16)
    """run-fidelity sweeps: once every trial has ended, the best this many points run again
    (default 2; 0: none), so the table says whether the winner's lead survives a second
    measurement. Estimates and compiles are deterministic: nothing to re-measure."""
    profile_best: bool = True
    """run-fidelity sweeps: the best point's re-measurement traces its last two steps with
    the profiler (they are then not timed; its trace lands in its folder and on the point's
    MLflow run; the notes say when the re-measurements then made another point the best),
    unless the trials already profile (`trial.profile`)."""

    def remeasure_count(self, fidelity: str) -> int:
        """Points measured again at the end of a sweep of `fidelity` (its effective one)."""
        if fidelity != "run":
            return 0
        return 2 if self.remeasure is None else self.remeasure


class Resources(Frozen):
    cpus_per_trial: int | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="cores a local CPU trial reserves and its trainer is pinned to "
        "(default: the driver host's CPUs / search.concurrency)",
    )


class Space(Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """the sweep's name (MLflow experiment, Optuna study)."""
    description: str = ""
    """free text."""
    target: TargetField = Target()
    """local, gpu:N, or a TPU topology such as tpu7x:4x4x4."""
    devices: int | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="devices per trial with target local: simulated CPU devices (default 8), "
        "or GPUs/TPU chips of the driver host (default all)",
    )
    fidelity: Literal["auto", "estimate", "compile", "run"] = "auto"
    """estimate, compile (AOT for the TPU target), run; auto: run where the hardware is, else compile."""
    model: dict[str, Any]
    """the model config every trial starts from (trainer ModelConfig)."""
    trial: dict[str, Any] = Field(default_factory=dict)
    """trial config every trial starts from (trainer TrialConfig, minus model)."""
    objective: Objectives = Objectives()
    """what to optimize."""
    constraints: Constraints = Constraints()
    """what a trial must satisfy."""
    search: Search = Search()
    """how the search runs."""
    resources: Resources = Resources()
    """what each trial holds."""
    knobs: dict[str, Knob] = Field(default_factory=dict)
    """trial config keys (dotted paths) to search, and their values; `maxtext.<key>` sets a
    MaxText setting in a space of program maxtext."""
    program: Literal["sweeper-trainer", "maxtext"] = "sweeper-trainer"
    """what runs each trial: this project's trainer, or MaxText (compile or run fidelity)."""
    maxtext: MaxTextProgram | None = None
    """program maxtext: MaxText's Python, model_name, base config and extra settings."""

    @model_validator(mode="before")
    @classmethod
    def _objective_by_fidelity(cls, data: Any) -> Any:
        # Compile and estimate trials measure nothing: their default objective is the estimate.
        if not isinstance(data, dict) or "objective" in data:
            return data
        fidelity, target = data.get("fidelity", "auto"), data.get("target", "local")
        try:
            tpu = _target(target).is_tpu
        except ValueError:
            tpu = False  # the field's own validation says what is wrong with it
        if fidelity in ("compile", "estimate") or (fidelity == "auto" and tpu):
            data = {
                **data,
                "objective": {"primary": {"metric": "est_tokens_per_sec_per_chip", "mode": "max"}},
            }
        return data

    @model_validator(mode="after")
    def _check_fidelity(self) -> Space:
        if self.target.is_gpu:
            if self.effective_fidelity != Fidelity.RUN:
                raise ValueError(
                    f"fidelity: {self.fidelity} needs a TPU target (libtpu compiles for TPUs only); "
                    f"{self.target} trials run on the cluster's GPU hosts: use fidelity run"
                )
        elif self.target.is_multi_slice:
            self._check_multi_slice(self.target.tpu)
        if self.effective_fidelity in (Fidelity.COMPILE, Fidelity.ESTIMATE):
            if self.target.is_local:
                raise ValueError(
                    f"fidelity: {self.fidelity} needs a TPU target such as tpu7x:2x2x1, not local"
                )
            measured = [m for m in self.objective.metrics if m in MEASURED_METRICS]
            if measured:
                raise ValueError(
                    f"objective: {measured} are measurements, which {self.effective_fidelity} trials do not make; "
                    "use est_tokens_per_sec_per_chip (an estimate, labelled as such)"
                )
        return self

    def _check_multi_slice(self, topology: Topology) -> None:
        joined = (
            f"{self.target} is {topology.slices} {topology.prefix}:{topology.shape} slices joined "
            "by the data center network"
        )
        if self.program != "maxtext":
            raise ValueError(
                f"target: {joined}; this project's trainer compiles one slice (its mesh has no "
                f"DCN axes): run the space with program: maxtext (its dcn_* settings), or give "
                f"one slice such as {topology.prefix}:{topology.shape}"
            )
        if self.fidelity == "run":
            raise ValueError(
                f"fidelity: run on {joined}: a trial reserves one slice of the Ray cluster; "
                "compile multi-slice trials (fidelity compile)"
            )

    @model_validator(mode="after")
    def _check_ladder(self) -> Space:
        if self.search.ladder is None:
            return self
        if not self.is_tpu_target:
            raise ValueError(
                f"search.ladder: the ladder screens and compiles for a TPU target; target is "
                f"{self.target}: give a target such as tpu7x:4x4x4, or drop search.ladder"
            )
        if self.fidelity not in ("auto", "compile"):
            raise ValueError(
                f"search.ladder: the ladder sets each rung's fidelity (its verify rung compiles); "
                f"fidelity {self.fidelity} contradicts it: use fidelity auto"
            )
        return self

    @model_validator(mode="after")
    def _check_remeasure(self) -> Space:
        if self.search.remeasure and self.fidelity in ("estimate", "compile"):
            raise ValueError(
                f"search.remeasure: {self.fidelity} figures are deterministic (the same program "
                "gives the same figure): there is nothing to measure again; drop it or use "
                "fidelity run"
            )
        return self

    @model_validator(mode="after")
    def _check_program(self) -> Space:
        maxtext_knobs = [k for k in self.knobs if k.startswith(KNOB_PREFIX)]
        if self.program != "maxtext":
            if self.maxtext is not None:
                raise ValueError("maxtext: a maxtext section needs program: maxtext")
            if maxtext_knobs:
                raise ValueError(
                    f"knobs: {maxtext_knobs[0]} is a MaxText setting: it needs program: maxtext"
                )
            return self
        if self.effective_fidelity == "estimate":
            raise ValueError(
                "fidelity: MaxText trials are compiled or run (the analytic estimate is our "
                "trainer's model): use fidelity compile or run"
            )
        for key in maxtext_knobs:
            why = check_knob_key(key)
            if why:
                raise ValueError(f"knobs: {key}: {why}")
        return self

    def maxtext_program(self) -> MaxTextProgram:
        """The MaxText a maxtext space runs (its section, or the defaults)."""
        return self.maxtext or MaxTextProgram()

    @property
    def effective_fidelity(self) -> Fidelity:
        """auto: run where the target is attached (local, GPU hosts), compile for a TPU target
        (the engine makes it run when the Ray cluster has the target's slices)."""
        if self.fidelity != "auto":
            return Fidelity(self.fidelity)
        return Fidelity.COMPILE if self.target.is_tpu else Fidelity.RUN

    @property
    def default_backend(self) -> Backend:
        """The backend of the space's trials when nothing else is known: a compile target's
        TPU, the backend its trials ask for, else the target's (the engine passes the real one)."""
        if self.target.is_tpu and self.effective_fidelity != Fidelity.RUN:
            return Backend.TPU
        requested = str(self.trial.get("backend", "auto"))
        if requested in tuple(Backend):
            return Backend(requested)
        if self.target.is_local:
            return Backend.CPU
        return Backend.GPU if self.target.is_gpu else Backend.TPU

    @property
    def is_tpu_target(self) -> bool:
        return self.target.is_tpu

    @property
    def is_multi_slice(self) -> bool:
        return self.target.is_multi_slice

    @property
    def num_devices(self) -> int:
        if self.target.gpus is not None:
            return self.target.gpus
        if self.target.topology is not None:
            return self.target.topology.devices
        return self.devices or 8

    def base_trial(self) -> dict[str, Any]:
        """The trial configuration every sampled point is layered over."""
        base = copy.deepcopy(self.trial)
        base["model"] = copy.deepcopy(self.model)
        if self.effective_fidelity in (Fidelity.COMPILE, Fidelity.ESTIMATE):
            base["compile_target"] = str(self.target)
            base.setdefault("convergence", {})["enabled"] = False  # nothing trains
        if self.program == "maxtext":
            # The loss check runs a reference of our trainer: a MaxText trial's losses are
            # recorded per step, not judged against it.
            base.setdefault("convergence", {})["enabled"] = False
        convergence = base.setdefault("convergence", {})
        convergence.setdefault("enabled", self.constraints.convergence)
        convergence.setdefault("tolerance", self.constraints.tolerance)
        # A sampled hyperparameter is a deviation from the recipe, judged against its value.
        sampled = [k for k in RECIPE_HYPERPARAMETERS if k in self.knobs]
        if sampled:
            defaults = TrialConfig.model_fields
            convergence["recipe"] = {
                k: base.get(k, defaults[k].default) for k in sampled
            } | convergence.get("recipe", {})
        if self.constraints.max_memory_per_device_gib is not None:
            base.setdefault("limits", {})["device_memory_gib"] = (
                self.constraints.max_memory_per_device_gib
            )
        return base
