"""Tests run JAX on CPU with 8 simulated devices; set before anything imports JAX."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# libtpu's start-up chatter on hosts without TPUs (TPU7X.md): quiet, not an error.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Tests compile for TPU topologies in several processes at once; none opens a TPU device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One cache per test session: convergence references and the measured CPU peak."""
    return tmp_path_factory.mktemp("cache")
