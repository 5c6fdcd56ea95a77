"""The trainer's output protocol: one JSON object per line on stdout, and exit codes.

Each event is a pydantic model; the trainer builds them, the engine parses its processes'
output back into them. Enums name the closed sets both sides agree on: failure classes,
trial statuses, fidelities and what a knob does on a backend.
"""

from __future__ import annotations

import json
import re
import sys
import time
from enum import StrEnum
from typing import Annotated, Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from trainer.trial.hardware import GIB

PROTOCOL_VERSION = 1


class FailureClass(StrEnum):
    INVALID_CONFIG = "invalid_config"
    OOM_HBM = "oom_hbm"
    OOM_VMEM = "oom_vmem"
    COMPILE_ERROR = "compile_error"
    DIVERGED = "diverged"
    TIMEOUT = "timeout"
    CRASHED = "crashed"


class TrialStatus(StrEnum):
    """A trial's state in Tune results, summary rows and MLflow tags."""

    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    STOPPED = "stopped"  # ended by the scheduler or the sweep, not by itself
    KILLED = "killed"  # the sweep was interrupted while it ran


ENDED = frozenset({TrialStatus.OK, TrialStatus.FAILED, TrialStatus.KILLED})


class Fidelity(StrEnum):
    ESTIMATE = "estimate"
    COMPILE = "compile"
    RUN = "run"


class EffectStatus(StrEnum):
    """What a knob does on the backend a trial runs on."""

    ACTIVE = "active"  # changes the program or the run as it would on TPU
    EMULATED = "emulated"  # same numerics by another program: not a speed finding
    INTERPRETED = "interpreted"  # a Pallas kernel run by its interpreter: correctness only
    INERT = "inert"  # no effect on this backend
    UNJUDGED = "unjudged"  # passed to the program as set: its effect on this trial not judged


# Failure class -> process exit code. 0 is success; the engine reads either.
EXIT_CODES: dict[FailureClass, int] = {
    FailureClass.INVALID_CONFIG: 2,
    FailureClass.OOM_HBM: 3,
    FailureClass.OOM_VMEM: 4,
    FailureClass.COMPILE_ERROR: 5,
    FailureClass.DIVERGED: 6,
    FailureClass.TIMEOUT: 7,
    FailureClass.CRASHED: 1,
}


class KnobEffect(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: EffectStatus
    reason: str


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    time: float = Field(default_factory=time.time, description="Unix time it was emitted")


class Accepted(_Event):
    """The trial's configuration was accepted and its program built."""

    event: Literal["accepted"] = "accepted"
    protocol: int = PROTOCOL_VERSION
    config: dict[str, Any] = Field(description="the validated TrialConfig, as JSON")
    fidelity: Fidelity = Fidelity.RUN
    backend: str = Field(description="JAX platform, or the AOT target's")
    device_kind: str
    hardware: str = Field(description="the datasheet entry figures are per")
    processes: int = 1
    num_devices: int
    chips: float
    tokens_per_step: int
    mesh: dict[str, int] = Field(description="resolved mesh degrees")
    global_batch: int
    effects: dict[str, KnobEffect] = Field(description="knob -> what it does on this backend")
    target: str | None = Field(default=None, description="TPU topology of a compile trial")
    libtpu_init_args: list[str] = Field(default_factory=list)
    program: str = Field(
        default="sweeper-trainer", description="the trial program: ours, or maxtext"
    )


# Opt-in: a directory for JAX's persistent compilation cache, used by run trials (cli.py).
JAX_CACHE_ENV = "SWEEPER_JAX_CACHE_DIR"


# A compiled step's memory per device, as XLA's memory analysis names it.
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_temp_size_in_bytes",
)


def memory_record(sizes: dict[str, int]) -> dict[str, int]:
    """The memory fields of a compiled step (0 where absent), and their `total_bytes`:
    donated (aliased) outputs reuse argument buffers, so they count once."""
    memory = {f: int(sizes.get(f) or 0) for f in MEMORY_FIELDS}
    memory["total_bytes"] = (
        memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"]
        + memory["temp_size_in_bytes"]
    )
    return memory


