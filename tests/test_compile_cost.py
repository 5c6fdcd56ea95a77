"""Compile fidelity, cost: what the step model and the analytic estimate read from compiled
TPU7x programs (loop trips, fp8, VMEM, host transfers), and the collectives and matmuls
counted in them."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.compile_helpers import (
    SMALL,
    SMALL_MOE,
    _compiled_text,
)
from tests.helpers import run_trainer
from trainer.estimate.analytic import estimate
from trainer.program.hlo import count_matmuls
from trainer.trial.config import load_config
from trainer.trial.events import EXIT_CODES
from trainer.trial.hardware import ACCELERATORS

pytestmark = pytest.mark.tpu_compile


def test_estimator_reproduces_the_guides_intensity_figure():
    tpu7x = ACCELERATORS["tpu7x"]
    assert tpu7x.intensity_flops_per_ici_byte() == pytest.approx(11_500, rel=0.01)
    assert tpu7x.peak_tflops["fp8"] == 2 * tpu7x.peak_tflops["bf16"]


def test_estimate_ranks_tensor_parallelism_as_communication_bound():
    """The guide: high-degree TP rarely pays on Ironwood. The estimate must say why (ICI time)."""
    model = {"preset": "llama3-8b"}
    fsdp = load_config({"model": model, "seq_len": 8192, "mesh": {"fsdp": -1}})
    tp = load_config({"model": model, "seq_len": 8192, "mesh": {"fsdp": -1, "tensor": 8}})
    est_fsdp, est_tp = (
        estimate(fsdp, ACCELERATORS["tpu7x"], 128),
        estimate(tp, ACCELERATORS["tpu7x"], 128),
    )
    assert est_tp["est_ici_s"] > est_fsdp["est_ici_s"]
    assert est_fsdp["est_tokens_per_sec_per_chip"] > est_tp["est_tokens_per_sec_per_chip"]


def test_estimate_only_needs_no_compiler_and_says_so(tmp_path):
    config = {
        "model": {"preset": "llama3.1-70b"},
        "seq_len": 8192,
        "convergence": {"enabled": False},
    }
    code, events, err = run_trainer(
        config, tmp_path, args=("--estimate-only", "--target", "tpu7x:4x4x4")
    )
    assert code == 0, err[-2000:]
    (summary,) = events
    assert (
        summary["fidelity"] == "estimate"
        and summary["hardware"] == "TPU7x"
        and summary["chips"] == 64
    )
    # 70B of f32 state over 128 devices: about 8.75 GiB of parameters+optimizer+gradients each.
    state = sum(
        summary["est_memory_per_device"][k] for k in ("params_f32", "optimizer_state", "gradients")
    )
    assert state / 2**30 == pytest.approx(70.6e9 * 16 / 128 / 2**30, rel=0.05)
    code, events, _ = run_trainer(
        config, tmp_path, args=("--estimate-only", "--target", "tpu9:2x2")
    )
    assert code == EXIT_CODES["invalid_config"] and events[-1]["field"] == "compile_target"


def test_collective_counting_reads_sync_and_async_forms():
    from trainer.program.hlo import count_collectives

    hlo = """
  %ag = bf16[8,128]{1,0} all-gather(bf16[1,128]{1,0} %p), replica_groups={}
  %ags = (bf16[1,128]{1,0}, bf16[8,128]{1,0}) all-gather-start(bf16[1,128]{1,0} %q)
  %agd = bf16[8,128]{1,0} all-gather-done((bf16[1,128]{1,0}, bf16[8,128]{1,0}) %ags)
  %rs = f32[1,128]{1,0} reduce-scatter(f32[8,128]{1,0} %g), dimensions={0}
  %a2a = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) all-to-all(bf16[4,8]{1,0} %x, bf16[4,8]{1,0} %y)
  ROOT %ragged-all-to-all.6 = bf16[1024,2,128]{2,1,0} ragged-all-to-all(%p0, %p1, %p2, %p3, %p4, %p5)
  %prepare_start_ragged-all-to-all.7.cloned.1.call-start = s32[] custom-call(), custom_call_target="PrepareAsyncCallStart"
  %ragged-all-to-all.7.cloned.1.call-start = ((bf16[512,2,128]{2,1,0}), bf16[1024,2,128]{2,1,0}) call-start(%p0)
  %ragged-all-to-all.7.cloned.1.call-done = bf16[1024,2,128]{2,1,0} call-done(%ragged-all-to-all.7.cloned.1.call-start)
  %prepare_start_all-reduce.92.cloned.1.call-start = s32[] custom-call(), custom_call_target="PrepareAsync"
  %all-reduce.92.cloned.1.call-start = ((bf16[1,512]{1,0}), bf16[1,512]{1,0}) call-start(bf16[1,512]{1,0} %z)
  %all-reduce.92.cloned.1.call-done = bf16[1,512]{1,0} call-done(%all-reduce.92.cloned.1.call-start)
