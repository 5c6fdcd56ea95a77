"""A slice trial's trainer processes: a whole TPU slice reserved with Ray's TPU utilities, one
trainer per host started there by a Ray actor, joined by jax.distributed (process 0
coordinates); every ending kills them all, on every host."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from sweeper.execute.placement import LABEL_SLICE, LABEL_WORKER, Placement
from sweeper.execute.processes import TrainerProcess
from trainer.trial.files import trainer_command


@ray.remote(num_cpus=0)
class TrainerHost:
    """Runs one trainer process of a multi-host trial on the host its bundle pinned it to."""

    def __init__(self) -> None:
        self.process: TrainerProcess | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="sweeper-trial-"))

    def describe(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        labels = {
            k: v[0] if isinstance(v, list) and v else v
            for k, v in (context.get_node_labels() or {}).items()
        }
        worker = str(labels.get(LABEL_WORKER, os.environ.get("TPU_WORKER_ID", "0")))
        return {
            "node_id": context.get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "worker_id": int(worker),
            "slice": labels.get(LABEL_SLICE, os.environ.get("TPU_NAME", "")),
        }

    def free_port(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            port: int = sock.getsockname()[1]
            return port

    def start(self, config_json: str, args: list[str], env: dict[str, str]) -> int:
        path = self.workdir / "trial.json"
        path.write_text(config_json)
        self.process = TrainerProcess(
            trainer_command(path, args), {**os.environ, **env}, self.workdir / "trainer.log"
        )
        return self.process.proc.pid

    def drain(self) -> tuple[list[str], int | None]:
        return self.process.drain() if self.process else ([], None)

    def kill(self) -> None:
        if self.process:
            self.process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the trial's config and log copy


class RemoteHandle:
    def __init__(self, actor: Any, where: dict[str, Any]):
        self.actor, self.where = actor, where

    def drain(self) -> tuple[list[str], int | None]:
        # A host (or its Ray worker) that died raises RayActorError, one that stopped answering
        # GetTimeoutError: infrastructure faults, which Tune retries on another slice.
        drained: tuple[list[str], int | None] = ray.get(self.actor.drain.remote(), timeout=60)
        return drained

    def kill(self) -> None:
        # The actor (or its host) may be gone already: then so is its trainer.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.actor.kill.remote(), timeout=10)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(self.actor)


def release_reservation(owner: str) -> None:
    """Remove the placement groups named for `owner` (a trial), if any are left.

    A slice trial's driver that died with its host never released its reservation, and
    Ray keeps a non-detached placement group until the job ends (and moves its bundles to
    another slice when their node dies): the trial's next attempt removes them first.
    """
    from ray.util.placement_group import get_placement_group, remove_placement_group

    for part in ("head", "slice"):
        with contextlib.suppress(ValueError):  # none by that name
            remove_placement_group(get_placement_group(f"{owner}-{part}"))


@contextlib.contextmanager
def reserve_slice(placement: Placement, timeout_s: float, owner: str) -> Iterator[list[Any]]:
    """A whole slice reserved with Ray's TPU utilities, and one TrainerHost per host, in
    worker-id order (process i runs on worker i; process 0 coordinates).

    The slice's head resource is reserved first, in a placement group named for `owner`,
    then its hosts (`SlicePlacementGroup`, pinned to that slice by name).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    release_reservation(owner)
    head = placement_group(
        [{placement.head_resource: 1}],
        bundle_label_selector=[{**placement.label_selector, LABEL_WORKER: "0"}],
        name=f"{owner}-head",
    )
    reservation = None
    actors: list[Any] = []
    try:
        reservation = _reserve_hosts(placement, head, timeout_s, owner)
        actors = _host_actors(reservation)
        described = ray.get([a.describe.remote() for a in actors], timeout=timeout_s)
        ordered = sorted(zip(described, actors, strict=True), key=lambda pair: pair[0]["worker_id"])
        yield [RemoteHandle(actor, where) for where, actor in ordered]
    finally:
        for actor in actors:  # also those started before a failure, never handed out
            RemoteHandle(actor, {}).kill()
        if reservation is not None:
            reservation.shutdown()
        # Best effort: the group may be gone with its node; Ray frees it with the job anyway.
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            remove_placement_group(head)


def _reserve_hosts(placement: Placement, head: Any, timeout_s: float, owner: str) -> Any:
    """Once the slice's head is held: every host of that slice, one bundle each
    (a `SlicePlacementGroup` pinned to the slice by name), ready."""
    from ray.util.tpu import SlicePlacementGroup

    try:
        ray.get(head.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"no free {placement.target} slice within {timeout_s:.0f} s "
            f"(every {placement.head_resource} was held)"
        ) from None
    node = ray.util.placement_group_table(head)["bundles_to_node_id"][0]
    labels = next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node)
    selector = {**placement.label_selector, LABEL_SLICE: labels[LABEL_SLICE]}
    assert placement.topology and placement.accelerator_version, "a slice placement"
    reservation = SlicePlacementGroup(
        topology=placement.topology,
        accelerator_version=placement.accelerator_version,
        bundle_label_selector=[selector] * placement.processes,
        name=f"{owner}-slice",
    )
    group = reservation.placement_group
    assert group is not None, "made by SlicePlacementGroup"
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except BaseException:
        reservation.shutdown()
        raise
    return reservation


def _host_actors(reservation: Any) -> list[Any]:
    """One TrainerHost on each host of the reservation (bundle i, its TPU chips)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = reservation.bundle_resources
    return [
        TrainerHost.options(  # type: ignore[attr-defined]  # a Ray actor class
            num_cpus=bundle.get("CPU", 0),
            resources={"TPU": bundle["TPU"]},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                reservation.placement_group, placement_group_bundle_index=i
            ),
        ).remote()
        for i in range(reservation.num_bundles)
    ]


def start_slice(
    handles: list[RemoteHandle], config_json: str, args: list[str], env: dict[str, str]
) -> None:
    """Start one trainer per host, joined by jax.distributed with process 0 as coordinator."""
    port = ray.get(handles[0].actor.free_port.remote())
    coordinator = f"{handles[0].where['address']}:{port}"
    pids = ray.get(
        [
            h.actor.start.remote(
                config_json,
                [
                    *args,
                    "--coordinator",
                    coordinator,
                    "--num-processes",
                    str(len(handles)),
                    "--process-id",
                    str(i),
                ],
                env,
            )
            for i, h in enumerate(handles)
        ]
    )
    for handle, pid in zip(handles, pids, strict=True):
        handle.where["pid"] = pid