class Compiled(_Event):
    event: Literal["compiled"] = "compiled"
    compile_s: float
    memory_per_device: dict[str, int] = Field(description="XLA memory analysis, bytes")
    cost_per_device: dict[str, float] = Field(default_factory=dict)
    collectives: dict[str, int] = Field(default_factory=dict, description="op -> count")
    matmuls: dict[str, int] = Field(
        default_factory=dict, description="matrix products: total, and those with fp8 operands"
    )
    program_fingerprint: str = Field(
        default="", description="hash of the optimized HLO without source metadata"
    )
    shared_compile: bool = Field(
        default=False, description="another trial compiled this exact program: its figures"
    )
    compile_cache: str = Field(
        default="",
        description="run trials: JAX's persistent compilation cache in use ($SWEEPER_JAX_CACHE_DIR); "
        "compile_s is then a compile or a load from it",
    )
    program_cost: dict[str, Any] = Field(
        default_factory=dict,
        description="TPU: the optimized HLO's work per device per step (trainer/compile/cost.py), "
        "also for a program that does not fit",
    )
    effects: dict[str, KnobEffect] = Field(
        default_factory=dict,
        description="knob effects found by compiling: a flag knob is inert when the program "
        "with it at its default is the same",
    )
    kernel_tuning: dict[str, Any] | None = Field(
        default=None,
        description="kernels.tune: each kernel's candidates (priced, or refused with the "
        "compiler's words), the tiles chosen, and what was not tuned (the trial's tuning.json)",
    )


class Tuning(_Event):
    """`kernels.tune: compile` at work: it compiles candidate `done` of about `total` (a
    candidate the compiler refuses may cost one compile more), of `kernel`'s family."""

    event: Literal["tuning"] = "tuning"
    done: int
    total: int
    kernel: str


class Step(_Event):
    event: Literal["step"] = "step"
    step: int
    step_time_s: float = Field(description="completion to completion of this step")
    loss: float = Field(description="cross-entropy")
    aux_loss: float = Field(description="MoE load-balance loss (0 for dense models)")
    grad_norm: float


def _measured(description: str) -> Any:
    return Field(default=None, description=description, json_schema_extra={"measured": True})


