"""The trainer as the engine sees it: a child process, JSON events, classified exit codes."""

from __future__ import annotations

import pytest

from sweeper.space.schema import Objective
from tests.helpers import run_trainer, trial
from trainer.trial.events import (
    EXIT_CODES,
    JAX_CACHE_ENV,
    MEASURED_METRICS,
    STEP_METRICS,
    FailureClass,
    ProtocolError,
    Step,
    parse_event,
)


def _failure(events):
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 1, events
    return failures[0]


def test_success_streams_accepted_compiled_steps_summary(tmp_path, cache_dir):
    code, events, err = run_trainer(trial(steps=4, convergence={"enabled": False}), tmp_path)
    assert code == 0, err[-2000:]
    kinds = [e["event"] for e in events]
    assert kinds == ["accepted", "compiled", "step", "step", "step", "step", "summary"]
    summary = events[-1]
    assert summary["fidelity"] == "run" and summary["backend"] == "cpu"
    assert summary["timed_steps"] == 2  # 4 steps minus the 2 warm-up steps
    assert summary["tokens_per_step"] == 8 * 64
    assert summary["tokens_per_sec"] == pytest.approx(512 / summary["step_time_median_s"])
    assert 0 < summary["mfu"] < 1 and summary["peak_source"] == "measured"
    assert events[1]["memory_per_device"]["temp_size_in_bytes"] > 0
    # The metric lists the engine logs and optimizes are the protocol's, and a run fills them.
    assert all(summary[m] > 0 for m in MEASURED_METRICS)
    assert all(isinstance(events[2][m], float) for m in STEP_METRICS)


def test_run_trials_share_a_persistent_compile_cache(tmp_path, monkeypatch):
    """With $SWEEPER_JAX_CACHE_DIR a run trial's programs are stored there, the trial says
    the cache was in use, and the same trial again loads them (nothing written again)."""
    cache = tmp_path / "jax"
    monkeypatch.setenv(JAX_CACHE_ENV, str(cache))
    config = trial(steps=2, convergence={"enabled": False})
    code, events, err = run_trainer(config, tmp_path)
    assert code == 0, err[-2000:]
    compiled = next(e for e in events if e["event"] == "compiled")
    assert compiled["compile_cache"] == str(cache)
    entries = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any(name.startswith("jit_train_step") for name in entries), entries
    code, _, err = run_trainer(config, tmp_path)  # a miss would compile and write again
    assert code == 0, err[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == entries


def test_a_line_that_breaks_the_protocol_is_refused_not_guessed():
    assert parse_event("I1130 12:00:00 a log line") is None
    assert parse_event('{"not": "an event"}') is None
    step = parse_event('{"event": "step", "step": 3, "step_time_s": 0.5, "loss": 2.0, '
                       '"aux_loss": 0.0, "grad_norm": 1.0}')  # fmt: skip
    assert isinstance(step, Step) and step.loss == 2.0
    with pytest.raises(ProtocolError, match="step"):
        parse_event('{"event": "step", "step": 3}')  # figures missing
    with pytest.raises(ProtocolError, match="failure"):
        parse_event('{"event": "failure", "failure_class": "melted", "message": "x"}')
    with pytest.raises(ProtocolError, match="summary"):
        parse_event('{"event": "summary", "fidelity": "run", "hardware": "cpu", "chips": 1, '
                    '"tokens_per_sec_per_chp": 5}')  # fmt: skip
    assert set(EXIT_CODES) == set(FailureClass) and len(set(EXIT_CODES.values())) == 7
    # A space's default objective is a figure the protocol marks as measured.
    assert Objective().metric in MEASURED_METRICS and "est_mfu" not in MEASURED_METRICS


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"mesh": {"fsdp": 2, "tensor": 2}}, "mesh", "product of degrees"),
        ({"mesh": {"fsdp": 1, "tensor": 8}}, "mesh", "not divisible by mesh axes"),
        ({"per_device_batch": 0.3}, "per_device_batch", "not a whole batch"),
        (
            {"mesh": {"data": 8, "fsdp": 1}, "per_device_batch": 0.5},
            "per_device_batch",
            "not divisible by data x fsdp x expert",
        ),
        ({"mesh": {"fsdp": 1, "context": 8}, "seq_len": 24}, "seq_len", "2 x context"),
        (
            {"model": {"preset": "tiny-moe"}, "mesh": {"fsdp": 1, "expert": 8}},
            "mesh",
            "not divisible",
        ),
        ({"learning_rate": -1}, "learning_rate", "greater than 0"),
    ],
)
def test_invalid_config_names_field(tmp_path, change, field, fragment):
    code, events, _ = run_trainer(trial() | change, tmp_path)
    failure = _failure(events)
    assert code == EXIT_CODES["invalid_config"]
    assert failure["failure_class"] == "invalid_config"
    assert failure["field"] == field and fragment in failure["message"]


