"""The Ray Tune trainable: a trial's trainer processes started where its placement says, their
events forwarded to Tune.

A local trial runs one trainer as a child of its Tune worker (pinned to the cores it
reserved); a slice trial is a light driver that reserves a whole TPU slice and runs one
trainer per host. Process 0 speaks for the trial; any process failing fails it, and every
ending kills all of its processes on every host.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune

from sweeper.execute.placement import Placement
from sweeper.execute.processes import Handle, LocalHandle, TrainerProcess, lease_cores
from sweeper.execute.programs import program_of
from sweeper.execute.slices import reserve_slice, start_slice
from sweeper.record.row import LOG_TAIL_LINES, TRAINER_LOG, TUNING_FILE
from sweeper.space.checks import static_check
from sweeper.space.points import PROFILE_KEY, REUSE_KEY, knob_point
from sweeper.space.schema import Space
from trainer.trial.config import ConfigError, ProfileConfig, TrialConfig
from trainer.trial.events import (
    EXIT_CODES,
    STEP_METRICS,
    Accepted,
    Compiled,
    Failure,
    FailureClass,
    KnobEffect,
    ProtocolError,
    Step,
    Summary,
    TrialStatus,
    Tuning,
    parse_event,
)
from trainer.trial.files import trainer_command, write_json
from trainer.trial.result import Convergence, Layout, TrialResult, running_report

Report = Callable[[dict[str, Any]], None]  # tune.report
POLL_S = 0.1
# The `cores` of a local CPU trial that could lease none in time: it ran on every core.
UNPINNED = "unpinned"
# After one process fails, how long its peers may take to end too (3 s was too short on a
# loaded 2-core host: a killed peer was not seen in time and its survivor's error was named).
PEER_GRACE_S = 10.0
_CODE_TO_CLASS = {code: name for name, code in EXIT_CODES.items()}
# Return codes of a process killed by its own fault (not by the engine or the OS's SIGKILL).
_CRASH_SIGNALS = {
    -s for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
}


@dataclass(frozen=True)
class TrialRuntime:
    """How trials run: where (the placement) and their limits, fixed for a sweep."""

    placement: Placement
    timeout_s: float  # the space's search.trial_timeout_s
    python: str = sys.executable


class TrialRun:
    """Runs one trial's trainer processes and turns their event streams into Tune results."""

    def __init__(
        self,
        space: Space,
        runtime: TrialRuntime,
        point: dict[str, Any],
        trial_dir: Path,
        profile_last: bool = False,
        node_id: str | None = None,
        cancel: threading.Event | None = None,
    ):
        """`profile_last`: trace the trial's last steps (the best point measured again).
        `node_id`: the host the trial runs on (default: this Ray worker's node); `cancel`,
        once set, ends the trial's processes (the host runner's Ctrl-C)."""
        self.space, self.runtime, self.point, self.trial_dir = space, runtime, point, trial_dir
        self.profile_last = profile_last
        self.node_id = node_id
        self.cancel = cancel or threading.Event()
        self.cancelled = False
        self.placement = runtime.placement
        self.objectives = space.objective.metrics
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.accepted: Accepted | None = None
        self.compiled: Compiled | None = None
        self.summary: Summary | None = None
        self.failure: Failure | None = None  # the event that tells why, chosen in watch()
        self.step_times: list[float] = []
        self.config: TrialConfig | None = None  # validated, set when the trial starts
        self.timed_out = False
        self.where: list[dict[str, Any]] = []  # one entry per process: node, slice, pid
        self.lost: tuple[int, int] | None = None  # (process, exit code) the trial failed by
        self.failures: dict[int, Failure] = {}  # each process's own failure event
        self.started_at: float | None = None
        self.ended_at: float | None = None

    def running_throughput(self) -> float:
        if self.accepted is None or self.config is None:
            return 0.0
        skip = self.config.measure.skip_steps
        timed = self.step_times[skip:] or self.step_times
        return self.accepted.tokens_per_step / statistics.median(timed) / (self.accepted.chips or 1)

    def on_event(
        self, event: Accepted | Tuning | Compiled | Step | Summary, report: Report
    ) -> None:
        """Keep what process 0 says, and tell Tune where the trial is: compiling, training
        (a report per step), finishing (the convergence check and the summary)."""
        if isinstance(event, Accepted):
            self.accepted = event
            report(running_report(self.objectives, "compiling"))
        elif isinstance(event, Tuning):  # kernels.tune compiles its candidates: how far along
            report(running_report(self.objectives, "tuning kernels", tuned=event.done,
                                  tunes=event.total))  # fmt: skip
        elif isinstance(event, Compiled):
            self.compiled = event
            if event.kernel_tuning is not None:  # kernels.tune's candidates, with the trial
                write_json(self.trial_dir / TUNING_FILE, event.kernel_tuning, indent=1)
            # A compile trial then reads its program (and judges its flags); a run trains.
            trains = self.space.effective_fidelity == "run"
            report(running_report(self.objectives, "training" if trains else "finishing"))
        elif isinstance(event, Step):
            self.step_times.append(event.step_time_s)
            running = self.running_throughput()
            figures = {k: getattr(event, k) for k in STEP_METRICS}
            report(
                running_report(
                    self.objectives,
                    "training",
                    step=event.step,
                    steps=self.config.steps if self.config else 0,
                    **figures,
                    tokens_per_sec_per_chip_running=running,
                    tokens_per_sec_per_chip=running,
                )
            )
            if self.config and event.step == self.config.steps - 1:
                report(running_report(self.objectives, "finishing"))
        elif isinstance(event, Summary):
            self.summary = event

    def layout(self) -> Layout:
        """Where the trial ran: recorded in results, summary.csv and MLflow tags."""
        slices = sorted({w["slice"] for w in self.where if w.get("slice")})
        return Layout(
            hosts=",".join(w["node_id"] for w in self.where),
            slice=",".join(slices),
            processes=len(self.where),
            pids=",".join(str(w["pid"]) for w in self.where if "pid" in w),
            device_kind=self.accepted.device_kind if self.accepted else "",
            # Cores a local CPU trainer was pinned to (slice hosts are held whole).
            cores=self.where[0].get("cores", "") if self.where else "",
            started_at=self.started_at,
            ended_at=self.ended_at,
        )

    def effects(self) -> dict[str, KnobEffect]:
        """The knobs' effects as the trial accepted them, refined by what its compile found
        (a flag knob whose program is the same as at its default is inert)."""
        effects = dict(self.accepted.effects) if self.accepted else {}
        found = self.compiled.effects if self.compiled else {}
        if any(k.startswith("xla.") for k in found):
            effects.pop("xla", None)  # per-flag verdicts replace "flags were passed"
        return {**effects, **found}

    def figures(self) -> TrialResult:
        """What the trial produced, whatever its ending: its summary's figures (each at its
        fidelity), its convergence verdict, where it ran, its knobs' effects, its log tail."""
        accepted, summary = self.accepted, self.summary
        figures = summary.model_dump(exclude={"event", "time"}) if summary else {}
        # Finite figures only: an arithmetic intensity over no ICI traffic (one chip) is
        # infinite, which JSON (and so the stored result) cannot carry: it is left out.
        numbers = {
            k: float(v)
            for k, v in figures.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self.compiled:
            numbers["compile_s"] = self.compiled.compile_s
        conv = figures.get("convergence")
        return TrialResult(
            status=TrialStatus.OK,
            fidelity=summary.fidelity if summary else self.space.effective_fidelity,
            hardware=accepted.hardware if accepted else "",
            backend=accepted.backend if accepted else "",
            program=accepted.program if accepted else self.space.program,
            bound=(summary.bound or "") if summary else "",
            figures=numbers,
            convergence=Convergence(
                passed=conv["passed"],
                delta=conv["delta"],
                relative_delta=conv["relative_delta"],
                tolerance=conv["tolerance"],
                seed_noise=conv.get("seed_noise"),
                reference=conv.get("reference_source", ""),
            )
            if conv
            else None,
            layout=self.layout(),
            effects=self.effects(),
            trial_config=self.config.to_json() if self.config else "",
            program_fingerprint=self.compiled.program_fingerprint if self.compiled else "",
            profile_dir=(summary.profile_dir or "") if summary else "",
            kernel_tuning=self.compiled.kernel_tuning if self.compiled else None,
            log_tail="\n".join(self.tail),
        )

    def ending(self, returncode: int | None) -> TrialResult | None:
        """How the trial failed, from what its processes said and how they exited; None
        for a trial that ended well."""
        if self.cancelled:
            return TrialResult(
                status=TrialStatus.KILLED,
                failure_message="the sweep was interrupted (Ctrl-C / SIGTERM) while it ran",
            )
        if self.timed_out:
            return TrialResult.failed(
                FailureClass.TIMEOUT,
                f"trial exceeded {self.runtime.timeout_s}s; every process of it was killed",
            )
        if self.failure is not None:
            return TrialResult.failed(
                self.failure.failure_class,
                self.failure.message,
                failure_field=self.failure.field,
                failure_step=self.failure.step,
                needed_gib=self.failure.needed_gib,
                budget_gib=self.failure.budget_gib,
            )
        if self.accepted is not None and self.compiled is None and returncode in _CRASH_SIGNALS:
            # Accepted, never compiled, killed by its own fault: the compiler crashed (libtpu
            # overflows its stack on some programs). The same program would crash again.
            name = signal.Signals(-returncode).name
            return TrialResult.failed(
                FailureClass.COMPILE_ERROR,
                f"the trainer crashed ({name}) while compiling the step: a compiler crash, "
                "see log_tail",
            )
        if returncode != 0 or self.summary is None:
            cls = _CODE_TO_CLASS.get(returncode, FailureClass.CRASHED) if returncode else None
            cls = cls or FailureClass.CRASHED
            who = ""
            if self.lost and len(self.where) > 1:
                host = self.where[self.lost[0]]
                who = f"process {self.lost[0]} on host {host['node_id'][:12]} "
            return TrialResult.failed(
                cls,
                f"trainer {who}exited with code {returncode} and no failure event"
                + ("; the trial's other processes were killed" if who else ""),
            )
        return None

    def final(self, returncode: int | None, ending: TrialResult | None = None) -> TrialResult:
        """The trial's result: its figures, and how it ended (`ending`, else as its
        processes say)."""
        result = self.figures()
        ending = ending or self.ending(returncode)
        if ending is None:
            return result
        return result.model_copy(update=ending.model_dump(exclude_unset=True))

    def extra_args(self) -> list[str]:
        """The trainer's arguments for the space's program (ours, or MaxText) and fidelity."""
        return program_of(self.space).args(self.space, self.point)

    @contextlib.contextmanager
    def processes(self, config_json: str) -> Iterator[list[Handle]]:
        """Start the trial's trainer processes where its placement says; kill them all on exit."""
        placement = self.placement
        env = placement.process_env()
        if placement.kind == "slice":
            owner = f"sweeper-{tune.get_context().get_trial_id()}"
            with reserve_slice(placement, self.runtime.timeout_s, owner) as handles:
                self.started_at = time.time()
                start_slice(handles, config_json, self.extra_args(), env)
                self.where = [h.where for h in handles]
                yield handles
            return
        config_path = self.trial_dir / "trial.json"
        node_id = self.node_id or ray.get_runtime_context().get_node_id()
        with (
            lease_cores(placement.cpus_per_trial, node_id)
            if placement.cpus_per_trial
            else (contextlib.nullcontext(None)) as cores
        ):
            self.started_at = time.time()
            # libtpu's own logs (compile trials load it) stay with the trial, not in /tmp.
            logs = {"TPU_LOG_DIR": str(self.trial_dir / "tpu_logs")}
            process = TrainerProcess(
                trainer_command(config_path, self.extra_args(), self.runtime.python),
                {**os.environ, **logs, **env},
                self.trial_dir / TRAINER_LOG,
                cores,
            )
            pinned = ",".join(map(str, sorted(cores))) if cores else ""
            where = {
                "node_id": node_id,
                "slice": "",
                "pid": process.proc.pid,
                # A CPU trial that could not lease its cores ran on every core: said, not hidden.
                "cores": pinned or (UNPINNED if placement.cpus_per_trial else ""),
            }
            self.where = [where]
            handle = LocalHandle(process, where)
            try:
                yield [handle]
            finally:
                handle.kill()

    def watch(self, handles: list[Handle], report: Report) -> int | None:
        """Read every process until all ended, one failed (then kill the rest) or time ran out."""
        deadline = time.monotonic() + self.runtime.timeout_s
        codes: dict[int, int] = {}
        failed_at: float | None = None
        while True:
            for i, handle in enumerate(handles):
                if i in codes:
                    continue
                lines, code = handle.drain()
                for line in lines:
                    self.tail.append((f"[p{i}] " if i else "") + line.rstrip()[:500])
                    try:
                        event = parse_event(line)
                    except ProtocolError as exc:  # a trainer of another protocol: said, not lost
                        event = Failure(failure_class=FailureClass.CRASHED, message=str(exc))
                    # Process 0 speaks for the trial; the others are heard when they fail.
                    if isinstance(event, Failure):
                        self.failures.setdefault(i, event)
                    elif event is not None and i == 0:
                        self.on_event(event, report)
                if code is not None:
                    codes[i] = code
            failed = [i for i, code in codes.items() if code != 0]
            if failed and failed_at is None:
                # A process failed: give its peers a moment to end too, so the one that
                # caused it (not a peer whose collective broke with it) is named.
                failed_at = time.monotonic()
            if len(codes) == len(handles) or (
                failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S
            ):
                break
            if time.monotonic() > deadline:
                self.timed_out = True
                break
            if self.cancel.wait(POLL_S):
                self.cancelled = True
                break
        for handle in handles:
            handle.kill()
        failed = [i for i, code in codes.items() if code != 0]
        # A process that died without a failure event of its own (killed, segfault) is the
        # cause, and its exit code the story; its peers' errors (a broken all-gather) are
        # the effect. Otherwise the first failing process's event says why, or, with no
        # process failing, the first failure any process sent (a protocol error).
        silent = [i for i in failed if i not in self.failures]
        if failed:
            cause = (silent or failed)[0]
            self.lost = (cause, codes[cause])
        if not silent:
            first = next(iter(self.failures.values()), None)
            self.failure = self.failures.get(self.lost[0], first) if self.lost else first
        return self.lost[1] if self.lost else codes.get(0)

    def run(self, report: Report) -> TrialResult:
        try:
            config = self.config = static_check(self.space, self.point, self.placement.num_devices)
        except ConfigError as exc:
            return TrialResult.failed(
                FailureClass.INVALID_CONFIG, exc.message, failure_field=exc.field
            )
        if config.profile is None and self.profile_last:
            config = self.config = profiled_last(config)
        if config.profile is not None and config.profile.dir is None:  # the trace: beside its log
            profile = config.profile.model_copy(update={"dir": str(self.trial_dir / "profile")})
            config = self.config = config.model_copy(update={"profile": profile})
        config_json = config.to_json()
        (self.trial_dir / "trial.json").write_text(config_json)
        spawned = time.time()
        try:
            with self.processes(config_json) as handles:
                returncode = self.watch(handles, report)
        except ray.exceptions.RayError:
            # A host or Ray worker of the trial died: an infrastructure fault, not a property
            # of the point. Raised, so Tune retries the trial elsewhere (FailureConfig).
            raise
        except (TimeoutError, RuntimeError) as exc:
            # The hardware could not be had (a slice reservation failed or timed out). Once
            # the trainers run, anything else is a bug to surface.
            if self.started_at is not None:
                raise
            self.ended_at = time.time()
            message = f"{type(exc).__name__}: {str(exc)[:1500]}"
            return self.final(None, TrialResult.failed(FailureClass.CRASHED, message))
        self.ended_at = time.time()
        result = self.final(returncode)
        result.figures["trainer_wall_s"] = time.time() - spawned
        return result


# The best point's re-measurement traces this many steps, the last ones (then not timed).
PROFILED_STEPS = 2


def profiled_last(config: TrialConfig) -> TrialConfig:
    """`config` tracing its last `PROFILED_STEPS` steps, where at least two timed steps are
    left after its warm-up ones; else as it is."""
    start = config.steps - PROFILED_STEPS
    if start - config.measure.skip_steps < 2:
        return config
    profile = ProfileConfig(start_step=start, steps=PROFILED_STEPS)
    return config.model_copy(update={"profile": profile})


def run_trial(
    config: dict[str, Any],
    *,
    space: Space,
    runtime: TrialRuntime,
    recorded: dict[str, TrialResult] | None = None,
) -> None:
    """Ray Tune function trainable: `config` is the sampled point (knob path -> value)."""
    context = tune.get_context()
    run_point(
        config,
        space=space,
        runtime=runtime,
        recorded=recorded,
        trial_id=context.get_trial_id(),
        trial_dir=Path(context.get_trial_dir()),
        report=lambda metrics: tune.report(metrics),
    )


def run_point(
    config: dict[str, Any],
    *,
    space: Space,
    runtime: TrialRuntime,
    recorded: dict[str, TrialResult] | None,
    trial_id: str,
    trial_dir: Path,
    report: Report,
    node_id: str | None = None,
    cancel: threading.Event | None = None,
) -> TrialResult:
    """One trial of the point `config`, its reports made through `report` (the last one its
    result, which is returned too): Tune's trainable and the host runner's trial alike.

    A point this study measured before (`REUSE_KEY`), and a trial a resumed sweep finds
    already recorded (`recorded`, by trial id), report their stored result instead of
    running again.
    """
    started = time.time()
    objectives = space.objective.metrics
    if recorded and trial_id in recorded:
        result = recorded[trial_id].model_copy(update={"recovered": True})
    elif REUSE_KEY in config:
        earlier = config[REUSE_KEY]
        result = TrialResult.model_validate(earlier["result"]).reused(earlier["from"])
    else:
        trial_dir.mkdir(parents=True, exist_ok=True)
        profile_last = bool(config.get(PROFILE_KEY))
        trial = TrialRun(space, runtime, knob_point(config), trial_dir, profile_last, node_id,
                         cancel)  # fmt: skip
        result = trial.run(report)
        result.figures["trial_wall_s"] = time.time() - started
    report(result.to_report(objectives))
    return result
