"""One suite over every tracking store: what the Tracker writes is what the store keeps.

Runs over MLflow (a real SQLite store) and the in-memory store; a sweep's records must
read back the same from either. The in-memory store runs a whole sweep in
test_sweep_e2e.py (the lifecycle test).
"""

from __future__ import annotations

import json
import pickle
import uuid

import pytest

from sweeper.record.row import TrialRow
from sweeper.record.stores import PARENT, MemoryStore, MlflowStore, store_for
from sweeper.record.tracker import Tracker
from sweeper.space.load import load_space
from trainer.trial.result import Convergence, TrialResult

STEPS = [{"step": s, "loss": 5.0 - s, "tokens_per_sec_per_chip": 100.0 + s} for s in range(1, 4)]


@pytest.fixture(params=["mlflow", "memory"])
def uri(request, tmp_path):
    if request.param == "mlflow":
        return f"sqlite:///{tmp_path}/mlflow.db"
    return f"memory:{uuid.uuid4().hex}"


def tracker(uri, tmp_path, sweep_id="s1", parent_run_id=None) -> Tracker:
    return Tracker(uri, load_space("smoke"), sweep_id, tmp_path / "art",
                   tmp_path / f"journal-{sweep_id}.json", parent_run_id=parent_run_id)  # fmt: skip


def test_the_uri_picks_the_store(tmp_path):
    assert isinstance(store_for(f"sqlite:///{tmp_path}/x.db"), MlflowStore)
    assert store_for("memory:a") is store_for("memory:a")
    assert store_for("memory:a") is not store_for("memory:b")


def test_a_sweep_and_its_trials_read_back(uri, tmp_path):
    t = tracker(uri, tmp_path)
    parent = t.start_sweep("name: smoke\n", {"target": "local"})
    ok = t.start_trial("t1", {"mesh.fsdp": 2}, 0, {})
    bad = t.start_trial("t2", {"mesh.fsdp": 4}, 1, {})
    t.log_steps(ok, STEPS)
    tuning = {"kernels": [], "settings": {"block_q": 1024, "tokamax_tiles.wi_fwd": "256x1024x1024"}}
    t.finish_trial(ok, TrialResult(status="ok", figures={"tokens_per_sec_per_chip": 123.5,
                                   "mfu": 0.25}, kernel_tuning=tuning,
                                   convergence=Convergence(passed=True),
                                   trial_config='{"steps": 3}'))  # fmt: skip
    t.finish_trial(bad, TrialResult.failed("oom_hbm", "needs 200 GiB", log_tail="last words"))
    best = TrialRow(trial_id="t1", status="ok", figures={"tokens_per_sec_per_chip": 123.5})
    t.finish_sweep(best, {"total": 2, "ok": 1}, notes=["pinned: nothing"])
    store = store_for(uri)

    sweep = store.read(parent)
    assert sweep.status == "FINISHED" and sweep.name == "sweep-s1"
    assert sweep.tags["sweeper.kind"] == "sweep" and sweep.tags["best_trial"] == "t1"
    assert sweep.params["search.sampler"] == "tpe" and sweep.params["target"] == "local"
    assert sweep.metrics["best_tokens_per_sec_per_chip"] == 123.5
    assert sweep.metrics["trials_total"] == 2.0
    assert sweep.texts["space.yaml"] == "name: smoke\n"
    assert sweep.texts["notes.txt"] == "pinned: nothing\n"

    good = store.read(ok)
    assert good.status == "FINISHED" and good.tags[PARENT] == parent
    assert good.tags["status"] == "ok" and good.tags["convergence"] == "passed"
    assert good.params["knob.mesh.fsdp"] == "2" and good.params["trial.steps"] == "8"
    assert good.metrics["tokens_per_sec_per_chip"] == 123.5  # the final, over the step values
    assert sorted(good.history["loss"]) == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert good.texts["trial.json"] == '{"steps": 3}'
    # The tiles kernels.tune chose, as settings; its whole record as the trial's tuning.json.
    assert good.params["tuned.block_q"] == "1024"
    assert good.params["tuned.tokamax_tiles.wi_fwd"] == "256x1024x1024"
    assert json.loads(good.texts["tuning.json"]) == tuning

    failed = store.read(bad)
    assert failed.status == "FAILED" and failed.tags["failure_class"] == "oom_hbm"
    assert "needs 200 GiB" in failed.texts["trainer_log_tail.txt"]
    assert "last words" in failed.texts["trainer_log_tail.txt"]
    assert store.search(t.experiment_id, {"sweeper.kind": "trial"}) == [ok, bad]


def test_a_killed_drivers_running_runs_are_closed_and_no_one_elses(uri, tmp_path):
    t = tracker(uri, tmp_path)
    parent = t.start_sweep("", {})
    left = t.start_trial("t1", {}, 0, {})
    done = t.start_trial("t2", {}, 1, {})
    t.finish_trial(done, TrialResult(status="ok"))
    other = tracker(uri, tmp_path, sweep_id="s2")
    other.start_sweep("", {})
    theirs = other.start_trial("t1", {}, 0, {})

    assert t.close_leftovers() == 1
    store = store_for(uri)
    assert store.read(left).status == "KILLED" and store.read(left).tags["status"] == "killed"
    assert store.read(done).status == "FINISHED"
    assert store.read(parent).status == "RUNNING"  # the sweep closes its own run when it ends
    assert store.read(theirs).status == "RUNNING"


def test_a_pickled_tracker_writes_to_the_same_runs(uri, tmp_path):
    """Tune pickles the tracking callback with its experiment state; a restored one reattaches."""
    t = tracker(uri, tmp_path)
    parent = t.start_sweep("", {})
    run = t.start_trial("t1", {}, 0, {})
    again = pickle.loads(pickle.dumps(t))
    again.finish_trial(run, TrialResult(status="ok", figures={"mfu": 0.5}))
    assert store_for(uri).read(run).metrics["mfu"] == 0.5
    assert again.parent_run_id == parent


def test_an_outage_is_journaled_then_replayed_in_order(tmp_path):
    """The journal is the Tracker's, whatever the store. A real MLflow server killed and
    restarted mid-sweep is tested in test_sweep_faults.py."""
    uri = f"memory:{uuid.uuid4().hex}"
    store = store_for(uri)
    assert isinstance(store, MemoryStore)
    t = tracker(uri, tmp_path)
    parent = t.start_sweep("", {})
    with store.outage():
        with pytest.raises(ConnectionError, match="another --tracking-uri"):
            store.check()
        run = t.start_trial("t1", {"mesh.fsdp": 2}, 0, {})  # a local id, kept in the journal
        t.log_steps(run, STEPS)
        t.finish_trial(run, TrialResult(status="ok", figures={"mfu": 0.5}))
        assert len(t.journal) >= 4 and len(store.runs) == 1
    assert t.flush() == 0
    real = t.resolve(run)
    assert real != run and store.read(real).status == "FINISHED"
    assert store.read(real).tags[PARENT] == parent
    assert sorted(store.read(real).history["loss"]) == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert "all replayed" in t.outages[0]
