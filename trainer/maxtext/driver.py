"""A trial run by MaxText: its settings (trainer/trial/maxtext.py), MaxText's `train_compile`
(compile fidelity: the step compiled for the target with libtpu, no TPU) or `train` (run
fidelity) in MaxText's own Python, and what MaxText prints turned into this trainer's events,
so the engine records a MaxText trial as it records ours.

At compile fidelity the memory is MaxText's compile's, and the step time is read from
MaxText's optimized HLO (XLA's dump of `jit_train_step`) by the same step model as ours
(fidelity estimate, from a compile). At run fidelity the step times, tokens/s and TFLOP/s
are MaxText's own log lines.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.maxtext import logs
from trainer.maxtext.tiles import tuned_for_maxtext
from trainer.trial.checks import global_batch_size
from trainer.trial.config import ConfigError, TrialConfig
from trainer.trial.devices import accelerator_of, devices_seen
from trainer.trial.effects import tune_effect
from trainer.trial.events import (
    Accepted,
    Compiled,
    EffectStatus,
    Emitter,
    FailureClass,
    Fidelity,
    KnobEffect,
    Step,
    TrialFailure,
)
from trainer.trial.files import die_with_parent
from trainer.trial.hardware import Accelerator, Backend, Topology
from trainer.trial.maxtext import (
    TRAIN,
    TRAIN_COMPILE,
    MaxTextProgram,
    MaxTextSettings,
    program_settings,
)
from trainer.trial.timing import step_time_stats, throughput_interval

# Environment of ours that must not leak into MaxText's interpreter (another Python, another
# site-packages).
_OURS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


@dataclass
class Output:
    """What one MaxText process printed, and when it passed its phases."""

    returncode: int
    text: str
    marks: dict[str, float] = field(default_factory=dict)  # phase line -> time seen

    def phase(self) -> str:
        if logs.COMPILED in self.marks:
            return "run"
        return "compile" if logs.COMPILING in self.marks else "config"


def base_config(program: MaxTextProgram) -> str:
    """The base config a MaxText trial starts from: the space's, else the package's."""
    return program.base_config or str(package_dir(program.interpreter()) / "configs" / "base.yml")


def package_dir(python: str) -> Path:
    """Where MaxText's package is installed for `python` (its configs/ are there)."""
    if not Path(python).exists():
        raise ConfigError(
            "maxtext.python",
            f"{python} does not exist: build MaxText's environment with `make maxtext`, or name "
            "a Python that has maxtext==0.2.5 (maxtext.python, or $SWEEPER_MAXTEXT_PYTHON)",
        )
    find = "import importlib.util as u; s = u.find_spec('maxtext'); print(s.submodule_search_locations[0] if s else '')"
    found = subprocess.run(
        [python, "-c", find], capture_output=True, text=True, env=maxtext_env({})
    )
    where = found.stdout.strip()
    if found.returncode or not where:
        raise ConfigError(
            "maxtext.python", f"{python} has no maxtext package (pip install 'maxtext[tpu]==0.2.5')"
        )
    return Path(where)


