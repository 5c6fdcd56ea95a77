"""Search-space YAML: schema, safe loading with file/line/field errors, and trial assembly."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from sweeper.spacefile import MAX_CANDIDATES, SpaceFileError, read_space_file
from trainer.spec.checks import check_static
from trainer.spec.config import RECIPE_HYPERPARAMETERS, ConfigError, TrialConfig, load_config
from trainer.spec.events import MEASURED_METRICS
from trainer.spec.hardware import Topology
from trainer.spec.maxtext import KNOB_PREFIX, MaxTextProgram, check_knob_key, to_maxtext
from trainer.spec.schema import Frozen, first_error

SPACES_DIR = Path(__file__).resolve().parents[1] / "search_spaces"
KEY_SEPARATOR = "."
MAX_TRIALS = 100_000


class SpaceError(ValueError):
    """A space a user can fix: names the file, line (when known) and field."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        where = file or "<space>"
        if line is not None:
            where += f":{line}"
        super().__init__(f"{where}: {field + ': ' if field else ''}{message}")
        self.file, self.line, self.field, self.message = file, line, field, message


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
        default_factory=dict, description="active only when these knobs have these values"
    )

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
    edge: float = Field(default=0.1, ge=0, le=1)
    """also compile a point the screen judged within this fraction of the HBM limit (either
    side) when its est. tokens/s would place it among the `verify` best: the estimate's memory
    error could flip its verdict."""
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

    def remeasure_count(self, fidelity: str) -> int:
        """Points measured again at the end of a sweep of `fidelity` (its effective one)."""
        if fidelity != "run":
            return 0
        return 2 if self.remeasure is None else self.remeasure


