"""Tests run JAX on CPU with 8 simulated devices; set before anything imports JAX."""

from __future__ import annotations

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# libtpu's start-up chatter on hosts without TPUs (docs/facts.md, TPU7x): quiet, not an error.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Tests compile for TPU topologies in several processes at once; none opens a TPU device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The Ray clusters the suite starts stand for a user's own (a pipeline's ray.init, a
# cluster_utils cluster): started as docs/cluster.md asks, their workers (and the trainers
# they start) at the suite's own priority, not 15 niceness steps below its other worker.
os.environ.setdefault("RAY_worker_niceness", "0")
# The many run trials of the suite (sweeps, trainer processes) share JAX's persistent
# compilation cache: a tiny model's 8 s CPU compile becomes a 1 s load. Run trials only
# (trainer/cli.py); TPU compile trials always compile. No test times a CPU compile.
os.environ.setdefault(
    "SWEEPER_JAX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"sweeper-tests-jax-{os.getuid()}")
)

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per test session: convergence references and the measured CPU peak."""
    return tmp_path_factory.mktemp("cache")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """pytest-xdist's `--dist loadgroup` sends tests sharing an `xdist_group` to one worker by
    a `@group` suffix on their node ids; xdist 3.8 writes it to `item._nodeid`, which pytest 9
    no longer reads (the id is `item._id`), so no test was grouped. Write it where pytest 9
    reads it, on xdist's workers only."""
    import dataclasses

    if not os.environ.get("PYTEST_XDIST_WORKER") or not config.getvalue("loadgroup"):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        node_id = getattr(item, "_id", None)
        if not names or node_id is None or "@" in str(node_id):
            continue
        grouped = dataclasses.replace(node_id)
        object.__setattr__(grouped, "_str_cache", f"{node_id}@{'_'.join(names)}")
        item._id = grouped


@pytest.fixture(scope="session")
def compile_once(tmp_path_factory):
    """Tests that need the same TPU7x program share one compile of it (per test process)."""
    import json

    from tests.compile_helpers import _compile

    done: dict[str, tuple] = {}

    def get(config: dict):
        key = json.dumps(config, sort_keys=True)
        if key not in done:
            done[key] = _compile(tmp_path_factory.mktemp("shared"), config)
        return done[key]

    return get
