"""Trials on TPU7x slices of a multi-node Ray cluster, simulated on this machine.

The cluster is real Ray (`ray.cluster_utils.Cluster`): a head with no CPUs and two slices
of two hosts each, every host labelled as KubeRay labels a TPU7x host. Trials run with
`trial.backend: cpu` (each host's trainer on simulated CPU devices), so scheduling, the
slice reservation and the process layout are those of a real slice.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
from mlflow.tracking import MlflowClient
from ray.cluster_utils import Cluster

from sweeper.execute.cluster import place, shipped_code
from sweeper.execute.placement import LABEL_SLICE
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from sweeper.sweep.run import run_sweep
from tests.helpers import run_trainer

# One worker runs this module: its module fixture is set up once, not once per worker.
pytestmark = pytest.mark.xdist_group("cluster")

STEPS = 5
SLICES = ("slice-a", "slice-b")


@pytest.fixture(scope="module")
def tpu_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for name in SLICES:
        for worker in (0, 1):
            resources = {"TPU": 4, **({"TPU-v7x-16-head": 1} if worker == 0 else {})}
            cluster.add_node(
                num_cpus=2,
                resources=resources,
                labels={
                    "ray.io/accelerator-type": "TPU-V7X",
                    "ray.io/tpu-slice-name": name,
                    "ray.io/tpu-worker-id": str(worker),
                    "ray.io/tpu-topology": "2x2x2",
                    "ray.io/tpu-pod-type": "v7x-16",
                },
                env_vars={"TPU_NAME": name, "TPU_WORKER_ID": str(worker)},
            )
    gpu_node = cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.gpu_node_id = gpu_node.node_id
    # As `sweeper run --address` does: the nodes import the driver's copy of the code.
    ray.init(
        address=cluster.address,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env=shipped_code(),
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _space(name: str, trials: int, **trial) -> dict:
    return {
        "name": name,
        "target": "tpu7x:2x2x2",
        "fidelity": "run",
        "model": {"preset": "tiny-dense"},
        "trial": {"seq_len": 64, "steps": STEPS, "backend": "cpu", **trial},
        "constraints": {"convergence": False},
        "search": {
            "sampler": "random",
            "trials": trials,
            "concurrency": 4,
            "trial_timeout_s": 600,
            "remeasure": 0,
        },
        "knobs": {"mesh.fsdp": {"values": [-1]}, "mesh.tensor": {"values": [1, 2]}},
    }


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie awaiting its parent has ended)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_trials_reserve_whole_slices_and_span_their_hosts(tpu_cluster, tmp_path):
    space = _space("slices", trials=3)
    # A grid of 4 distinct points: every trial runs (none reuses an earlier result).
    space["search"]["sampler"] = "grid"
    space["knobs"]["remat.policy"] = {"values": ["full", "minimal"]}
    result = run_sweep(load_space(space), results_dir=tmp_path)
    frame = result.trials
    assert result.counts == {"total": 3, "ok": 3}, frame[["status", "failure_message"]]
    assert any("capped at 2" in note for note in result.notes), result.notes

    slice_of = {n["NodeID"]: n["Labels"].get(LABEL_SLICE) for n in ray.nodes()}
    for _, row in frame.iterrows():
        hosts = row["hosts"].split(",")
        # Two trainer processes, one on each host of one slice, the slice the trial names.
        assert row["processes"] == 2 and len(set(hosts)) == 2
        assert {slice_of[h] for h in hosts} == {row["slice"]} and row["slice"] in SLICES
        assert row["device_kind"] == "cpu" and row["fidelity"] == "run"

    spans = [(r["started_at"], r["ended_at"], r["slice"]) for _, r in frame.iterrows()]
    for i, (start, end, name) in enumerate(spans):
        for other_start, other_end, other in spans[i + 1 :]:
            overlap = start < other_end and other_start < end
            assert not (overlap and name == other), "two running trials shared a slice"
    moments = sorted({t for s, e, _ in spans for t in (s, e)})
    running = [sum(s <= t < e for s, e, _ in spans) for t in moments]
    assert max(running) <= 2

    # MLflow has the layout, and the trial's own configuration reached it from the hosts.
    client = MlflowClient(result.tracking_uri)
    run_id = frame.iloc[0]["mlflow_run_id"]
    tags = client.get_run(run_id).data.tags
    assert tags["processes"] == "2" and tags["slice"] in SLICES and len(tags["hosts"]) > 20
    losses = [
        m.value for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    ]
    config = json.loads(
        Path(client.download_artifacts(run_id, "trial.json", str(tmp_path))).read_text()
    )
    # The same model, global batch and mesh as one process over 16 devices.
    code, events, err = run_trainer(config, tmp_path, devices=16)
    assert code == 0, err[-2000:]
    single = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, single, rtol=2e-3)


def test_a_crashed_process_fails_the_trial_and_leaves_no_process(tpu_cluster, tmp_path):
    space = _space("crash", trials=1, fault={"crash_at_step": 1, "crash_process": 1})
    result = run_sweep(load_space(space), results_dir=tmp_path)
    row = result.trials.iloc[0]
    assert row["status"] == "failed" and row["failure_class"] == "crashed"
    assert "process 1" in row["failure_message"], row["failure_message"]
    pids = [int(pid) for pid in row["pids"].split(",")]
    assert row["processes"] == 2 and len(pids) == 2
    deadline = time.monotonic() + 20
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(pids) == []  # process 0 was killed too, on its own host


@pytest.mark.slow  # a minute; a timeout's kill: the local trial-timeout test (sweep_e2e)
def test_a_timeout_kills_every_process_of_the_trial(tpu_cluster, tmp_path):
    # Process 1 hangs, so process 0 blocks in a collective: only the engine can end them.
    space = _space(
        "hang", trials=1, fault={"crash_at_step": 1, "crash_process": 1, "crash_mode": "hang"}
    )
    space["search"]["trial_timeout_s"] = 60
    result = run_sweep(load_space(space), results_dir=tmp_path)
    row = result.trials.iloc[0]
    assert row["failure_class"] == "timeout", row["failure_message"]
    pids = [int(pid) for pid in row["pids"].split(",")]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(pids) == []


def test_a_target_the_cluster_lacks_is_refused_before_any_trial(tpu_cluster, tmp_path):
    space = load_space({**_space("absent", trials=1), "target": "tpu7x:4x4x4"})
    with pytest.raises(SpaceError, match=r"tpu7x:4x4x4 with fidelity run needs .* has none"):
        run_sweep(space, results_dir=tmp_path)
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_experiment_by_name("absent") is None
    # auto compiles where the cluster has no such slice, and runs where it has one.
    auto = {**_space("auto", trials=1), "fidelity": "auto"}
    del auto["trial"]["backend"]
    resolved, _ = place(load_space({**auto, "target": "tpu7x:4x4x4"}))
    assert resolved.effective_fidelity == "compile"
    resolved, placement = place(load_space(auto))
    assert resolved.effective_fidelity == "run"
    assert resolved.objective.primary.metric == "tokens_per_sec_per_chip"
    assert (placement.kind, placement.backend, placement.processes) == ("slice", "tpu", 2)
    assert placement.capacity == 2 and placement.num_devices == 16


def test_gpu_targets_run_on_a_gpu_host_of_the_cluster(tpu_cluster, tmp_path):
    space = _space("gpu", trials=1)
    space.update(target="gpu:2", knobs={"mesh.fsdp": {"values": [2]}})
    result = run_sweep(load_space(space), results_dir=tmp_path)
    row = result.trials.iloc[0]
    assert row["status"] == "ok", row["failure_message"]
    # The trial went to the only node with 2 GPUs (simulated devices stand in for them here).
    assert row["hosts"] == tpu_cluster.gpu_node_id and row["processes"] == 1
    assert any("gpu:2: each trial reserves 2 GPUs" in n for n in result.notes), result.notes


def _hosts_of_a_running_slice_trial(timeout_s: float) -> list[str]:
    """Node ids of the hosts a slice trial holds, once its placement group is created."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for group in ray.util.placement_group_table().values():
            bundles = group.get("bundles") or {}
            tpu = len(bundles) == 2 and all("TPU" in b for b in bundles.values())
            if group["state"] == "CREATED" and tpu:
                return list(group["bundles_to_node_id"].values())
        time.sleep(0.2)
    raise AssertionError("no slice trial started")