class Summary(_Event):
    """A trial's figures, each at the summary's fidelity (or as `figure_fidelity` says)."""

    event: Literal["summary"] = "summary"
    fidelity: Fidelity
    hardware: str
    chips: float
    # Measured by a run.
    tokens_per_sec: float | None = _measured("tokens per second, whole trial")
    tokens_per_sec_per_chip: float | None = _measured("tokens per second per chip")
    tokens_per_sec_per_device: float | None = _measured("tokens per second per device")
    tflops_per_sec_per_chip: float | None = _measured("model TFLOP/s per chip")
    mfu: float | None = _measured("model FLOPs utilization against the datasheet peak")
    step_time_median_s: float | None = _measured("median timed step")
    step_time_p90_s: float | None = _measured("90th percentile timed step")
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    timed_steps: int | None = None
    step_time_median_low_s: float | None = Field(
        default=None, description="95% bootstrap interval of the median step: its low end"
    )
    step_time_median_high_s: float | None = Field(
        default=None, description="95% bootstrap interval of the median step: its high end"
    )
    tokens_per_sec_per_chip_low: float | None = Field(
        default=None, description="tokens/s per chip at the median step's 95% interval's slow end"
    )
    tokens_per_sec_per_chip_high: float | None = Field(
        default=None, description="tokens/s per chip at the median step's 95% interval's fast end"
    )
    timing_windows: int | None = None
    window_spread: float | None = Field(
        default=None,
        description="(slowest - fastest) median step of the timing windows, over the median",
    )
    cpu_contention: float | None = Field(
        default=None,
        description="CPU runs: share of the trial's cores other processes used while it trained",
    )
    train_s: float | None = None
    final_loss: float | None = None
    backend: str | None = None
    device_kind: str | None = None
    processes: int | None = None
    num_devices: int | None = None
    tokens_per_step: int | None = None
    flops_per_step: float | None = None
    peak_tflops_per_chip: float | None = None
    peak_precision: str | None = None
    peak_source: str | None = None
    convergence: dict[str, Any] | None = Field(default=None, description="the loss verdict")
    profile_dir: str | None = Field(default=None, description="the profiler trace's folder")
    # Compiled (a run compiles too).
    target: str | None = None
    compile_s: float | None = None
    memory_per_device: dict[str, int] | None = None
    hbm_per_device_gib: float | None = None
    # What the run's devices held at most, as their runtime counts it (TPU, GPU; none on CPU):
    # the chip's own figure beside the compiler's memory analysis, an upper bound of it.
    peak_hbm_per_device_gib: float | None = Field(
        default=None,
        description="the most device memory the run held (its runtime's peak_bytes_in_use; "
        "none where the runtime keeps no such count, as XLA's CPU devices)",
    )
    fits: bool | None = None
    collectives: dict[str, int] | None = None
    matmuls: dict[str, int] | None = None  # total, and those reading fp8 operands
    program_fingerprint: str | None = None  # optimized HLO without source metadata
    shared_compile: bool | None = None  # figures of another trial's compile of this program
    figure_fidelity: dict[Fidelity, list[str]] | None = None
    # Estimated (the analytic model).
    model_flops_per_step: float | None = None
    maxtext_tflops_per_device: float | None = Field(
        default=None,
        description="a MaxText trial: a step's training TFLOPs per device as MaxText counts "
        "them (model_flops_per_step and est_mfu are then its)",
    )
    recompute_flops_per_step: float | None = None
    est_step_time_s: float | None = None
    est_compute_s: float | None = None
    est_hbm_s: float | None = None
    est_ici_s: float | None = None
    est_host_s: float | None = None
    est_dcn_s: float | None = Field(
        default=None, description="multi-slice programs: collectives between slices over DCN"
    )
    est_serial_s: float | None = Field(
        default=None,
        description="estimate fidelity: what a step cannot overlap (the optimizer's update, "
        "the first gather and last reduce-scatter of the layer loop, fp8's exposed "
        "tensor-parallel all-reduces, MoE routing)",
    )
    est_routing_s: float | None = Field(
        default=None,
        description="estimate fidelity, MoE: the routing's gathers (each token's row per expert, "
        "there and back, in the forward, backward and recompute) at the SparseCores' gather "
        "rate; the expert matmuls wait for them",
    )
    est_busy_s: float | None = Field(
        default=None,
        description="TensorCore time: the program's ops one at a time, in its schedule (the "
        "formula's TensorCore work at estimate fidelity)",
    )
    est_grid_steps_s: float | None = Field(
        default=None,
        description="the Mosaic kernels' grid steps at the least time a step takes: a floor "
        "under their compute time (small blocks), on top of it for Splash on TPU7x",
    )
    est_kernel_waits_s: float | None = Field(
        default=None,
        description="compile fidelity: the grouped-matmul kernels' wait on their experts' tiles "
        "(each expert's weights, or weight gradient, across HBM once a call while the MXU "
        "idles), included in the busy time",
    )
    est_exposed_comm_s: float | None = Field(
        default=None,
        description="step time less busy time: async work the schedule waits for (the "
        "formula's exposed communication at estimate fidelity)",
    )
    est_model: str | None = Field(
        default=None, description="hlo: read from the compiled program; else the analytic formula"
    )
    program_cost: dict[str, Any] | None = Field(
        default=None, description="per device per step, counted in the optimized HLO"
    )
    bound: Literal["compute", "hbm", "ici", "dcn"] | None = None
    est_tokens_per_sec_per_chip: float | None = None
    est_mfu: float | None = None
    arithmetic_intensity_ici: float | None = None
    hardware_intensity_ici: float | None = None
    arithmetic_intensity_hbm: float | None = None
    hardware_intensity_hbm: float | None = None
    communication_bytes_per_device: dict[str, float] | None = None
    est_memory_per_device: dict[str, float] | None = None
    usable_hbm_per_device: float | None = None


