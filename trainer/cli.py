"""`python -m trainer --config trial.json`: run one trial and stream events on stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from trainer.config import ConfigError, TrialConfig, load_config
from trainer.events import EXIT_CODES, Emitter, TrialFailure, classify_exception


def _read_config(path: str) -> TrialConfig:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"not valid JSON ({exc})") from None
    return load_config(data)


def _prepare_environment(config: TrialConfig) -> None:
    # Must happen before JAX initializes: the platform is read once per process.
    if config.backend == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument(
        "--config", required=True, help="trial configuration JSON file, or - for stdin"
    )
    args = parser.parse_args(argv)
    emitter = Emitter()
    phase = "configure"
    try:
        config = _read_config(args.config)
        _prepare_environment(config)
        from trainer.run import train  # imports JAX: after the environment is set

        phase = "compile"
        result = train(config, emitter)
        phase = "report"
        emitter.emit("summary", **result.summary)
        judged = result.summary.get("convergence")
        if judged and not judged["passed"]:
            raise TrialFailure("diverged", f"convergence check failed: {judged['reason']}")
        return 0
    except ConfigError as exc:
        emitter.emit(
            "failure", failure_class="invalid_config", field=exc.field, message=exc.message
        )
        return EXIT_CODES["invalid_config"]
    except TrialFailure as exc:
        emitter.emit("failure", failure_class=exc.failure_class, message=exc.message, **exc.details)
        return EXIT_CODES[exc.failure_class]
    except Exception as exc:  # classified, never lost
        if any(e["event"] == "step" for e in emitter.events):
            phase = "run"
        failure_class = classify_exception(exc, phase)
        emitter.emit(
            "failure",
            failure_class=failure_class,
            message=f"{type(exc).__name__}: {exc}"[:4000],
            traceback=traceback.format_exc()[-4000:],
        )
        return EXIT_CODES[failure_class]
