"""Where a sweep's trials run: the Ray cluster, read once per sweep, and what each trial reserves.

JAX-free on purpose: the driver decides placement from Ray's view of its nodes (resources
and the TPU labels KubeRay / Ray set on TPU hosts), never from a JAX backend of its own.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from sweeper.space.errors import SpaceError
from sweeper.space.schema import Space
from trainer.trial.hardware import ACCELERATORS, Backend, Topology

LABEL_ACCELERATOR = "ray.io/accelerator-type"
LABEL_SLICE = "ray.io/tpu-slice-name"
LABEL_WORKER = "ray.io/tpu-worker-id"
LABEL_TOPOLOGY = "ray.io/tpu-topology"
LABEL_POD_TYPE = "ray.io/tpu-pod-type"

# Our target prefix -> (Ray's accelerator-type label, Ray's accelerator version).
RAY_TPU_NAMES = {
    "tpu7x": ("TPU-V7X", "v7x"),
    "v5p": ("TPU-V5P", "v5p"),
    "v6e": ("TPU-V6E", "v6e"),
    "v5e": ("TPU-V5LITEPOD", "v5litepod"),
}
# The Tune trial of a slice only reserves and watches: its trainers hold the hosts.
SLICE_DRIVER_RESOURCES = {"CPU": 0.01}
# A sliver of the driver node's own resource keeps `local` trials on the driver host.
NODE_AFFINITY = 0.001


@dataclass(frozen=True)
class Host:
    """One alive Ray node, as the scheduler sees it."""

    node_id: str
    address: str
    resources: dict[str, float]
    labels: dict[str, str]

    @classmethod
    def from_ray(cls, node: dict[str, Any]) -> Host:
        return cls(
            node_id=node["NodeID"],
            address=node["NodeManagerAddress"],
            resources=dict(node.get("Resources") or {}),
            labels=dict(node.get("Labels") or {}),
        )

    @property
    def worker_id(self) -> int:
        return int(self.labels.get(LABEL_WORKER, "0"))


@dataclass(frozen=True)
class Slice:
    """A complete TPU slice: every host alive, worker ids 0..n-1, the head resource on worker 0."""

    name: str
    hosts: tuple[Host, ...]
    chips_per_host: int


@dataclass(frozen=True)
class Placement:
    """What one trial reserves and how its trainer processes are laid out."""

    kind: Literal["single", "slice"]  # one trainer, child of the Tune trial; or one per slice host
    backend: Backend  # cpu, gpu or tpu: where the trainers' JAX runs (a slice may run on cpu)
    num_devices: int  # global JAX devices of one trial
    processes: int  # trainer processes per trial, one per host
    devices_per_process: int
    capacity: int  # trials that can hold their hardware at once
    trial_resources: dict[str, float]  # what the Ray Tune trial itself reserves
    cpus_per_trial: int = 0  # cores a local CPU trainer is pinned to (0: not pinned)
    target: str = "local"
    accelerator_version: str | None = None
    head_resource: str | None = None  # Ray's slice token on worker 0 (TPU-<pod type>-head)
    topology: str | None = None
    label_selector: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def process_env(self) -> dict[str, str]:
        """Environment of every trainer process (set before JAX starts in it)."""
        if self.backend != Backend.CPU:
            return {}
        return {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.devices_per_process}",
            "JAX_PLATFORMS": "cpu",
        }


def alive_hosts() -> list[Host]:
    import ray

    return [Host.from_ray(n) for n in ray.nodes() if n.get("Alive")]


def driver_host(hosts: list[Host]) -> Host:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(h for h in hosts if h.node_id == node_id)


def find_slices(hosts: list[Host], target: Topology | str) -> tuple[list[Slice], list[str]]:
    """Complete slices of `target` (e.g. tpu7x:2x2x2), and why incomplete ones were left out."""
    topo = target if isinstance(target, Topology) else Topology.parse(target)
    accelerator_type, _ = RAY_TPU_NAMES[topo.prefix]
    topology, chips = topo.shape, topo.slice_chips
    groups: dict[str, list[Host]] = defaultdict(list)
    for host in hosts:
        if (
            host.labels.get(LABEL_ACCELERATOR) == accelerator_type
            and host.labels.get(LABEL_TOPOLOGY) == topology
            and host.resources.get("TPU", 0) > 0
        ):
            groups[host.labels.get(LABEL_SLICE) or host.node_id].append(host)
    slices, skipped = [], []
    for name, members in sorted(groups.items()):
        members.sort(key=lambda h: h.worker_id)
        per_host = int(members[0].resources["TPU"])
        expected = max(1, chips // per_host)
        ids = [h.worker_id for h in members]
        head = f"TPU-{members[0].labels.get(LABEL_POD_TYPE, '?')}-head"  # Ray's slice token
        if ids != list(range(expected)):
            skipped.append(f"{name}: worker ids {ids}, a {topology} slice needs 0..{expected - 1}")
        elif expected > 1 and members[0].resources.get(head, 0) < 1:
            skipped.append(f"{name}: worker 0 lacks the {head} resource Ray reserves slices by")
        else:
            slices.append(Slice(name, tuple(members), per_host))
    return slices, skipped


def _describe_cluster(hosts: list[Host]) -> str:
    tpu = sorted(
        {
            f"{h.labels.get(LABEL_ACCELERATOR, '?')} {h.labels.get(LABEL_TOPOLOGY, '?')}"
            for h in hosts
            if h.resources.get("TPU")
        }
    )
    gpus = sum(h.resources.get("GPU", 0) for h in hosts)
    cpus = sum(h.resources.get("CPU", 0) for h in hosts)
    return (
        f"{len(hosts)} nodes, {cpus:g} CPUs, {gpus:g} GPUs, TPU hosts: {', '.join(tpu) or 'none'}"
    )


def _requested_backend(space: Space) -> str:
    return str(space.trial.get("backend", "auto"))


def resolve(space: Space, hosts: list[Host], driver: Host) -> Placement:
    """The placement of this space's trials on this cluster; SpaceError when it has no room."""
    if space.target.is_local:
        requested = _requested_backend(space)
        if requested == "cpu" or (requested == "auto" and not _accelerators(driver)):
            return _cpu(space, hosts)
        return _local(space, driver)
    if space.target.is_gpu:
        return _gpu_host(space, hosts)
    return _slice(space, hosts)