"""
    assert count_collectives(hlo) == {
        "all-gather": 2,
        "reduce-scatter": 1,
        "all-reduce": 1,
        "all-to-all": 1,
        "ragged-all-to-all": 2,
        "collective-permute": 0,
    }


def test_matmul_counting_finds_fp8_products_in_gpu_and_tpu_forms():
    """Compiled modules print operands by name: an fp8 product is known by its operands'
    definitions, by a printed fp8 operand, or by cuBLAS's fp8 GEMM target (seen on an H200)."""
    hlo = """
  %p = f8e4m3fn[8,128]{1,0:T(8,128)(4,1)} parameter(0)
  %w = bf16[128,8]{1,0} parameter(1)
  %dot.1 = bf16[8,8]{1,0} dot(%w, %w), lhs_contracting_dims={1}
  %fused = bf16[8,8]{1,0:T(8,128)(2,1)} dot(%p, %w), lhs_contracting_dims={1}
  %gemm = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"
  %gemm.2 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%w, %w), custom_call_target="__cublas$lt$matmul"
  ROOT %cast = f8e4m3fn[8,8]{1,0} convert(%dot.1)
"""
    assert count_matmuls(hlo) == {"total": 4, "fp8": 2}


def test_default_moe_routes_each_devices_own_tokens_on_tpu7x():
    """Without an expert axis each device sorts and multiplies its own (token, choice) slots:
    the compiled program holds per-device slot buffers, never the global slot order."""
    config = {"model": SMALL_MOE, "seq_len": 256, "per_device_batch": 1, "mesh": {"fsdp": 8}}
    text = _compiled_text(config)
    d = SMALL_MOE["d_model"]
    global_slots = 8 * 256 * SMALL_MOE["experts_per_token"]
    assert f"[{global_slots // 8},{d}]" in text  # this device's slots x d_model
    assert f"[{global_slots},{d}]" not in text, "a global slot buffer is back"
    # Slots are sorted, unsorted and their gradients summed by gathers: TPU scatters 16-bit
    # rows through 32-bit buffers (4 such scatters and 56 u32 buffers here before).
    slots = f"[{global_slots // 8},{d}]"
    assert not re.search(rf"{re.escape(slots)}\S* scatter\(", text), "a slot scatter is back"
    assert f"u32{slots}" not in text


def test_mesh_follows_the_torus():
    """Consecutive devices of a mesh axis sit nearer on the torus with mesh_utils than in
    plain device order: within each plane of tpu7x:2x2x2 they snake one link at a time
    (one 2-link step between planes), where device order jumps diagonally."""
    from trainer.compile.aot import topology_devices
    from trainer.parallel.sharding import build_mesh

    def hops(order):
        return [
            sum(abs(a - b) for a, b in zip(x.coords, y.coords, strict=True))
            for x, y in itertools.pairwise(order)
        ]

    devices = topology_devices("tpu7x:2x2x2")
    degrees = {"data": 1, "fsdp": 16, "context": 1, "expert": 1, "tensor": 1}
    axis = list(build_mesh(degrees, devices).devices.reshape(-1))
    assert sum(h > 1 for h in hops(axis)) == 1, hops(axis)
    assert sum(h > 1 for h in hops(devices)) == 3 and max(hops(devices)) == 3


