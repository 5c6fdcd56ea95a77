"""Every remat policy runs with identical numerics; their memory/FLOP trade is real."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import trial
from trainer.run.train import train
from trainer.trial.config import load_config
from trainer.trial.effects import knob_effects
from trainer.trial.events import Emitter
from trainer.trial.remat import REMAT_POLICIES

# One worker runs this module: its module fixture is set up once, not once per worker.
pytestmark = pytest.mark.xdist_group("remat")


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
    assert knob_effects(config, "cpu")["remat.offload"].status == "inert"
    assert knob_effects(config, "tpu")["remat.offload"].status == "active"
    assert "remat.offload" not in knob_effects(
        load_config(trial(remat={"policy": "minimal"})), "cpu"
    )


def test_custom_placements_shape_the_compiled_program(by_policy):
    """`custom` keeps what it names: naming minimal's tensors compiles minimal's program, naming
    only the layer input compiles full remat's (memory and FLOPs both)."""
    from trainer.trial.remat import placements

    minimal_names = placements(load_config(trial(remat={"policy": "minimal"})).remat)["device"]
    like_minimal = _run("custom", {name: "device" for name in minimal_names})[1]
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


def _tagged_names(model: str, **model_fields) -> set[str]:
    """Names the model's layers give their tensors (checkpoint_name), read off its jaxpr."""
    import jax
    import jax.numpy as jnp

    from trainer.model.transformer import Transformer

    config = load_config({**trial(), "model": {"preset": model, **model_fields}})
    module = Transformer(config.model)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    params = jax.eval_shape(module.init, jax.random.key(0), tokens, tokens)
    names: set[str] = set()

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                names.add(str(eqn.params["name"]))
            for sub in _jaxprs_in(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(module.apply)(params, tokens, tokens, tokens).jaxpr)
    return names


def _jaxprs_in(params: dict):
    """The jaxprs an equation holds (scan, remat, custom_vjp, pjit bodies): jax.core's helper
    for this left its public API in jax 0.12."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def test_the_layers_tag_exactly_the_tensors_the_remat_table_names():
    """Tags, custom placements and policies come from one table (trainer.trial.remat): a dense
    layer names every tensor of it (the fused projection when asked), an MoE layer its expert
    tensors under both names; every policy saves only names some layer tags."""
    from trainer.trial.remat import CUSTOM_TENSORS, EXPERT_TENSORS, POLICIES, Tensor, moe_twin

    dense = _tagged_names("tiny-dense") | _tagged_names("tiny-dense", fused_qkv=True)
    assert dense == {t.value for t in Tensor}
    moe = _tagged_names("tiny-moe")
    assert {moe_twin(t) for t in EXPERT_TENSORS} <= moe
    assert dense | moe == set(CUSTOM_TENSORS)
    for name, policy in POLICIES.items():
        assert set(policy.remat_twin) <= dense, name
