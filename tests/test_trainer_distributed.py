"""A multi-host trial's trainer processes, joined by jax.distributed on this host (no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO, free_port, trial
from trainer.trial.events import parse_event, parse_line

# XLA:CPU's gloo collectives give up on a peer that has not reached the first collective
# within 30 s (GetKeyValue() timed out ... duration: 30s); a host that misses the compile
# cache arrives that late.
GLOO_PATIENCE_S = 30


def test_a_host_that_compiles_long_after_its_peer_still_joins_the_first_step(tmp_path):
    config = trial(
        steps=3,
        mesh={"fsdp": -1, "tensor": 2},
        fault={"slow_compile_s": GLOO_PATIENCE_S + 15, "crash_process": 1},
    )
    path = tmp_path / "trial.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.pop("JAX_PLATFORMS", None)
    coordinator = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "trainer", "--config", str(path), "--coordinator", coordinator]
    procs = [
        subprocess.Popen(
            [*argv, "--num-processes", "2", "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    (out0, err0), (_, err1) = outputs
    assert [p.returncode for p in procs] == [0, 0], (err0[-1500:], err1[-1500:])
    events = [parse_event(line) for line in out0.splitlines() if parse_line(line)]
    steps = [e for e in events if e.event == "step"]
    summary = events[-1]
    assert len(steps) == 3 and summary.event == "summary"
    assert summary.processes == 2 and summary.num_devices == 8
    # The late host's wait is not counted as a step: process 0 timed from the barrier on.
    assert summary.train_s < GLOO_PATIENCE_S, summary.train_s