def test_a_pipelines_cluster_runs_local_cpu_trials_on_its_workers(tpu_cluster, tmp_path):
    """KubeRay's usual head has no CPUs: a pipeline attached to it still runs the smoke space,
    its CPU trials placed on whichever nodes have CPUs."""
    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get("CPU"))
    result = run_sweep("smoke", results_dir=tmp_path, trials=2,
                       set={"trial.steps": 3, "constraints.convergence": False,
                            "search.remeasure": 0})  # fmt: skip
    frame = result.trials
    assert result.counts == {"total": 2, "ok": 2}, frame[["status", "failure_message"]]
    hosts = {h for hosts in frame["hosts"] for h in hosts.split(",")}
    assert hosts and head not in hosts
    assert any("nodes with CPUs" in note for note in result.notes), result.notes


@pytest.mark.slow  # 2-3 min; slices and a crashed process run by default
def test_a_lost_host_is_retried_on_another_slice(tpu_cluster, tmp_path):
    # Last in this module: it removes a node of the shared cluster.
    removed: dict[str, str] = {}
    worker_of = {n["NodeID"]: n["Labels"].get("ray.io/tpu-worker-id") for n in ray.nodes()}

    def lose_a_host():
        hosts = _hosts_of_a_running_slice_trial(300)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
            "--process-id" in " ".join(p.info["cmdline"] or [])
            for p in psutil.process_iter(["cmdline"])
        ):
            time.sleep(0.2)
        time.sleep(3)  # the trainers run
        # Worker 0 holds the slice's head resource: without it the slice cannot be reserved again.
        (victim,) = [h for h in hosts if worker_of[h] == "0"]
        node = next(n for n in tpu_cluster.worker_nodes if n.node_id == victim)
        tpu_cluster.remove_node(node, allow_graceful=False)
        removed["node"] = victim

    thread = threading.Thread(target=lose_a_host, daemon=True)
    thread.start()
    space = _space("lost", trials=1)
    space["trial"]["steps"] = 80
    result = run_sweep(load_space(space), results_dir=tmp_path)
    thread.join(10)
    row = result.trials.iloc[0]
    assert removed, "the test never removed a host"
    # An infrastructure fault: retried (attempt 2) on the other slice, and the trial measured.
    assert row["status"] == "ok", row[["failure_class", "failure_message"]].to_dict()
    assert row["attempts"] == 2
    assert removed["node"] not in row["hosts"].split(",")
    client = MlflowClient(result.tracking_uri)
    assert client.get_run(row["mlflow_run_id"]).data.tags["attempts"] == "2"