def _accelerators(host: Host) -> bool:
    return bool(host.resources.get("TPU", 0) or host.resources.get("GPU", 0))


def _cpu(space: Space, hosts: list[Host]) -> Placement:
    """Local CPU trials on whichever nodes have CPUs (the driver's host among them when it has
    some): each trial holds `cpus_per_trial` cores of one node and its trainer is pinned to
    cores no other trial of that node holds."""
    node_cpus = [int(h.resources.get("CPU", 0)) for h in hosts]
    most = max(node_cpus, default=0)
    if most < 1:
        raise SpaceError(
            f"no node of the Ray cluster offers CPUs ({_describe_cluster(hosts)}); give a node "
            "CPUs (ray start --num-cpus) or ray.init num_cpus",
            field="target",
        )
    per_trial = space.resources.cpus_per_trial or max(1, most // space.search.concurrency)
    if per_trial > most:
        raise SpaceError(
            f"{per_trial} CPUs per trial, but no node has more than {most} "
            f"({_describe_cluster(hosts)})",
            field="resources.cpus_per_trial",
        )
    capacity = sum(c // per_trial for c in node_cpus)
    nodes = sum(c >= per_trial for c in node_cpus)
    devices = space.devices or 8
    return Placement(
        kind="single",
        backend=Backend.CPU,
        num_devices=devices,
        processes=1,
        devices_per_process=devices,
        capacity=capacity,
        trial_resources={"CPU": per_trial},
        cpus_per_trial=per_trial,
        description=f"local cpu: {devices} simulated devices pinned to {per_trial} core"
        f"{'s' if per_trial > 1 else ''} of a node; {nodes} node{'s' if nodes > 1 else ''} "
        f"with CPUs hold{'s' if nodes == 1 else ''} {capacity} such trial"
        f"{'s' if capacity > 1 else ''} at once",
    )


def _local(space: Space, host: Host) -> Placement:
    requested = _requested_backend(space)
    has = {"tpu": host.resources.get("TPU", 0), "gpu": host.resources.get("GPU", 0)}
    if requested == "auto":
        backend = "tpu" if has["tpu"] else "gpu" if has["gpu"] else "cpu"
    else:
        backend = requested
        if backend != Backend.CPU and not has[backend]:
            raise SpaceError(
                f"{backend} requested, but the driver host has none in Ray's resources "
                f"({_describe_cluster([host])}); use backend auto or cpu, or run on a {backend} host",
                field="trial.backend",
            )
    affinity = {f"node:{host.address}": NODE_AFFINITY}
    cpus = int(host.resources.get("CPU", 0))
    count = int(has[backend])
    accelerators = space.devices or count
    if accelerators > count:
        raise SpaceError(
            f"{accelerators} {backend} devices per trial, but the driver host has {count}",
            field="devices",
        )
    devices_per_chip = next(
        (ACCELERATORS[prefix].devices_per_chip for prefix, (label, _) in RAY_TPU_NAMES.items()
         if host.labels.get(LABEL_ACCELERATOR) == label),
        1,
    )  # fmt: skip
    devices = accelerators * (devices_per_chip if backend == Backend.TPU else 1)
    resource = "TPU" if backend == Backend.TPU else "GPU"
    return Placement(
        kind="single",
        backend=Backend(backend),
        num_devices=devices,
        processes=1,
        devices_per_process=devices,
        capacity=count // accelerators,
        trial_resources={"CPU": min(1, cpus) or 0.01, resource: accelerators, **affinity},
        description=f"local {backend}: {accelerators} of {count} {resource} per trial",
    )


def _gpu_host(space: Space, hosts: list[Host]) -> Placement:
    """`gpu:N`: N GPUs of one host; the Tune trial runs on that host, its trainer as a child."""
    gpus = space.target.gpus
    assert gpus is not None, "resolve() sends gpu:N targets here"
    counts = [int(h.resources.get("GPU", 0)) for h in hosts]
    capacity = sum(c // gpus for c in counts)
    if capacity < 1:
        raise SpaceError(
            f"{space.target} needs a Ray node with {gpus} GPUs, and this cluster has none "
            f"({_describe_cluster(hosts)}). Connect with --address to a cluster that has one",
            field="target",
        )
    backend = _requested_backend(space)
    if backend not in ("auto", "gpu", "cpu"):
        raise SpaceError(
            f"a GPU host runs its trainer on gpu (or cpu), not {backend}", field="trial.backend"
        )
    backend = "gpu" if backend == "auto" else backend
    return Placement(
        kind="single",
        backend=Backend(backend),
        num_devices=gpus,
        processes=1,
        devices_per_process=gpus,
        capacity=capacity,
        trial_resources={"CPU": 1, "GPU": gpus},
        target=str(space.target),
        description=f"{space.target}: each trial reserves {gpus} GPU{'s' if gpus > 1 else ''} of one "
        f"host; the cluster holds {capacity} such trial{'s' if capacity > 1 else ''}",
    )


def _slice(space: Space, hosts: list[Host]) -> Placement:
    topo = space.target.tpu
    slices, skipped = find_slices(hosts, topo)
    topology = topo.shape
    accelerator_type, version = RAY_TPU_NAMES[topo.prefix]
    if not slices:
        why = f"; incomplete: {'; '.join(skipped)}" if skipped else ""
        raise SpaceError(
            f"{space.target} with fidelity run needs a Ray cluster with a whole {accelerator_type} "
            f"slice of topology {topology} (hosts labelled {LABEL_ACCELERATOR}={accelerator_type}, "
            f"{LABEL_TOPOLOGY}={topology}, {LABEL_SLICE}, {LABEL_WORKER}), and this cluster has none "
            f"({_describe_cluster(hosts)}{why}). Connect with --address to a cluster that has one, "
            "or use fidelity compile",
            field="target",
        )
    backend = _requested_backend(space)
    if backend == "auto":
        backend = "tpu"
    if backend not in ("tpu", "cpu"):
        raise SpaceError(
            f"a TPU slice runs its trainers on tpu (or cpu, to simulate the layout), not {backend}",
            field="trial.backend",
        )
    first = slices[0]
    per_process = first.chips_per_host * topo.accelerator.devices_per_chip
    processes = len(first.hosts)
    num_devices = topo.devices
    if processes * per_process != num_devices:
        raise SpaceError(
            f"slice {first.name} has {processes} hosts x {first.chips_per_host} chips, "
            f"not the {topo.chips} chips of {space.target}",
            field="target",
        )
    return Placement(
        kind="slice",
        backend=Backend(backend),
        num_devices=num_devices,
        processes=processes,
        devices_per_process=per_process,
        capacity=len(slices),
        trial_resources=dict(SLICE_DRIVER_RESOURCES),
        target=str(space.target),
        accelerator_version=version,
        head_resource=f"TPU-{first.hosts[0].labels.get(LABEL_POD_TYPE, '?')}-head",
        topology=topology,
        label_selector={LABEL_ACCELERATOR: accelerator_type, LABEL_TOPOLOGY: topology},
        description=(
            f"{space.target}: each trial reserves a whole slice ({processes} host"
            f"{'s' if processes > 1 else ''} x {first.chips_per_host} chips); "
            f"{len(slices)} slice{'s' if len(slices) > 1 else ''} in the cluster "
            f"({', '.join(s.name for s in slices)})"
        ),
    )


def compile_placement(space: Space, hosts: list[Host]) -> Placement:
    """Compile and estimate trials need only CPU cores: any node of the cluster with some."""
    node_cpus = [int(h.resources.get("CPU", 0)) for h in hosts]
    if max(node_cpus, default=0) < 1:
        raise SpaceError(
            f"compile trials need a node with CPUs ({_describe_cluster(hosts)})", field="target"
        )
    per_trial = space.resources.cpus_per_trial or max(1, max(node_cpus) // space.search.concurrency)
    capacity = sum(c // per_trial for c in node_cpus)
    if capacity < 1:
        raise SpaceError(
            f"{per_trial} CPUs per trial, but no node has that many ({_describe_cluster(hosts)})",
            field="resources.cpus_per_trial",
        )
    return Placement(
        kind="single",
        backend=Backend.CPU,
        num_devices=space.num_devices,
        processes=1,
        devices_per_process=1,
        capacity=capacity,
        trial_resources={"CPU": per_trial},
        cpus_per_trial=per_trial,
        target=str(space.target),
        description=f"{space.effective_fidelity} trials for {space.target} on any CPU node, "
        f"{per_trial} core{'s' if per_trial > 1 else ''} each",
    )
