"""This host without Ray: whether Ray can start here, and the host as Ray would list it (its
cores, its accelerators and their TPU labels), for a sweep whose trials run one at a time on
it (sweeper/sweep/host.py).

Ray's servers listen on TCP sockets, even for a private local cluster; a host that allows
none (the lent TPU v5e's sandbox refuses every TCP and UDP socket, loopback too) cannot
start Ray at all. The accelerators are read as JAX sees them, in a child process (JAX never
starts in the driver): what the trials will get.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from sweeper.execute.placement import LABEL_ACCELERATOR, RAY_TPU_NAMES, Host
from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space
from trainer.trial.devices import DevicesUnreadable, accelerator_of
from trainer.trial.devices import devices_seen as read_devices

HOST_NODE = "host"  # the node id of this host's trials in a sweep without Ray


def tcp_refused() -> str | None:
    """Why this host cannot open a TCP socket on loopback (Ray's servers need them), or None
    when it can."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            probe.listen(1)
    except OSError as exc:
        return f"a TCP socket on 127.0.0.1 is refused ({exc.strerror or exc})"
    return None


def devices_seen(python: str = sys.executable) -> dict[str, Any]:
    """This host's JAX devices as a trial's process sees them: platform, device kind, count.
    Raises SpaceError when JAX cannot start here."""
    try:
        return read_devices(python)
    except DevicesUnreadable as exc:
        raise SpaceError(
            f"{exc}; another program may hold the accelerator: end it, or set trial.backend: cpu",
            field="trial.backend",
        ) from None


def _wants_devices(space: Space) -> bool:
    """Whether the space's trials would use an accelerator of this host: run trials of a
    local target whose backend is not cpu."""
    backend = str(space.trial.get("backend", "auto"))
    return space.effective_fidelity == "run" and space.target.is_local and backend != "cpu"


def this_host(space: Space, python: str = sys.executable) -> Host:
    """This machine as a node of Ray's would read: its cores, and (where the space's trials
    would use them) its accelerators with the TPU labels Ray gives a TPU host."""
    resources: dict[str, float] = {"CPU": float(len(os.sched_getaffinity(0)))}
    labels: dict[str, str] = {}
    if _wants_devices(space):
        seen = devices_seen(python)
        if seen["platform"] == "tpu":
            accel = accelerator_of(seen["device_kind"])
            per_chip = accel.devices_per_chip if accel else 1
            resources["TPU"] = float(seen["count"] // per_chip)
            if accel and accel.topology_prefix in RAY_TPU_NAMES:
                labels[LABEL_ACCELERATOR] = RAY_TPU_NAMES[accel.topology_prefix][0]
        elif seen["platform"] == "gpu":
            resources["GPU"] = float(seen["count"])
    return Host(
        node_id=f"{HOST_NODE}-{socket.gethostname()}",
        address="127.0.0.1",
        resources=resources,
        labels=labels,
    )
