"""Placement rules on node records as Ray reports them (`ray.nodes()`): what a trial reserves."""

from __future__ import annotations

import pytest

from sweeper.execute.placement import Host, compile_placement, find_slices, resolve
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space

BASE = {
    "name": "p",
    "model": {"preset": "tiny-dense"},
    "trial": {"seq_len": 64},
    "search": {"concurrency": 2},
}


def _host(node: str, cpus: float = 16, **resources) -> Host:
    return Host(node, f"10.0.0.{len(node)}", {"CPU": cpus, **resources}, {})


def _tpu_host(slice_name: str, worker: int, topology: str = "2x2x2") -> Host:
    labels = {
        "ray.io/accelerator-type": "TPU-V7X",
        "ray.io/tpu-slice-name": slice_name,
        "ray.io/tpu-worker-id": str(worker),
        "ray.io/tpu-topology": topology,
        "ray.io/tpu-pod-type": "v7x-16",
    }
    resources = {"CPU": 200, "TPU": 4, **({"TPU-v7x-16-head": 1} if worker == 0 else {})}
    return Host(f"{slice_name}-{worker}", f"10.1.0.{worker}", resources, labels)


def test_local_auto_trains_on_the_driver_hosts_gpus():
    driver = _host("gpu-node", GPU=8)
    placement = resolve(load_space(BASE), [driver], driver)
    assert (placement.kind, placement.backend, placement.num_devices) == ("single", "gpu", 8)
    assert placement.capacity == 1
    assert placement.trial_resources["GPU"] == 8
    assert placement.trial_resources[f"node:{driver.address}"] > 0  # stays on the driver host
    assert placement.process_env() == {}  # no simulated devices, no JAX_PLATFORMS=cpu
    two = resolve(load_space({**BASE, "devices": 2}), [driver], driver)
    assert (two.num_devices, two.capacity, two.trial_resources["GPU"]) == (2, 4, 2)


def test_local_cpu_trials_reserve_the_cores_they_are_pinned_to():
    driver = _host("cpu-node", cpus=16)
    placement = resolve(load_space(BASE), [driver], driver)
    assert placement.backend == "cpu" and placement.cpus_per_trial == 8
    assert placement.trial_resources["CPU"] == 8 and placement.capacity == 2
    assert "device_count=8" in placement.process_env()["XLA_FLAGS"]
    forced = resolve(
        load_space({**BASE, "trial": {"backend": "cpu"}, "resources": {"cpus_per_trial": 4}}),
        [_host("g", GPU=1)],
        _host("g", GPU=1),
    )
    assert (forced.backend, forced.cpus_per_trial, forced.capacity) == ("cpu", 4, 4)


def test_a_backend_the_driver_host_lacks_is_refused():
    driver = _host("cpu-node")
    with pytest.raises(SpaceError, match=r"trial\.backend: gpu requested"):
        resolve(load_space({**BASE, "trial": {"backend": "gpu"}}), [driver], driver)


def test_only_whole_slices_count():
    hosts = [
        _tpu_host("a", 0),
        _tpu_host("a", 1),
        _tpu_host("b", 0),  # worker 1 of b is gone
        _tpu_host("c", 0, topology="4x4x4"),
    ]
    slices, skipped = find_slices(hosts, "tpu7x:2x2x2")
    assert [s.name for s in slices] == ["a"] and [h.worker_id for h in slices[0].hosts] == [0, 1]
    assert len(skipped) == 1 and skipped[0].startswith("b: worker ids [0]")
    space = load_space({**BASE, "target": "tpu7x:2x2x2", "fidelity": "run"})
    placement = resolve(space, hosts, _host("head", cpus=0))
    assert (placement.kind, placement.processes, placement.devices_per_process) == ("slice", 2, 8)
    assert placement.capacity == 1 and placement.trial_resources == {"CPU": 0.01}
    with pytest.raises(SpaceError, match="incomplete: b: worker ids"):
        resolve(space, hosts[2:], _host("head", cpus=0))


def test_compile_trials_go_to_any_cpu_node():
    space = load_space({**BASE, "target": "tpu7x:4x4x4", "fidelity": "compile"})
    placement = compile_placement(space, [_host("head", cpus=0), _host("w1", 8), _host("w2", 8)])
    assert placement.trial_resources == {"CPU": 4} and placement.capacity == 4
    assert placement.num_devices == 128  # the target's devices, for the static checks


def test_gpu_targets_reserve_gpus_on_any_host_of_the_cluster():
    space = load_space({**BASE, "target": "gpu:2"})
    assert space.effective_fidelity == "run"  # auto: a GPU target is attached, nothing to compile
    assert space.objective.primary.metric == "tokens_per_sec_per_chip" and space.num_devices == 2
    hosts = [_host("head", cpus=0), _host("g1", GPU=8), _host("g2", GPU=2)]
    placement = resolve(space, hosts, hosts[0])
    assert (placement.kind, placement.backend, placement.capacity) == ("single", "gpu", 5)
    assert placement.trial_resources == {"CPU": 1, "GPU": 2}  # no node affinity: any GPU host
    with pytest.raises(SpaceError, match="gpu:2 needs a Ray node with 2 GPUs"):
        resolve(space, hosts[:1], hosts[0])
    with pytest.raises(SpaceError, match="fidelity: compile needs a TPU target"):
        load_space({**BASE, "target": "gpu:2", "fidelity": "compile"})