@pytest.mark.slow  # 30 s; the step model's program reading: test_fp8_program_is_estimated...
def test_program_cost_counts_scanned_layers_by_trip_count(compile_once):
    """XLA's cost analysis counts a scanned layer once; the HLO walk counts it L times, and
    its matrix FLOPs agree with the model formula (plus full remat's recomputed forward)."""
    from trainer.trial.config import load_config
    from trainer.trial.flops import training_flops_per_step

    costs = {}
    for layers in (2, 4):
        code, events, err = compile_once({"model": {**SMALL, "num_layers": layers}})
        assert code == 0, err[-2000:]
        costs[layers] = events["summary"]["program_cost"]
        assert layers in costs[layers]["loop_trips"]
    assert 1.8 < costs[4]["flops_total"] / costs[2]["flops_total"] <= 2.0
    config = load_config({"model": {**SMALL, "num_layers": 4}, "seq_len": 256})
    model = training_flops_per_step(config.model, 8, 256) / 8  # 8 devices, batch 1 each
    assert 0.9 < costs[4]["flops_total"] / model < 4 / 3  # recompute adds < 1/3; Splash hidden


def test_fp8_program_is_estimated_faster_than_bf16_but_not_twice(compile_once):
    steps = {}
    for mode in ("bf16", "fp8"):
        code, events, err = compile_once({"model": SMALL, "precision": {"mode": mode}})
        assert code == 0, err[-2000:]
        summary = events["summary"]
        assert summary["est_model"] == "hlo"
        steps[mode] = summary["est_step_time_s"]
        if mode == "fp8":
            assert summary["program_cost"]["flops"]["fp8"] > 10 * summary["program_cost"][
                "flops"
            ].get("bf16", 0)
    assert 1.0 < steps["bf16"] / steps["fp8"] < 2.0


@pytest.mark.slow  # a VMEM limit that changes the program: also test_flag_knobs_are_judged_...
def test_a_program_changing_vmem_limit_changes_the_estimate(compile_once):
    """16 sequences per device: compute and HBM, not the weight all-gathers, set the step."""
    config = {"model": SMALL, "per_device_batch": 16}
    base = compile_once(config)[1]["summary"]
    tight = compile_once({**config, "xla": {"scoped_vmem_kib": 8192, "judge": False}})[1]
    assert base["bound"] != "ici"
    assert tight["summary"]["program_fingerprint"] != base["program_fingerprint"]
    assert tight["summary"]["est_step_time_s"] != base["est_step_time_s"]


@pytest.mark.slow  # 50 s; offload's placement: test_trainer_remat's custom placements
def test_offloaded_residuals_cross_the_host_link_once_each_way(compile_once):
    """decoder_layer_input offloaded: each layer's input goes to host memory in the forward
    pass and comes back in the backward (XLA peels one iteration of each loop to overlap the
    transfers; the peeled loops start their counter at 1), and the FLOPs are the device
    placement's. Whether the offload acts is judged by device memory against that placement,
    compiled again as the offload trial's twin."""
    layers, d, seq = 3, SMALL["d_model"], 256
    costs, memory, effects = {}, {}, {}
    for place in ("device", "offload"):
        remat = {"policy": "custom", "custom": {"decoder_layer_input": place}}
        code, events, err = compile_once({"model": {**SMALL, "num_layers": layers}, "remat": remat})
        assert code == 0, err[-2000:]
        costs[place] = events["summary"]["program_cost"]
        memory[place] = events["compiled"]["memory_per_device"]
        effects[place] = events["compiled"]["effects"]
    assert "remat.offload" not in effects["device"]
    verdict = effects["offload"]["remat.offload"]
    mib = {p: f"{memory[p]['total_bytes'] / 2**20:.1f} MiB" for p in memory}
    same = f"{mib['offload']} offloaded vs {mib['device']} with the same tensors on device"
    assert same in verdict["reason"], verdict
    saves = memory["offload"]["total_bytes"] < memory["device"]["total_bytes"]
    assert verdict["status"] == ("active" if saves else "inert"), verdict
    residuals = layers * seq * d * 2  # bf16, one sequence per device
    assert memory["offload"]["host_temp_size_in_bytes"] == residuals
    assert costs["device"]["host_transfer_bytes"] == 0
    assert costs["offload"]["host_transfer_bytes"] == 2 * residuals
    assert costs["offload"]["flops_total"] == pytest.approx(
        costs["device"]["flops_total"], rel=1e-3
    )