def gpus_in(target: str) -> int | None:
    """GPUs per trial of a `gpu:N` target (N GPUs on one host of the cluster); None otherwise."""
    prefix, _, count = target.partition(":")
    if prefix != "gpu":
        return None
    if not count.isdigit() or not 0 < int(count) <= 64:
        raise ValueError(f"target: {target!r}: a GPU target is gpu:N, N GPUs per trial on one host")
    return int(count)


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
    target: str = "local"
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
        tpu = isinstance(target, str) and target != "local" and gpus_in(target) is None
        if fidelity in ("compile", "estimate") or (fidelity == "auto" and tpu):
            data = {
                **data,
                "objective": {"primary": {"metric": "est_tokens_per_sec_per_chip", "mode": "max"}},
            }
        return data

    @model_validator(mode="after")
    def _check_fidelity(self) -> Space:
        if gpus_in(self.target) is not None:
            if self.effective_fidelity != "run":
                raise ValueError(
                    f"fidelity: {self.fidelity} needs a TPU target (libtpu compiles for TPUs only); "
                    f"{self.target} trials run on the cluster's GPU hosts: use fidelity run"
                )
        elif self.target != "local":
            try:
                topology = Topology.parse(self.target)
            except ValueError as exc:
                raise ValueError(f"target: {exc}") from None
            if topology.slices > 1:
                self._check_multi_slice(topology)
        if self.effective_fidelity in ("compile", "estimate"):
            if self.target == "local":
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
        if self.program != "sweeper-trainer":
            raise ValueError(
                "search.ladder: the screen is our trainer's estimate, which cannot judge MaxText "
                "settings: use the ladder with program sweeper-trainer"
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
    def effective_fidelity(self) -> str:
        """auto: run where the target is attached (local, GPU hosts), compile for a TPU target
        (the engine makes it run when the Ray cluster has the target's slices)."""
        if self.fidelity != "auto":
            return self.fidelity
        return "compile" if self.is_tpu_target else "run"

    @property
    def is_tpu_target(self) -> bool:
        return self.target != "local" and gpus_in(self.target) is None

    @property
    def is_multi_slice(self) -> bool:
        return self.is_tpu_target and Topology.parse(self.target).slices > 1

    @property
    def num_devices(self) -> int:
        if self.target == "local":
            return self.devices or 8
        gpus = gpus_in(self.target)
        if gpus is not None:
            return gpus
        return Topology.parse(self.target).devices

    def base_trial(self) -> dict[str, Any]:
        """The trial configuration every sampled point is layered over."""
        base = copy.deepcopy(self.trial)
        base["model"] = copy.deepcopy(self.model)
        if self.effective_fidelity in ("compile", "estimate"):
            base["compile_target"] = self.target
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


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(KEY_SEPARATOR)
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpaceError(
                f"{'.'.join(parts)} crosses a non-mapping value", field=f"knobs.{dotted}"
            )
    node[parts[-1]] = value


def set_override(data: dict[str, Any], dotted: str, value: Any, file: str = "<space>") -> None:
    """`--set` / API override of any space key; knob names contain the separator, so
    `knobs.mesh.tensor.values=[1,2]` addresses the knob `mesh.tensor` (an existing one, or a
    new one when the whole definition is given: `knobs.mesh.tensor={values: [1, 2]}`)."""
    if not dotted or any(not part for part in dotted.split(KEY_SEPARATOR)):
        raise SpaceError(
            f"{dotted!r} is not a dotted key such as trial.steps", file=file, field="--set"
        )
    if dotted.startswith("knobs" + KEY_SEPARATOR):
        knobs = data.setdefault("knobs", {})
        if not isinstance(knobs, dict):
            raise SpaceError("knobs is not a mapping", file=file, field="knobs")
        rest = dotted.removeprefix("knobs" + KEY_SEPARATOR)
        name = max(
            (k for k in knobs if rest == k or rest.startswith(k + KEY_SEPARATOR)),
            key=len,
            default=rest,
        )
        if name == rest:
            knobs[name] = value
        else:
            if not isinstance(knobs[name], dict):
                raise SpaceError(
                    f"knob {name!r} is not a mapping", file=file, field=f"knobs.{name}"
                )
            set_path(knobs[name], rest.removeprefix(name + KEY_SEPARATOR), value)
        return
    try:
        set_path(data, dotted, value)
    except SpaceError as exc:
        raise SpaceError(exc.message, file=file, field=f"--set {dotted}") from None


def assemble(space: Space, point: dict[str, Any]) -> dict[str, Any]:
    """Trial configuration dict for a sampled point (knob path -> value); `maxtext.*` knobs
    are MaxText's settings, not the trial configuration's (`maxtext_knobs`)."""
    trial = space.base_trial()
    for key, value in point.items():
        if not key.startswith(KNOB_PREFIX):
            set_path(trial, key, value)
    return trial


def maxtext_knobs(point: dict[str, Any]) -> dict[str, Any]:
    """A point's MaxText settings (`maxtext.<key>` knobs)."""
    return {k: v for k, v in point.items() if k.startswith(KNOB_PREFIX)}


def active(knob: Knob, point: dict[str, Any]) -> bool:
    return all(point.get(k) == v for k, v in knob.when.items())


# ---------------------------------------------------------------- loading


def resolve_path(spec: str | Path) -> Path:
    """A path, or a built-in space: a bare name (`moe_short`) or `spaces/moe_short.yaml`.

    Any other path must exist: a typo in a path never falls back to a built-in space.
    """
    path = Path(spec)
    if path.is_file():
        return path
    known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
    if path.exists():  # a directory, a FIFO, a device: there, but no space file
        what = (
            "is a directory"
            if path.is_dir()
            else "is not a regular file (a FIFO, device or socket)"
        )
        raise SpaceError(
            f"{what}, not a space file; give a YAML file, or a built-in space by name ({known})",
            file=str(spec),
        )
    builtin_form = path.parent == Path("spaces") and path.suffix == ".yaml"
    bare = len(path.parts) == 1 and not path.suffix
    if bare or builtin_form:
        builtin = SPACES_DIR / f"{path.stem}.yaml"
        if builtin.is_file():
            return builtin
        raise SpaceError(
            f"no built-in space named {path.stem!r} (built-in: {known})", file=str(spec)
        )
    raise SpaceError(
        f"no such file; give a YAML file, or a built-in space by name ({known})", file=str(spec)
    )


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == str(part)), None)
            if match is None:
                key = next((k for k, _ in node.value if k.value == str(part)), None)
                return (key.start_mark.line + 1) if key else line
            node = match
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
        else:
            break
        line = node.start_mark.line + 1
    return line


