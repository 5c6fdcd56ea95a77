"""The screen's analytic estimate ranks as the hardware does where the hardware's order is known
(issue 32): each test fails when the model ranks the pair the wrong way round. The shapes are
the published llama3.1-70b 8k recipe on tpu7x:4x4x4, varied one knob at a time."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.estimate.analytic import (
    estimate,
    forward_flops_per_token,
    recompute_share,
    recomputed,
)
from trainer.trial.config import SPLASH_BLOCKS, load_config
from trainer.trial.hardware import Topology

TARGET = Topology.parse("tpu7x:4x4x4")
RECIPE: dict[str, Any] = {
    "model": {"preset": "llama3.1-70b"},
    "seq_len": 8192,
    "per_device_batch": 2,
    "mesh": {"fsdp": -1},
    "remat": {
        "policy": "custom",
        "custom": {
            "decoder_layer_input": "device",
            "context": "device",
            "query_proj": "device",
            "key_proj": "device",
            "value_proj": "device",
            "qkv_proj": "device",
        },
    },
    "kernels": {"attention": "splash"},
    "mu_dtype": "bfloat16",
}


def _est(**changes: Any) -> dict[str, Any]:
    config = load_config({**RECIPE, **changes})
    return estimate(config, TARGET.accelerator, TARGET.devices)


def _tokens(**changes: Any) -> float:
    return _est(**changes)["est_tokens_per_sec_per_chip"]


@pytest.mark.parametrize("batch", [1, 2])
def test_remat_that_saves_more_is_faster_where_each_fits(batch):
    """llama3-8b at 8k on tpu7x:2x2x2 (the guide's dense row), compute-bound: full remat
    recomputes the whole forward, save_dot_except_mlp the MLP, minimal nothing."""
    target = Topology.parse("tpu7x:2x2x2")
    tokens = {}
    for policy in ("full", "save_dot_except_mlp", "minimal"):
        config = {"model": {"preset": "llama3-8b"}, "seq_len": 8192, "per_device_batch": batch,
                  "remat": {"policy": policy}}  # fmt: skip
        est = estimate(load_config(config), target.accelerator, target.devices)
        assert est["fits"] and est["bound"] == "compute", (policy, est["bound"])
        tokens[policy] = est["est_tokens_per_sec_per_chip"]
    assert tokens["full"] < tokens["save_dot_except_mlp"] < tokens["minimal"]
    # The whole forward again is a third more work at most: not more than that slower.
    assert tokens["minimal"] / tokens["full"] < 4 / 3 + 1e-9


def test_two_sequences_a_device_make_more_tokens_than_one_on_a_compute_bound_shape():
    one, two = _est(per_device_batch=1), _est(per_device_batch=2)
    assert one["bound"] == two["bound"] == "compute"
    # What a step cannot overlap (the optimizer's update, the first gather and the last
    # reduce-scatter of the layer loop) is the same per step; twice the tokens share it.
    assert one["est_serial_s"] == pytest.approx(two["est_serial_s"]) and one["est_serial_s"] > 0
    assert two["est_tokens_per_sec_per_chip"] > one["est_tokens_per_sec_per_chip"]


def test_fp8_is_faster_than_bf16_but_not_twice():
    ratio = _tokens(precision={"mode": "fp8"}) / _tokens()
    # The layers' matmuls run at twice the rate; the attention core and logits do not.
    assert 1.0 < ratio < 1.95


@pytest.mark.parametrize("batch", [1, 2])
def test_host_offload_of_the_layer_input_saves_device_memory_and_costs_no_flops(batch):
    remat = {"policy": "custom", "custom": {**RECIPE["remat"]["custom"]}}
    device = _est(per_device_batch=batch, remat=remat)
    remat["custom"]["decoder_layer_input"] = "offload"
    offload = _est(per_device_batch=batch, remat=remat)
    memory = ("est_memory_per_device", "total")
    assert offload[memory[0]][memory[1]] < device[memory[0]][memory[1]]
    assert offload["est_memory_per_device"]["host_activations"] > 0
    assert offload["est_step_time_s"] >= device["est_step_time_s"]  # never faster for moving data


def test_the_screen_ranks_splash_blocks_of_2048_ahead_of_256():
    """The published 70B recipe's 2048-wide blocks: 256-wide ones skip more of the causal
    mask's diagonal but run 64 grid steps per sequence and head where 2048 run one, and hold a
    128-wide head in half the MXU either way."""
    tokens = {
        block: _tokens(kernels={"attention": "splash", **dict.fromkeys(SPLASH_BLOCKS, block)})
        for block in (256, 512, 2048)
    }
    assert tokens[256] < tokens[512] < tokens[2048]


def test_remat_recomputes_what_it_does_not_keep_and_never_a_dense_output_projection():
    """The backward runs again the matmuls whose outputs the policy neither keeps nor offloads,
    except a dense MLP's output projection, whose output it never reads (the compiles: full
    remat runs search_table's layer matmuls 1.24x, not 4/3x); an MoE layer's expert outputs
    feed the router weights' gradient, so they are run again."""
    dense = {"model": {"preset": "llama3-8b"}, "seq_len": 8192}

    def again(policy: str, **extra: Any) -> dict[str, bool]:
        return recomputed(load_config({**dense, **extra, "remat": {"policy": policy}}))

    assert again("full") == {"qkv": True, "attention": True, "out": True, "wi": True, "wo": False,
                             "shared_wi": True, "shared_wo": False}  # fmt: skip
    assert again("save_dot_except_mlp") == {"qkv": False, "attention": True, "out": False,
                                            "wi": True, "wo": False, "shared_wi": True,
                                            "shared_wo": False}  # fmt: skip
    assert not any(v for k, v in again("minimal").items() if k != "attention")
    assert again("full", model={"preset": "mixtral-8x7b"})["wo"] is True
    # an MoE layer's shared experts are a dense MLP: their output projection is never run again
    shared = again("full", model={"preset": "mixtral-8x7b", "shared_experts": 1})
    assert shared["wo"] and shared["shared_wi"] and not shared["shared_wo"]
    config = load_config({**dense, "remat": {"policy": "full"}})
    flops = forward_flops_per_token(config)
    assert recompute_share(config) == pytest.approx(1 - flops["wo"] / sum(flops.values()))


def _every_tile(config: dict[str, Any], tiles: str) -> dict[str, Any]:
    """`config` with tokamax's grouped-matmul tiles `tiles` for every weight and pass."""
    every = {f"{w}_{p}": tiles for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")}
    return {**config, "kernels": {**config["kernels"], "tokamax_tiles": every}}


def test_the_screen_prices_grouped_matmul_tiles_by_their_padding():
    """qwen3-235b-a22b 4k's recipe (tokamax's kernels, MaxText's 512x1024x1024 tiles): its
    experts' 1536-wide MLP pads to 2048 in 1024-wide tiles and not in 512-wide ones; 128-row
    tiles pad the fewest rows but half-fill TPU7x's 256-wide MXU in the weight gradient, whose
    held tile is rows x columns."""
    from benchmarks.calibration import recipe

    config, target = recipe("qwen3-235b-a22b 4k bf16 256 chips")
    topology = Topology.parse(target)

    def tokens(tiles: str) -> float:
        est = estimate(load_config(_every_tile(config, tiles)), topology.accelerator,
                       topology.devices)  # fmt: skip
        return est["est_tokens_per_sec_per_chip"]

    assert tokens("512x512x512") > tokens("512x1024x1024") > tokens("128x1024x1024")


def test_the_screen_floors_small_grouped_matmul_tiles_at_their_grid_steps():
    """64 small experts (d_model and MLP 512): a 256x512x512 tile's matmul takes 0.16 us at
    the MXU efficiency, under the 0.36 us a grid step takes (GRID_STEP_S); 512-row tiles pad
    more rows but run half the steps, so they are the faster (without the floor, the 256-row
    ones)."""
    model = {"vocab_size": 32768, "d_model": 512, "num_layers": 4, "num_heads": 4,
             "num_kv_heads": 4, "head_dim": 128, "mlp_dim": 512, "num_experts": 64,
             "experts_per_token": 2}  # fmt: skip
    config = {"model": model, "seq_len": 2048, "per_device_batch": 4,
              "kernels": {"attention": "splash", "moe_gmm": "tokamax"}}  # fmt: skip
    target = Topology.parse("tpu7x:2x2x1")

    def tokens(tiles: str) -> float:
        est = estimate(load_config(_every_tile(config, tiles)), target.accelerator, target.devices)
        return est["est_tokens_per_sec_per_chip"]

    assert tokens("512x512x512") > tokens("256x512x512")


def test_shared_experts_cost_a_dense_mlp_of_their_width_in_every_layer():
    """qwen3-235b-a22b with one shared expert 1536 wide (deepseek's rule: a routed expert's
    width): its parameters and forward FLOPs grow by exactly a dense MLP of that width a
    layer, and the estimate's step is slower and holds more."""
    from trainer.estimate.analytic import parameter_count

    base = {"model": {"preset": "qwen3-235b-a22b"}, "seq_len": 4096, "per_device_batch": 2,
            "mesh": {"fsdp": -1}}  # fmt: skip
    plain = load_config(base)
    shared = load_config({**base, "model": {**base["model"], "shared_experts": 1}})
    m = plain.model
    assert parameter_count(shared) - parameter_count(plain) == m.num_layers * 3 * m.d_model * 1536
    more = {
        k: forward_flops_per_token(shared)[k] - v for k, v in forward_flops_per_token(plain).items()
    }
    assert sum(more.values()) == 6 * m.d_model * 1536
    slow, fast = (estimate(c, TARGET.accelerator, TARGET.devices) for c in (shared, plain))
    assert slow["est_step_time_s"] > fast["est_step_time_s"]
    assert slow["est_memory_per_device"]["total"] > fast["est_memory_per_device"]["total"]
