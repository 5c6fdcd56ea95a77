"""`python -m trainer --config trial.json`: run one trial and stream events on stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from trainer.trial.config import ConfigError, TrialConfig, load_config
from trainer.trial.events import (
    EXIT_CODES,
    JAX_CACHE_ENV,
    Emitter,
    Failure,
    FailureClass,
    Summary,
    TrialFailure,
    classify_exception,
)
from trainer.trial.flags import BASE_LIBTPU_ARGS, COMPILER_STACKS, RAGGED_DOT_KERNEL


def _read_config(path: str) -> TrialConfig:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"not valid JSON ({exc})") from None
    return load_config(data)


SIMULATED = "xla_force_host_platform_device_count"  # XLA's simulated CPU devices


def pin_cores(count: int) -> None:
    """This process on the first `count` cores it may use, before JAX starts its threads; said
    on stderr when it may use fewer (then it runs on those it has)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < count:
        print(f"cpu_cores {count}: this process may use {len(allowed)} cores "
              f"({allowed}); it runs on those", file=sys.stderr)  # fmt: skip
        return
    os.sched_setaffinity(0, allowed[:count])


def prepare_environment(config: TrialConfig) -> None:
    """The process environment a trial of `config` compiles and runs in (JAX platform, the
    trial's LIBTPU flags, checked): before JAX and libtpu start, as they read it once."""
    if config.backend == "cpu" or config.compile_target:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # AOT for TPU needs no TPU backend
    if config.cpu_cores:
        pin_cores(config.cpu_cores)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if config.backend == "cpu" and config.num_devices and SIMULATED not in xla_flags:
        # A configuration that names its CPU devices brings them (an exported trial reruns so).
        os.environ["XLA_FLAGS"] = f"{xla_flags} --{SIMULATED}={config.num_devices}".strip()
    if config.compile_target:
        # AOT opens no TPU device, so concurrent compile trials may share libtpu; without this
        # the second process fails on libtpu's single-process lockfile.
        os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    flags = config.xla.libtpu_init_args()
    if flags and config.compile_target:
        from trainer.trial.flags import unknown_flag

        rejected = unknown_flag(tuple(flags))
        if rejected:
            raise ConfigError("xla", f"{rejected}; remove or fix the flag")
    tpu = config.compile_target or config.backend == "tpu"
    if tpu and BASE_LIBTPU_ARGS not in os.environ:
        # Once: a twin compile's child starts from the base, which holds them already.
        host = os.environ.get("LIBTPU_INIT_ARGS", "")
        wanted = [RAGGED_DOT_KERNEL, *(COMPILER_STACKS if config.compile_target else ())]
        missing = [f for f in wanted if f not in host.split()]
        os.environ["LIBTPU_INIT_ARGS"] = " ".join([host, *missing]).strip()
    # What the host had before the trial's flags: a compile trial's twin compiles start there.
    os.environ.setdefault(BASE_LIBTPU_ARGS, os.environ.get("LIBTPU_INIT_ARGS", ""))
    if flags:
        os.environ["LIBTPU_INIT_ARGS"] = " ".join(
            [os.environ.get("LIBTPU_INIT_ARGS", ""), *flags]
        ).strip()
    cache = os.environ.get(JAX_CACHE_ENV)
    if cache and not config.compile_target:
        # Run trials only: the cache key does not hold LIBTPU flags, so a TPU compile trial
        # could be answered with a program compiled under other flags (JAX 0.10 stores no
        # topology compile there today, measured; this keeps it so).
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    if config.backend == "cpu" or config.compile_target:
        # libtpu probes for TPU hosts at import; on a host without them that is noise
        # (docs/facts.md, TPU7x). Never on a real TPU host: a multi-host slice reads these to find its peers.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def _estimate(config: TrialConfig) -> dict:
    from trainer.estimate.analytic import estimate
    from trainer.trial.hardware import Topology

    try:
        topology = Topology.parse(config.compile_target or "")
    except ValueError as exc:
        raise ConfigError("compile_target", str(exc)) from None
    return estimate(config, topology.accelerator, topology.devices)