class Failure(_Event):
    event: Literal["failure"] = "failure"
    failure_class: FailureClass
    message: str
    field: str | None = Field(default=None, description="the config field at fault")
    step: int | None = None
    needed_gib: float | None = None
    budget_gib: float | None = None
    traceback: str | None = None


Event = Annotated[
    Accepted | Tuning | Compiled | Step | Summary | Failure, Field(discriminator="event")
]
_EVENT = TypeAdapter(Event)
MEASURED_METRICS = tuple(
    name
    for name, f in Summary.model_fields.items()
    if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("measured")
)
# Every number a summary can carry: what the engine logs as a trial's final metrics.
SUMMARY_NUMBERS = tuple(
    name
    for name, f in Summary.model_fields.items()
    if f.annotation in (float | None, int | None) or f.annotation in (float, int)
    if name not in _Event.model_fields
)
STEP_METRICS = tuple(
    n
    for n, f in Step.model_fields.items()
    if f.annotation is float and n not in _Event.model_fields
)


class ProtocolError(ValueError):
    """A line that claims to be an event but is not a valid one."""


class TrialFailure(Exception):
    """A classified ending of a trial; raised in the trainer, emitted as a `Failure`."""

    def __init__(self, failure_class: FailureClass | str, message: str, **details: Any):
        super().__init__(message)
        self.failure_class = FailureClass(failure_class)
        self.message = message
        self.details = details

    def event(self) -> Failure:
        return Failure(failure_class=self.failure_class, message=self.message, **self.details)


def hbm_overflow(needed_bytes: float, budget_bytes: float, budget_source: str) -> TrialFailure:
    """The compiled program needs more device memory than `budget_source` offers."""
    needed, budget = needed_bytes / GIB, budget_bytes / GIB
    return TrialFailure(
        FailureClass.OOM_HBM,
        f"compiled program needs {needed:.3f} GiB per device, more than the "
        f"{budget:.3f} GiB {budget_source} offers",
        needed_gib=needed,
        budget_gib=budget,
    )


class Emitter:
    """Writes events to stdout (or `stream`); quiet=True lets library calls reuse the run loop.

    `only` limits what is written (all events are still kept): the other processes of a
    multi-host trial write only their failures, process 0 speaks for the trial.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        quiet: bool = False,
        only: frozenset[str] | None = None,
    ):
        self._stream = stream
        self.quiet = quiet
        self.only = only
        self.events: list[dict[str, Any]] = []  # as written: JSON-ready dicts

    def emit(self, event: _Event) -> dict[str, Any]:
        record = event.model_dump(mode="json", exclude_none=True)
        self.events.append(record)
        if not self.quiet and (self.only is None or record["event"] in self.only):
            stream = self._stream or sys.stdout  # looked up late: stdout may be redirected
            stream.write(json.dumps(record) + "\n")
            stream.flush()
        return record


def parse_line(line: str) -> dict[str, Any] | None:
    """An event from one line of trainer output, or None for anything that is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def parse_event(line: str) -> Event | None:
    """The typed event on one line of trainer output; None for a line that is not one.

    Raises ProtocolError for a line that is an event but not a valid one of this protocol.
    """
    record = parse_line(line)
    if record is None:
        return None
    try:
        return _EVENT.validate_python(record)
    except ValidationError as exc:
        raise ProtocolError(f"invalid {record.get('event')!r} event: {exc}") from None


_VMEM = re.compile(r"vmem|CompileTimeScopedVmemOom", re.IGNORECASE)
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|out of memory", re.IGNORECASE)


def classify_exception(exc: BaseException, phase: str) -> FailureClass:
    """Failure class of an unexpected exception raised while `phase` ("compile"/"run") ran."""
    return classify_text(f"{type(exc).__name__}: {exc}", phase)


def classify_text(text: str, phase: str) -> FailureClass:
    """Failure class of an error's text (an exception, or what a child process printed)."""
    if _OOM.search(text):
        return FailureClass.OOM_VMEM if _VMEM.search(text) else FailureClass.OOM_HBM
    if phase == "compile":
        return FailureClass.COMPILE_ERROR
    return FailureClass.CRASHED