def test_forced_nan_is_diverged(tmp_path):
    code, events, _ = run_trainer(trial(steps=5, fault={"nan_at_step": 2}), tmp_path)
    failure = _failure(events)
    assert (code, failure["failure_class"], failure["step"]) == (
        EXIT_CODES["diverged"],
        "diverged",
        2,
    )
    assert [e["step"] for e in events if e["event"] == "step"] == [0, 1, 2]


def test_memory_over_budget_is_oom_hbm(tmp_path):
    code, events, _ = run_trainer(trial(limits={"device_memory_gib": 1e-4}), tmp_path)
    failure = _failure(events)
    assert (code, failure["failure_class"]) == (EXIT_CODES["oom_hbm"], "oom_hbm")
    assert failure["needed_gib"] > failure["budget_gib"]
    assert not any(e["event"] == "step" for e in events)


def test_convergence_reference_is_a_dedicated_run_with_a_tolerance_from_its_noise(
    tmp_path, cache_dir
):
    """The smoke recipe of benchmarks/convergence_noise.py: 40 steps, where another
    initialization ends 0.5-1% away, half the learning rate 3.7% and a reshard 0.02%."""
    from trainer.run.convergence import NOISE_MULTIPLE, TOLERANCE_FLOOR

    check = {"enabled": True, "cache_dir": str(cache_dir / "dedicated"), "window": 5}
    base = trial(steps=40, learning_rate=1e-2, convergence=check)
    # The first trial of the recipe is resharded: the reference must not be its own run.
    code, events, err = run_trainer(base | {"mesh": {"fsdp": 4, "tensor": 2}}, tmp_path)
    assert code == 0, err[-2000:]
    verdict = events[-1]["convergence"]
    assert verdict["passed"] and verdict["reference_source"] == "computed"
    assert verdict["reference_mesh"]["fsdp"] == -1 and verdict["reference_mesh"]["tensor"] == 1
    assert verdict["baseline_numerics"]  # only its sharding differs from the reference
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert verdict["reference_final_loss"] != sum(losses[-5:]) / 5  # another program's curve
    assert 0 < verdict["seed_noise"] < 0.02
    assert verdict["tolerance"] == max(NOISE_MULTIPLE * verdict["seed_noise"], TOLERANCE_FLOOR)

    code, events, _ = run_trainer(base, tmp_path)
    verdict = events[-1]["convergence"]  # the canonical mesh itself, judged from the cache
    assert code == 0 and verdict["passed"] and verdict["reference_source"] == "cache"

    # Half the learning rate, judged against the recipe's (as a sweep sampling it sets up).
    halved = base | {
        "learning_rate": 5e-3,
        "convergence": check | {"recipe": {"learning_rate": 1e-2}},
    }
    code, events, _ = run_trainer(halved, tmp_path)
    summary = next(e for e in events if e["event"] == "summary")
    assert not summary["convergence"]["passed"], summary["convergence"]
    assert code == EXIT_CODES["diverged"]
    assert _failure(events)["failure_class"] == "diverged"

    code, events, _ = run_trainer(base | {"fault": {"grad_scale": 0.0}}, tmp_path)
    assert code == EXIT_CODES["diverged"]


def test_concurrent_trials_of_a_recipe_compute_one_reference(tmp_path, cache_dir):
    """Two trials starting together: the second waits on the recipe's lock and reads the
    first one's reference instead of computing its own."""
    import concurrent.futures

    check = {"enabled": True, "cache_dir": str(cache_dir / "concurrent"), "window": 2}
    configs = [trial(steps=6, convergence=check, mesh=m) for m in ({"fsdp": 8}, {"tensor": 2})]
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run_trainer, configs, dirs))
    sources = sorted(events[-1]["convergence"]["reference_source"] for _, events, _ in runs)
    assert sources == ["cache", "computed"]


def test_unparseable_config_is_invalid(tmp_path, capsys):
    from trainer.cli import main

    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["--config", str(path)]) == EXIT_CODES["invalid_config"]
    assert '"field": "config"' in capsys.readouterr().out


def test_time_limit_is_timeout(tmp_path):
    code, events, _ = run_trainer(trial(steps=50, limits={"time_limit_s": 0.001}), tmp_path)
    failure = _failure(events)
    assert (code, failure["failure_class"], failure["step"]) == (
        EXIT_CODES["timeout"],
        "timeout",
        0,
    )