def load_space(spec: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> Space:
    """Load, validate and check a space; every error names file, line and field."""
    if isinstance(spec, dict):
        data, root, file = copy.deepcopy(spec), None, "<dict>"
    else:
        path = resolve_path(spec)
        file = str(path)
        try:
            data, root = read_space_file(path)
        except SpaceFileError as exc:
            raise SpaceError(exc.message, file=file, line=exc.line) from None
        except OSError as exc:
            raise SpaceError(f"cannot read it: {exc.strerror or exc}", file=file) from None
    for key, value in (overrides or {}).items():
        set_override(data, key, value, file)
    try:
        space = Space.model_validate(data)
    except ValidationError as exc:
        loc, message = first_error(exc)
        dotted = ".".join(map(str, loc))
        given = next(
            (k for k in overrides or {} if dotted == k or dotted.startswith(k + ".")), None
        )
        if given is not None:  # the value came from the command line (or the API), not the file
            raise SpaceError(
                f"{message} (as given: --set {given}={overrides[given]!r}, or its flag)",  # type: ignore[index]
                file=file,
                field=dotted,
            ) from None
        raise SpaceError(message, file=file, line=_line_of(root, loc), field=dotted) from None
    _check_knobs(space, root, file)
    return space


def _check_knobs(space: Space, root: yaml.Node | None, file: str) -> None:
    """Each knob value, with its conditions met, must make a valid trial configuration."""
    try:
        load_config(space.base_trial())
    except ConfigError as exc:
        # Name the key where it sits in the space: model.* under `model`, the rest under `trial`.
        loc = (
            tuple(exc.field.split("."))
            if exc.field.startswith("model")
            else ("trial", *exc.field.split("."))
        )
        raise SpaceError(
            exc.message, file=file, line=_line_of(root, loc), field=".".join(loc)
        ) from None
    order = list(space.knobs)
    for key, knob in space.knobs.items():
        for parent in knob.when:
            if parent not in space.knobs or order.index(parent) > order.index(key):
                raise SpaceError(
                    f"condition on {parent!r}, which is not a knob listed before this one",
                    file=file,
                    line=_line_of(root, ("knobs", key, "when")),
                    field=f"knobs.{key}.when",
                )
        values = knob.extremes()
        for value in values:
            point = dict(knob.when)
            point[key] = int(value) if knob.kind == "int" else value
            try:
                load_config(assemble(space, point))
            except ConfigError as exc:
                raise SpaceError(
                    f"value {value!r} makes an invalid trial: {exc}",
                    file=file,
                    line=_line_of(root, ("knobs", key)),
                    field=f"knobs.{key}",
                ) from None
    if space.program == "maxtext":
        _check_maxtext(space, root, file)
    check_warm_start(space, file, root)


# What a MaxText trial handles itself though MaxText has no setting for it: its data is
# MaxText's synthetic data, its devices the slice's, its warm-up steps skipped by the driver.
_MAXTEXT_HANDLED = frozenset({"data.source", "num_devices", "measure.skip_steps"})


def _check_maxtext(space: Space, root: yaml.Node | None, file: str) -> None:
    """A MaxText space: every setting of its trials, and every value of every knob, is one
    MaxText can take; what it cannot is refused by name before any trial runs."""
    platform = target_backend(space)
    for u in to_maxtext(load_config(space.base_trial()), platform).unmapped:
        if u.field not in _MAXTEXT_HANDLED:
            raise SpaceError(
                f"{u.field} = {u.value!r}: MaxText has no setting for it ({u.why}); remove "
                "it, or run the space with program: sweeper-trainer",
                file=file,
                line=_line_of(root, ("trial", *u.field.split("."))),
                field=f"trial.{u.field}",
            )
    for key, knob in space.knobs.items():
        if key.startswith(KNOB_PREFIX):
            continue
        for value in knob.extremes():
            point = {**knob.when, key: int(value) if knob.kind == "int" else value}
            config = load_config(assemble(space, point))
            for u in to_maxtext(config, platform).unmapped:
                if u.field == key or u.field.startswith(key + ".") or key.startswith(u.field + "."):
                    raise SpaceError(
                        f"value {value!r}: MaxText has no setting for {u.field} = {u.value!r} "
                        f"({u.why}); remove the value, or run the space with program: "
                        "sweeper-trainer",
                        file=file,
                        line=_line_of(root, ("knobs", key)),
                        field=f"knobs.{key}",
                    )


def _admits(knob: Knob, value: Any) -> bool:
    """Whether the knob can take `value` (True is not 1 here: YAML keeps them apart)."""
    if knob.values is not None:
        return any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in knob.values
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    low, high = knob.bounds
    return low <= value <= high and (knob.kind != "int" or float(value).is_integer())


def check_warm_start(
    space: Space, file: str | None = None, root: yaml.Node | None = None, why: str = ""
) -> None:
    """Every warm-start point: known keys, each value one its knob can take (`why` says
    what shaped the knob, e.g. pinning), conditions met, and a valid trial configuration."""
    for i, point in enumerate(space.search.warm_start):
        line = _line_of(root, ("search", "warm_start", i))
        unknown = sorted(set(point) - set(space.knobs))
        if unknown:
            raise SpaceError(
                f"keys {unknown} are not knobs of this space",
                file=file,
                line=line,
                field=f"search.warm_start.{i}",
            )
        for key, value in point.items():
            knob = space.knobs[key]
            if not active(knob, point):
                raise SpaceError(
                    f"{key} is only sampled when {knob.when}; drop it from this point or meet the condition",
                    file=file,
                    line=line,
                    field=f"search.warm_start.{i}.{key}",
                )
            if not _admits(knob, value):
                allowed = knob.values if knob.values is not None else f"[{knob.low}, {knob.high}]"
                raise SpaceError(
                    f"{value!r} is not a value of knob {key} ({allowed}){why}",
                    file=file,
                    line=line,
                    field=f"search.warm_start.{i}.{key}",
                )
        try:
            load_config(assemble(space, point))
        except ConfigError as exc:
            raise SpaceError(
                f"makes an invalid trial: {exc}",
                file=file,
                line=line,
                field=f"search.warm_start.{i}",
            ) from None


def points(space: Space, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` points in order (ranges contribute their ends and middle)."""
    keys, found = list(space.knobs), list[dict[str, Any]]()

    def walk(i: int, point: dict[str, Any]) -> None:
        if len(found) >= limit:
            return
        if i == len(keys):
            found.append(dict(point))
            return
        knob = space.knobs[keys[i]]
        if not active(knob, point):
            walk(i + 1, point)
            return
        values = knob.candidates()
        if values is None:
            low, high = knob.bounds
            mid = (low + high) / 2
            values = [low, int(mid) if knob.kind == "int" else mid, high]
        for value in values:
            walk(i + 1, {**point, keys[i]: int(value) if knob.kind == "int" else value})

    walk(0, {})
    return found


def check_feasible(space: Space, num_devices: int | None = None, limit: int = 256) -> None:
    """Refuse a space none of whose points makes a trial that could run (static checks)."""
    checked = points(space, limit)
    first: tuple[dict[str, Any], Exception] | None = None
    for point in checked:
        try:
            static_check(space, point, num_devices)
            return
        except (ConfigError, SpaceError) as error:
            first = first or (point, error)
    if first:
        point, exc = first
        scope = "every point" if len(checked) < limit else f"each of the first {limit} points"
        raise SpaceError(
            f"{scope} of this space makes an invalid trial on {num_devices or space.num_devices} "
            f"devices; e.g. {point or 'the base trial'}: {exc}",
            field="knobs",
        )


def target_backend(space: Space) -> str:
    """The backend of a space's trials when nothing else is known: a compile target's TPU,
    the backend a local space asks for, else cpu (the engine passes the real one)."""
    if space.is_tpu_target and space.effective_fidelity != "run":
        return "tpu"
    requested = str(space.trial.get("backend", "auto"))
    if requested != "auto":
        return requested
    return "cpu" if space.target == "local" else "gpu" if gpus_in(space.target) else "tpu"


def static_check(
    space: Space, point: dict[str, Any], num_devices: int | None = None
) -> TrialConfig:
    """The trial config of a point, with every JAX-free check; raises ConfigError."""
    config = load_config(assemble(space, point))
    check_static(config, num_devices or space.num_devices, target_backend(space))
    return config


def count_points(space: Space) -> int | None:
    """Distinct points (conditional knobs counted only where active); None if continuous."""
    keys = list(space.knobs)

    def walk(i: int, point: dict[str, Any]) -> int:
        if i == len(keys):
            return 1
        knob = space.knobs[keys[i]]
        if not active(knob, point):
            return walk(i + 1, point)
        values = knob.candidates()
        if values is None:
            raise OverflowError
        return sum(walk(i + 1, {**point, keys[i]: v}) for v in values)

    try:
        return walk(0, {})
    except OverflowError:
        return None


# Keyword overrides of run_sweep/Sweep.prepare and the space keys they set.
OVERRIDE_KEYS = {
    "trials": "search.trials",
    "concurrency": "search.concurrency",
    "sampler": "search.sampler",
    "seed": "search.seed",
    "fidelity": "fidelity",
    "target": "target",
    "devices": "devices",
}


def space_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`trials=4, set={"trial.steps": 10}` -> {"search.trials": 4, "trial.steps": 10}."""
    out = dict(kwargs.pop("set", None) or {})
    for key, value in kwargs.items():
        if key not in OVERRIDE_KEYS:
            raise TypeError(
                f"unknown override {key!r}; known: {', '.join(OVERRIDE_KEYS)} or set={{'dotted.key': value}}"
            )
        if value is not None:
            out[OVERRIDE_KEYS[key]] = value
    return out
