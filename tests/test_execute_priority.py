"""A trial's processes run at the driver's priority, not below it: Ray starts its workers at
niceness 15, and a trial's trainer, a child of its worker, inherited it (on a host with other
work, a CPU sweep's trials then started a minute or more late: sweeper/execute/cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from sweeper.execute.cluster import WORKER_NICENESS
from tests.helpers import REPO

# A private Ray started as a sweep starts it; a task there reports its niceness and that of a
# process it starts (as a trial's worker starts the trainer).
_PROBE = textwrap.dedent("""
    import os, subprocess, ray
    from sweeper.execute.cluster import start_ray, stop_ray
    start_ray()

    @ray.remote
    def niceness():
        child = subprocess.run(["sh", "-c", "ps -o ni= -p $$"], capture_output=True, text=True)
        return os.nice(0), int(child.stdout)

    print("NICE", os.nice(0), *ray.get(niceness.remote()))
    stop_ray()
""")


def test_a_private_rays_workers_and_their_children_run_at_the_drivers_niceness():
    env = {k: v for k, v in os.environ.items() if k != WORKER_NICENESS}  # as a user's shell
    done = subprocess.run(["nice", "-n", "5", sys.executable, "-c", _PROBE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("NICE")]
    assert line.split()[1:] == ["5", "5", "5"], line