def maxtext_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without ours (`_OURS`), with `extra`: what MaxText's
    interpreter runs with."""
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    return {**env, **extra}


def run_maxtext(
    python: str, module: str, argv: list[str], env: dict[str, str], on_line: Callable[[str], None]
) -> Output:
    """One MaxText process; each line it prints is passed on (the trial's log) as it comes."""
    proc = subprocess.Popen(
        [python, "-m", module, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=maxtext_env(env),
        preexec_fn=die_with_parent,
    )
    assert proc.stdout is not None, "started with stdout=PIPE"
    lines: list[str] = []
    marks: dict[str, float] = {}
    for line in proc.stdout:
        lines.append(line)
        print(line, end="", flush=True)
        stripped = line.strip()
        if stripped in (logs.COMPILING, logs.COMPILED):
            marks.setdefault(stripped, time.time())
        on_line(line)
    return Output(proc.wait(), "".join(lines), marks)


def _effects(knobs: dict[str, Any]) -> dict[str, KnobEffect]:
    """A MaxText trial's `maxtext.*` knobs: MaxText's settings, passed as set."""
    return {
        key: KnobEffect(
            status=EffectStatus.UNJUDGED,
            reason=f"passed to MaxText as its {key.removeprefix('maxtext.')} setting; the "
            "sweep judges it by the programs trials compile to (its notes: inert or active)",
        )
        for key in knobs
    }


def _tune(config: TrialConfig, backend: str) -> dict[str, KnobEffect]:
    """`kernels.tune` where it cannot act (a MaxText run: its Splash blocks as set)."""
    platform = Backend.CPU if backend == "cpu" else Backend.TPU
    said = tune_effect(config, platform, maxtext=True)
    return {} if said is None else {"kernels.tune": said}


def _accepted(
    config: TrialConfig,
    settings: MaxTextSettings,
    knobs: dict[str, Any],
    *,
    fidelity: Fidelity,
    backend: str,
    hardware: str,
    device_kind: str,
    num_devices: int,
    chips: float,
    target: str | None = None,
) -> Accepted:
    global_batch = global_batch_size(config, num_devices)
    return Accepted(
        config=config.model_dump(mode="json"),
        fidelity=fidelity,
        backend=backend,
        device_kind=device_kind,
        hardware=hardware,
        num_devices=num_devices,
        chips=chips,
        tokens_per_step=global_batch * config.seq_len,
        mesh=config.mesh.resolve(num_devices),
        global_batch=global_batch,
        effects={**_effects(knobs), **_tune(config, backend)},
        target=target,
        libtpu_init_args=settings.libtpu_init_args,
        program="maxtext",
    )


# libtpu's words for a program over HBM: "HLO temporaries (414.46G) exceeds available HBM (94.74G)"
_HBM = re.compile(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _failed(output: Output, what: str) -> TrialFailure:
    failure_class, message, key = logs.failure(output.text, output.phase())
    details: dict[str, Any] = {"field": key} if key else {}
    hbm = _HBM.search(message)
    if failure_class == FailureClass.OOM_HBM and hbm:
        # libtpu's G are GiB (its 94.74G is TPU7x's usable 94.75 GiB per device).
        details.update(needed_gib=float(hbm.group(1)), budget_gib=float(hbm.group(2)))
    return TrialFailure(
        failure_class, f"MaxText {what} exited with code {output.returncode}: {message}", **details
    )


def compile_command(
    program: MaxTextProgram,
    settings: MaxTextSettings,
    work: Path,
    overrides: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """MaxText train_compile's arguments and environment for a trial's settings, on this CPU
    host: its output under `work/out`, XLA's dump of the step under `work/hlo`. `overrides`
    (MaxText `key=value` settings) replace the trial's own of the same key."""
    env = {
        "LIBTPU_INIT_ARGS": " ".join(settings.libtpu_init_args),
        "JAX_PLATFORMS": "cpu",
        "TPU_WORKER_HOSTNAMES": "localhost",  # no TPU host here: libtpu asks for one
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # concurrent compile trials share libtpu
        "XLA_FLAGS": f"--xla_dump_to={work / 'hlo'} --xla_dump_hlo_module_re=jit_train_step",
    }
    replaced = {o.split("=", 1)[0] for o in overrides}
    own = [a for a in settings.argv() if a.split("=", 1)[0] not in replaced]
    argv = [
        base_config(program), "run_name=sweeper", f"base_output_directory={work / 'out'}",
        *own, *overrides,
        # tokamax's TPU kernels check the default device (this host's CPU) unless told the
        # program is lowered for another machine: its absl flag, read by MaxText's app.run.
        "--tokamax_cross_compile",
    ]  # fmt: skip
    return argv, env


def compile_trial(
    config: TrialConfig,
    program: MaxTextProgram,
    knobs: dict[str, Any],
    emitter: Emitter,
    keep_hlo: Path | None = None,
) -> dict[str, Any]:
    """MaxText's train_compile of the trial for its target: the compiler's memory, and the step
    time our step model reads from MaxText's optimized HLO (gzipped to `keep_hlo` if given:
    benchmarks.calibration keeps it, to be read again as the model improves)."""
    topology = Topology.parse(config.compile_target or "")
    accel = topology.accelerator
    settings = program_settings(config, program, knobs, Backend.TPU)
    python = program.interpreter()
    base = base_config(program)
    emitter.emit(
        _accepted(
            config, settings, knobs, fidelity=Fidelity.COMPILE,
            backend="tpu (AOT, no device) via MaxText", hardware=accel.name,
            device_kind=accel.device_kind, num_devices=topology.devices, chips=topology.chips,
            target=topology.target,
        )
    )  # fmt: skip
    # kernels.tune: the tuner compiles Splash alone (the trial says `compiling` meanwhile),
    # then MaxText compiles the trial with the blocks it chose.
    config, tuned, tuning = tuned_for_maxtext(config, program, topology, emitter)
    if tuning is not None:
        settings = program_settings(config, program, knobs, Backend.TPU)
    work = Path(tempfile.mkdtemp(prefix="sweeper-maxtext-"))
    try:
        argv, env = compile_command(program, settings, work)
        started = time.time()
        output = run_maxtext(python, TRAIN_COMPILE, argv, env, lambda _: None)
        if output.returncode:
            raise _failed(output, "train_compile")
        memory = logs.memory_analysis(output.text)
        if memory is None:
            raise TrialFailure(
                FailureClass.COMPILE_ERROR, "MaxText train_compile printed no memory analysis"
            )
        hlo = _optimized_hlo(work / "hlo")
        if keep_hlo is not None:
            keep_hlo.write_bytes(gzip.compress(hlo.encode()))
        compile_s = output.marks.get(logs.COMPILED, time.time()) - output.marks.get(
            logs.COMPILING, started
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = _compiled_summary(config, topology, memory, hlo, compile_s, emitter, tuned, tuning)
    return _with_maxtext_flops(summary, maxtext_tflops(python, [base, *settings.argv()]),
                               topology.devices)  # fmt: skip


def _with_maxtext_flops(
    summary: dict[str, Any], tflops: float | None, devices: int
) -> dict[str, Any]:
    """The summary with the model's FLOPs as MaxText counts them, and its MFU over them
    (unchanged where MaxText could not say)."""
    if tflops is None:
        return summary
    flops = tflops * 1e12 * devices
    summary["est_mfu"] *= flops / summary["model_flops_per_step"]
    summary["model_flops_per_step"] = flops
    summary["maxtext_tflops_per_device"] = tflops
    return summary


# MaxText's own count of a step's training FLOPs per device (its maxtext_utils, as its train
# logs "Per train step: Total TFLOPs"): printed as one JSON line.
_TFLOPS = """
import json, sys
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils
config = pyconfig.initialize([sys.argv[0], *sys.argv[1:]])
total, learnable, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
print("SWEEPER_TFLOPS " + json.dumps([total, learnable, attention]))
"""


def maxtext_tflops(python: str, argv: list[str]) -> float | None:
    """A step's training TFLOPs per device as MaxText counts them for this model and these
    settings (its own formulas: MLA, sliding windows, shared experts included); None when
    MaxText could not say (the summary keeps the engine's count of the shape then)."""
    env = maxtext_env({"JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost"})
    try:
        done = subprocess.run(
            [python, "-c", _TFLOPS, *argv, "skip_jax_distributed_system=true"],
            capture_output=True, text=True, env=env, timeout=300, preexec_fn=die_with_parent,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        if line.startswith("SWEEPER_TFLOPS "):
            return float(json.loads(line.removeprefix("SWEEPER_TFLOPS "))[0])
    return None


def _optimized_hlo(dump: Path) -> str:
    found = sorted(
        dump.glob("*jit_train_step*after_optimizations.txt"), key=lambda p: p.stat().st_size
    )
    if not found:
        raise TrialFailure(
            FailureClass.COMPILE_ERROR,
            f"MaxText's compile left no optimized HLO of jit_train_step in {dump}",
        )
    return found[-1].read_text()


def _compiled_summary(
    config: TrialConfig,
    topology: Topology,
    memory: dict[str, int],
    hlo: str,
    compile_s: float,
    emitter: Emitter,
    tuned: dict[str, dict[str, str]] | None = None,
    tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The compile's event and the trial's summary at compile fidelity (its memory the
    compiler's, its step time the step model's reading of the program; `kernels.tune`'s
    effect and record, where the tuner ran)."""
    from trainer.compile.aot import compile_summary
    from trainer.compile.cost import program_cost
    from trainer.program.hlo import count_collectives, count_matmuls, fingerprint, parse

    module = parse(hlo)
    record = {
        "fingerprint": fingerprint(hlo),
        "compile_s": compile_s,
        "memory_per_device": memory,
        "collectives": count_collectives(module),
        "cost": program_cost(module),
    }
    emitter.emit(
        Compiled(
            compile_s=compile_s,
            memory_per_device=memory,
            collectives=record["collectives"],
            matmuls=count_matmuls(module),
            program_fingerprint=record["fingerprint"],
            program_cost=record["cost"],
            effects=tuned or {},
            kernel_tuning=tuning,
        )
    )
    degrees = config.mesh.resolve(topology.devices)
    global_batch = global_batch_size(config, topology.devices)
    return compile_summary(config, global_batch, degrees, topology, record)


@dataclass(frozen=True)
class _Devices:
    """What a MaxText run trains on, as the trial's figures name it."""

    hardware: str
    device_kind: str
    devices: int
    chips: float
    per_chip: int
    accelerator: Accelerator | None  # a TPU's datasheet (its peak: MFU); None on CPU


def _devices(config: TrialConfig, target: str, cpu: bool) -> _Devices:
    if cpu:
        devices = _simulated_devices() or config.num_devices or 1
        return _Devices(f"cpu via MaxText ({devices} devices)", "cpu", devices, 1.0, devices, None)
    if target == "local":  # this host's chips, as JAX finds them before MaxText holds them
        seen = devices_seen()
        accel = accelerator_of(seen["device_kind"])
        if accel is None:
            raise ConfigError("target", f"MaxText trials run on TPUs; JAX here finds "
                                        f"{seen['count']} {seen['device_kind']} ({seen['platform']})")  # fmt: skip
        count = int(seen["count"])
        return _Devices(accel.name, accel.device_kind, count, count / accel.devices_per_chip,
                        accel.devices_per_chip, accel)  # fmt: skip
    # A TPU slice: MaxText finds its devices and peers itself (one process per host).
    topology = Topology.parse(target)
    accel = topology.accelerator
    return _Devices(accel.name, accel.device_kind, topology.devices, topology.chips,
                    accel.devices_per_chip, accel)  # fmt: skip


def run_trial(
    config: TrialConfig,
    program: MaxTextProgram,
    knobs: dict[str, Any],
    target: str,
    emitter: Emitter,
) -> dict[str, Any]:
    """MaxText's train on this host's devices: each step as MaxText logs it, and the trial's
    figures from those lines (MaxText's own step times, tokens/s and TFLOP/s)."""
    platform = os.environ.get("JAX_PLATFORMS", "") or "tpu"
    cpu = platform == "cpu" or config.backend == "cpu"
    on = config.model_copy(update={"backend": "cpu"}) if cpu else config
    settings = program_settings(on, program, knobs, Backend.CPU if cpu else Backend.TPU)
    where = _devices(config, target, cpu)
    emitter.emit(
        _accepted(
            config, settings, knobs, fidelity=Fidelity.RUN, backend=("cpu" if cpu else "tpu"),
            hardware=where.hardware, device_kind=where.device_kind, num_devices=where.devices,
            chips=where.chips,
        )
    )  # fmt: skip
    profile = config.profile.dir if config.profile is not None else None
    steps = _train(program, settings, emitter, Path(profile) if profile else None)
    return _run_summary(config, steps, where, "cpu" if cpu else "tpu")


def _train(
    program: MaxTextProgram,
    settings: MaxTextSettings,
    emitter: Emitter,
    profile: Path | None = None,
) -> list[logs.StepLine]:
    """MaxText's train run to its end, each step it logs emitted as ours; its steps, or
    TrialFailure when it failed or logged none. The traces MaxText's profiler wrote (under its
    output folder, a temporary one) are kept in `profile` (the trial's folder)."""
    steps: list[logs.StepLine] = []

    def on_line(line: str) -> None:
        step = logs.step_line(line)
        if step is None:
            return
        steps.append(step)
        emitter.emit(
            Step(
                step=step.step,
                step_time_s=step.seconds,
                loss=step.loss,
                aux_loss=step.moe_lb_loss,
                grad_norm=math.nan,  # MaxText's step line carries none
            )
        )

    work = Path(tempfile.mkdtemp(prefix="sweeper-maxtext-"))
    try:
        argv = [base_config(program), "run_name=sweeper", f"base_output_directory={work}",
                *settings.argv()]  # fmt: skip
        libtpu = {"LIBTPU_INIT_ARGS": " ".join(settings.libtpu_init_args)}
        output = run_maxtext(program.interpreter(), TRAIN, argv, libtpu, on_line)
        if profile is not None:
            keep_traces(work, profile)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if output.returncode or not steps:
        if not steps and not output.returncode:
            raise TrialFailure(FailureClass.CRASHED, "MaxText train logged no completed step")
        raise _failed(output, "train")
    return steps


def keep_traces(work: Path, profile: Path) -> list[Path]:
    """MaxText's profiler traces (`plugins/profile/<run>/` under its tensorboard folder) copied
    into `profile`, as our trainer writes its own; the files kept."""
    kept = []
    for trace in sorted(work.rglob("plugins/profile/*")):
        if trace.is_dir():
            shutil.copytree(trace, profile / "plugins" / "profile" / trace.name, dirs_exist_ok=True)
            kept += [
                p for p in (profile / "plugins" / "profile" / trace.name).rglob("*") if p.is_file()
            ]
    return kept


def _run_summary(
    config: TrialConfig, steps: list[logs.StepLine], where: _Devices, backend: str
) -> dict[str, Any]:
    """A run's figures from MaxText's step lines: its own step times, tokens/s and TFLOP/s,
    with the noise figures our trainer's runs carry (the median step's 95% interval, as
    tokens/s: a slower step is fewer tokens, and the window spread)."""
    timed = steps[config.measure.skip_steps :] or steps
    per_device = statistics.median(s.tokens_per_device for s in timed)
    tflops = statistics.median(s.tflops_per_device for s in timed)
    stats = step_time_stats([s.seconds for s in timed], config.measure.windows)
    point = per_device * where.per_chip
    summary: dict[str, Any] = {
        "fidelity": Fidelity.RUN,
        "hardware": where.hardware,
        "chips": where.chips or 1.0,
        "backend": backend,
        "num_devices": where.devices,
        "tokens_per_sec_per_device": per_device,
        "tokens_per_sec_per_chip": point,
        **throughput_interval(stats, point),
        "tokens_per_sec": per_device * where.devices,
        "tflops_per_sec_per_chip": tflops * where.per_chip,
        **stats,
        "final_loss": steps[-1].loss,
        "tokens_per_step": global_batch_size(config, where.devices) * config.seq_len,
    }
    peak = where.accelerator.peak_tflops.get(config.precision.peak) if where.accelerator else None
    if peak:
        summary["mfu"] = tflops * where.per_chip / peak
    return summary


def maxtext_trial(
    config: TrialConfig, request: str, estimate_only: bool, emitter: Emitter
) -> dict[str, Any]:
    """The trial through MaxText at its fidelity (`request`: the engine's --maxtext JSON)."""
    spec = json.loads(request)
    program = MaxTextProgram.model_validate(spec.get("program", {}))
    knobs = spec.get("knobs", {})
    if estimate_only:
        raise ConfigError(
            "fidelity",
            "MaxText trials are compiled or run: the analytic estimate is our trainer's model "
            "(use fidelity compile, or program: sweeper-trainer to screen)",
        )
    if config.compile_target:
        return compile_trial(config, program, knobs, emitter)
    return run_trial(config, program, knobs, spec.get("target") or "local", emitter)


def _simulated_devices() -> int | None:
    flag = "--xla_force_host_platform_device_count="
    for part in os.environ.get("XLA_FLAGS", "").split():
        if part.startswith(flag):
            return int(part.removeprefix(flag))
    return None
