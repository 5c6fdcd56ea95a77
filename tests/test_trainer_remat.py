"""Every remat policy runs with identical numerics; their memory/FLOP trade is real."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import trial
from trainer.config import REMAT_POLICIES, load_config
from trainer.effects import knob_effects
from trainer.events import Emitter
from trainer.run import train


def _run(policy: str, custom: dict | None = None):
    remat = {"policy": policy} | ({"custom": custom} if custom else {})
    emitter = Emitter(quiet=True)
    config = trial(
        remat=remat, steps=2, seq_len=128, per_device_batch=4, num_devices=1, mesh={"fsdp": 1}
    )
    result = train(load_config(config), emitter)
    compiled = next(e for e in emitter.events if e["event"] == "compiled")
    return result.losses, compiled


@pytest.fixture(scope="module")
def by_policy():
    runs = {p: _run(p) for p in REMAT_POLICIES if p != "custom"}
    runs["custom"] = _run(
        "custom", {"context": "device", "query_proj": "offload", "mlpwo": "remat"}
    )
    return runs


def test_every_policy_trains_with_same_numerics(by_policy):
    reference = by_policy["full"][0]
    for policy, (losses, _) in by_policy.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-3, err_msg=policy)


def test_full_remat_trades_memory_for_flops(by_policy):
    full, minimal = by_policy["full"][1], by_policy["minimal"][1]
    assert (
        full["memory_per_device"]["temp_size_in_bytes"]
        < minimal["memory_per_device"]["temp_size_in_bytes"]
    )
    assert full["cost_per_device"]["flops"] > minimal["cost_per_device"]["flops"]


def test_offload_reported_inert_on_cpu():
    config = load_config(trial(remat={"policy": "minimal_offloaded"}))
    assert knob_effects(config, "cpu")["remat.offload"]["status"] == "inert"
    assert knob_effects(config, "tpu")["remat.offload"]["status"] == "active"
    assert "remat.offload" not in knob_effects(
        load_config(trial(remat={"policy": "minimal"})), "cpu"
    )


def test_custom_placements_shape_the_compiled_program(by_policy):
    """`custom` keeps what it names: naming minimal's tensors compiles minimal's program, naming
    only the layer input compiles full remat's (memory and FLOPs both)."""
    from trainer.policies import placements

    minimal_names = placements(load_config(trial(remat={"policy": "minimal"})).remat)["device"]
    known = {n for n in minimal_names if n != "mlpwi"}  # mlpwi: the fused name, absent here
    like_minimal = _run("custom", {name: "device" for name in known})[1]
    like_full = _run("custom", {"decoder_layer_input": "device"})[1]
    for got, want in ((like_minimal, by_policy["minimal"][1]), (like_full, by_policy["full"][1])):
        assert (
            got["memory_per_device"]["temp_size_in_bytes"]
            == want["memory_per_device"]["temp_size_in_bytes"]
        )
        assert got["cost_per_device"]["flops"] == pytest.approx(
            want["cost_per_device"]["flops"], rel=1e-2
        )
    assert like_minimal["cost_per_device"]["flops"] < like_full["cost_per_device"]["flops"]