def _tiles(config: TrialConfig, limits: str, maxtext: str | None = None) -> None:
    """`--tiles-vmem`: the trial's kernels tuned under each limit, a JSON line each; with
    `maxtext` (the MaxText trial's request), only those MaxText takes tiles for."""
    if not config.compile_target:
        raise ConfigError("compile_target", "the tuner compiles for a TPU target: set --target")
    try:
        kib = [int(v) for v in limits.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(
            "--tiles-vmem", f"{limits!r}: KiB as integers, e.g. 16384,65536"
        ) from None
    untaken = None
    if maxtext:
        from trainer.maxtext.tiles import UNTAKEN, untunable
        from trainer.trial.maxtext import MaxTextProgram

        program = MaxTextProgram.model_validate(json.loads(maxtext).get("program", {}))
        why = untunable(config, program)
        if why:
            raise ConfigError("kernels", f"no kernel to tune for MaxText here: {why}")
        untaken = UNTAKEN
    from trainer.compile.aot import topology_devices  # imports JAX: after the environment
    from trainer.compile.tiles.search import per_vmem

    def told(limit: int, done: int, total: int, kernel: str) -> None:  # `sweeper tiles` shows it
        said = {"event": "tuning", "limit": limit, "limits": len(kib), "done": done,
                "total": total, "kernel": kernel}  # fmt: skip
        print(json.dumps(said), flush=True)

    devices = topology_devices(config.compile_target)
    for record in per_vmem(config, kib, devices, untaken, told):
        print(json.dumps(record), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument(
        "--config", required=True, help="trial configuration JSON file, or - for stdin"
    )
    parser.add_argument("--compile-only", action="store_true", help="AOT-compile for --target")
    parser.add_argument("--target", help="TPU topology, e.g. tpu7x:4x4x4 (sets compile_target)")
    parser.add_argument(
        "--estimate-only", action="store_true", help="analytic estimate for --target"
    )
    parser.add_argument(
        "--coordinator", help="host:port of process 0 (multi-host trials: jax.distributed)"
    )
    parser.add_argument(
        "--num-processes", type=int, default=1, help="trainer processes in the trial"
    )
    parser.add_argument("--process-id", type=int, default=0, help="this process' index (0 speaks)")
    parser.add_argument(
        "--tiles-vmem",
        help="no trial: tune its kernel tiles for --target under each scoped VMEM limit (KiB, "
        "comma-separated), one JSON line a limit (`sweeper tiles`)",
    )
    parser.add_argument(
        "--maxtext",
        help="run the trial through MaxText: JSON {program: the space's maxtext section, "
        "knobs: the point's maxtext.* values, target}",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one trial; its events on stdout, its failure class as the exit code."""
    args = _parser().parse_args(argv)
    # In a multi-host trial process 0 writes the event stream; the others only their failures.
    emitter = Emitter(only=None if args.process_id == 0 else frozenset({"failure"}))
    phase = ["configure"]  # where the trial is, for classifying an unexpected exception
    try:
        _trial(args, emitter, phase)
        return 0
    except ConfigError as exc:
        emitter.emit(
            Failure(failure_class=FailureClass.INVALID_CONFIG, field=exc.field, message=exc.message)
        )
        return EXIT_CODES[FailureClass.INVALID_CONFIG]
    except TrialFailure as exc:
        emitter.emit(exc.event())
        return EXIT_CODES[exc.failure_class]
    except Exception as exc:  # classified, never lost
        # Once the step has compiled, what breaks is the run (a peer's broken collective
        # while the first step's metrics are read back is not a compile error).
        ran = any(e["event"] in ("compiled", "step") for e in emitter.events)
        failure_class = classify_exception(exc, "run" if ran else phase[0])
        emitter.emit(
            Failure(
                failure_class=failure_class,
                message=f"{type(exc).__name__}: {exc}"[:4000],
                traceback=traceback.format_exc()[-4000:],
            )
        )
        return EXIT_CODES[failure_class]


def _trial(args: argparse.Namespace, emitter: Emitter, phase: list[str]) -> None:
    """The trial at its fidelity: an estimate, a compile for the target, or a run; raises
    ConfigError or TrialFailure for a classified ending."""
    config = _read_config(args.config)
    if args.target:
        config = config.model_copy(update={"compile_target": args.target})
    if (args.compile_only or args.estimate_only) and not config.compile_target:
        raise ConfigError(
            "compile_target", "--compile-only/--estimate-only need --target (e.g. tpu7x:2x2x1)"
        )
    if args.tiles_vmem:  # no trial: its kernels tuned (as MaxText takes them, for a MaxText one)
        prepare_environment(config)
        _tiles(config, args.tiles_vmem, args.maxtext)
        return
    if args.maxtext:  # MaxText runs in its own Python, with an environment of its own
        if config.compile_target and config.kernels.tune == "compile":
            prepare_environment(config)  # this process compiles Splash for the tuner first
        from trainer.maxtext.driver import maxtext_trial

        phase[0] = "compile"
        emitter.emit(Summary(**maxtext_trial(config, args.maxtext, args.estimate_only, emitter)))
        return
    prepare_environment(config)
    if args.estimate_only:
        emitter.emit(Summary(**_estimate(config)))
        return
    if config.compile_target:
        # Imports JAX and libtpu: after the environment.
        from trainer.compile.aot import compile_for_target

        phase[0] = "compile"
        emitter.emit(Summary(**compile_for_target(config, emitter)))
        return
    if args.num_processes > 1:
        from trainer.parallel.distributed import initialize

        initialize(config, args.coordinator, args.num_processes, args.process_id)
    from trainer.run.train import train  # imports JAX: after the environment is set

    phase[0] = "compile"
    result = train(config, emitter)
    phase[0] = "report"
    emitter.emit(Summary(**result.summary))
    judged = result.summary.get("convergence")
    if judged and not judged["passed"]:
        raise TrialFailure(FailureClass.DIVERGED, f"convergence check failed: {judged['reason']}")
