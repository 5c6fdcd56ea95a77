"""Compile fidelity: real TPU7x compiles on this CPU host through libtpu (no TPU needed)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import subprocess
import sys

import pytest

from sweeper.space import assemble, load_space
from tests.helpers import REPO, run_trainer
from trainer.estimate.analytic import estimate, memory_per_device
from trainer.program.hlo import count_matmuls, parse
from trainer.spec.config import SPLASH_BLOCKS, load_config
from trainer.spec.events import EXIT_CODES
from trainer.spec.flags import ASYNC_FUSION, COMPILER_STACKS, SPARSECORE_OFFLOAD, unknown_flag
from trainer.spec.hardware import ACCELERATORS

pytestmark = pytest.mark.tpu_compile
TARGET = "tpu7x:2x2x1"  # 4 chips, 8 devices: the smallest default TPU7x topology


def _compile(tmp_path, config: dict, target: str = TARGET, timeout: float = 600):
    base = {"seq_len": 256, "per_device_batch": 1, "convergence": {"enabled": False}}
    code, events, err = run_trainer(
        {**base, **config, "compile_target": target}, tmp_path, timeout=timeout
    )
    by_kind = {e["event"]: e for e in events}
    return code, by_kind, err


# tokamax's TPU grouped-matmul kernels by their 0.0.12 HLO names; 0.0.17 names them
# pallas_tpu_ragged_dot_{gmm, gmm_transpose_rhs, tgmm}.
_TOKAMAX_NAMES = {
    "pallas_tpu_ragged_dot_gmm": "gmm_megablox",
    "pallas_tpu_ragged_dot_gmm_transpose_rhs": "gmm_megablox_transpose_rhs",
    "pallas_tpu_ragged_dot_tgmm": "tgmm_megablox",
}


def _kernel(call: dict) -> str:
    return _TOKAMAX_NAMES.get(call["name"], call["name"])


# head_dim 128 as in real models: smaller head dims are padded to 128 lanes on TPU.
SMALL = {
    "preset": "tiny-dense",
    "d_model": 256,
    "mlp_dim": 1024,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 128,
}


@pytest.fixture(scope="module")
def compile_once(tmp_path_factory):
    """Tests that need the same program share one compile of it."""
    done: dict[str, tuple] = {}

    def get(config: dict):
        key = json.dumps(config, sort_keys=True)
        if key not in done:
            done[key] = _compile(tmp_path_factory.mktemp("shared"), config)
        return done[key]

    return get


@pytest.fixture(scope="module")
def remat_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remat")
    return {
        policy: _compile(
            tmp,
            {"model": SMALL, "seq_len": 1024, "per_device_batch": 2, "remat": {"policy": policy}},
        )
        for policy in ("full", "minimal")
    }


@pytest.mark.xdist_group("remat_pair")  # one worker compiles the pair
def test_full_remat_uses_less_tpu_memory_than_minimal(remat_pair):
    (code_full, full, err), (code_min, minimal, _) = remat_pair["full"], remat_pair["minimal"]
    assert code_full == 0 and code_min == 0, err[-2000:]
    assert full["accepted"]["device_kind"] == "TPU7x" and full["summary"]["fidelity"] == "compile"
    temp = lambda run: run["compiled"]["memory_per_device"]["temp_size_in_bytes"]  # noqa: E731
    assert temp(full) < temp(minimal)


@pytest.mark.xdist_group("remat_pair")  # one worker compiles the pair
def test_a_splash_forward_the_backward_recomputes_counts_twice(remat_pair):
    """A policy that does not save the context recomputes each layer's attention for the
    backward: the compiled program makes two Splash forward calls a layer and one fused
    backward. The kernel FLOPs count the calls it makes, as their blocks compute them: a
    forward 2 matmuls a score, the backward 5."""
    from trainer.compile.step_model import kernel_flops
    from trainer.spec.mxu import splash_scores

    seq, batch, devices = 1024, 2, 8
    config = load_config({"model": SMALL, "seq_len": seq, "per_device_batch": batch})
    model, blocks = config.model, config.kernels.blocks(seq, seq)
    forward = splash_scores(seq, blocks["block_q"], blocks["block_kv"])
    backward = splash_scores(seq, blocks["block_q_dkv"], blocks["block_kv_dkv"])
    per_matmul = 2 * batch * model.num_heads * model.head_dim  # a device's, per score
    for policy, (code, events, err) in remat_pair.items():
        assert code == 0, err[-2000:]
        calls = events["summary"]["program_cost"]["kernel_calls"]
        times = {c["name"]: c["times"] for c in calls}
        layers = model.num_layers
        assert times["splash_mqa_fwd_residuals"] == 2 * layers, (policy, times)
        assert times["splash_mqa_dkv_no_residuals"] == layers, (policy, times)
        got = kernel_flops(config, batch * devices, devices, calls=calls).total
        assert got == pytest.approx(per_matmul * layers * (2 * 2 * forward + 5 * backward))


def test_a_policy_that_saves_the_context_runs_the_splash_forward_once(tmp_path):
    """The kernel names its output and its logsumexp "context" (as MaxText's does): saving
    the context saves what the fused backward reads, so the backward runs no forward (the
    published recipes save it; their production step has no second forward)."""
    config = {"model": SMALL, "seq_len": 1024, "per_device_batch": 2}
    code, events, err = _compile(tmp_path, {**config, "remat": {"policy": "minimal_with_context"}})
    assert code == 0, err[-2000:]
    times = {c["name"]: c["times"] for c in events["summary"]["program_cost"]["kernel_calls"]}
    layers = load_config(config).model.num_layers
    assert times["splash_mqa_fwd_residuals"] == layers, times
    assert times["splash_mqa_dkv_no_residuals"] == layers, times


@pytest.mark.xdist_group("remat_pair")  # one worker compiles the pair
def test_fsdp_program_all_gathers_weights_and_reduce_scatters_gradients(remat_pair):
    collectives = remat_pair["full"][1]["compiled"]["collectives"]
    assert collectives["all-gather"] > 0 and collectives["reduce-scatter"] > 0


SMALL_MOE = {**SMALL, "num_experts": 4, "experts_per_token": 2, "mlp_dim": 512}


def test_expert_parallel_program_dispatches_tokens_by_ragged_all_to_all(compile_once):
    """With an expert axis, tokens travel to their experts by ragged all-to-all (dispatch and
    combine, forward and backward); without one there is no ragged exchange."""
    megablox = {"moe_gmm": "megablox", "gmm_tm": 128, "gmm_tk": 128, "gmm_tn": 128}
    cases = {
        "ep2": {"mesh": {"fsdp": 4, "expert": 2}},
        "ep2_megablox": {"mesh": {"fsdp": 4, "expert": 2}, "kernels": megablox},
        "ep1": {"mesh": {"fsdp": 8}},
    }
    counts = {}
    for name, case in cases.items():
        code, events, err = compile_once({"model": SMALL_MOE, **case})
        assert code == 0, err[-2000:]
        counts[name] = events["compiled"]["collectives"]
        if name != "ep1":
            assert events["accepted"]["effects"]["mesh.expert"]["status"] == "active"
    for name in ("ep2", "ep2_megablox"):  # dispatch + combine, and their transposes
        assert counts[name]["ragged-all-to-all"] >= 4, (name, counts[name])
    assert counts["ep1"]["ragged-all-to-all"] == 0


def test_capacity_factor_shrinks_expert_parallel_memory(tmp_path):
    """Dropless EP receives into expert x the device's slots; capacity 1.0 into about 1x."""
    model = {**SMALL_MOE, "num_experts": 8}
    temp = {}
    for cap in (-1.0, 1.0):
        (tmp_path / str(cap)).mkdir()
        config = {
            "model": {**model, "capacity_factor": cap},
            "mesh": {"fsdp": 1, "expert": 8},
            "seq_len": 1024,
            "remat": {"policy": "minimal"},
        }
        code, events, err = _compile(tmp_path / str(cap), config)
        assert code == 0, err[-2000:]
        temp[cap] = events["compiled"]["memory_per_device"]["temp_size_in_bytes"]
        estimated = events["summary"]["est_memory_per_device"]["activations"]
        temp[f"est{cap}"] = estimated
    assert temp[1.0] < 0.5 * temp[-1.0], temp  # measured: 48.6 MiB vs 290 MiB
    assert temp["est1.0"] < temp["est-1.0"]  # the analytic model sees the buffer too


@pytest.mark.xdist_group("remat_pair")  # one worker compiles the pair
def test_summary_labels_every_figure(remat_pair):
    summary = remat_pair["full"][1]["summary"]
    assert summary["hardware"] == "TPU7x" and summary["chips"] == 4
    assert "hbm_per_device_gib" in summary["figure_fidelity"]["compile"]
    assert "est_tokens_per_sec_per_chip" in summary["figure_fidelity"]["estimate"]
    assert "tokens_per_sec_per_chip" not in summary  # nothing was measured
    assert summary["bound"] in ("compute", "hbm", "ici") and summary["fits"] is True


MEMORY_GRID = {
    "dense_fsdp8": {"model": SMALL},
    "dense_fsdp4_tp2": {"model": SMALL, "mesh": {"fsdp": 4, "tensor": 2}},
    "moe_fsdp4_ep2": {"model": SMALL_MOE, "mesh": {"fsdp": 4, "expert": 2}},
}


@pytest.mark.parametrize("case", sorted(MEMORY_GRID))
def test_analytic_state_memory_matches_the_compiler(case, compile_once):
    """Parameters + optimizer state per device: analytic versus the compiler's argument bytes."""
    config = MEMORY_GRID[case]
    code, events, err = compile_once(config)
    assert code == 0, err[-2000:]
    compiled = events["compiled"]["memory_per_device"]["argument_size_in_bytes"]
    trial = load_config({**config, "seq_len": 256})
    analytic = memory_per_device(trial, trial.mesh.resolve(8), global_batch=8)
    state = analytic["params_f32"] + analytic["optimizer_state"]
    # Stated tolerance: 10% (small arrays such as norm scales are padded to TPU tiles, and
    # the batch arrays are arguments too).
    assert state == pytest.approx(compiled, rel=0.10)


def test_attention_too_big_for_hbm_is_oom_hbm(tmp_path):
    """The XLA reference materializes float32 scores: at 64k tokens one layer's are 128 GiB
    per device, past TPU7x's 94.75 GiB, and the compiler's refusal is classified oom_hbm."""
    code, events, _ = _compile(
        tmp_path,
        {
            "model": {**SMALL, "num_layers": 1, "num_heads": 8, "num_kv_heads": 8},
            "seq_len": 65536,
            "per_device_batch": 1,
            "kernels": {"attention": "xla"},
        },
    )
    assert code == EXIT_CODES["oom_hbm"], events
    assert events["failure"]["failure_class"] == "oom_hbm"
    assert "compiled" not in events


def test_a_program_over_the_spaces_memory_budget_is_oom_hbm(compile_once):
    """constraints.max_memory_per_device_gib (limits.device_memory_gib) holds at compile
    fidelity as at run fidelity: a compile that fits the chip but not the budget is oom_hbm."""
    code, events, _ = compile_once({"model": SMALL})
    assert code == 0
    used = events["compiled"]["memory_per_device"]["total_bytes"] / 2**30
    code, events, _ = compile_once({"model": SMALL, "limits": {"device_memory_gib": used / 2}})
    assert code == EXIT_CODES["oom_hbm"], events
    assert "limits.device_memory_gib" in events["failure"]["message"]


SPLASH_2048 = {
    "model": {
        "preset": "tiny-dense",
        "d_model": 256,
        "num_layers": 1,
        "num_heads": 8,
        "num_kv_heads": 8,
        "head_dim": 128,
    },
    "seq_len": 2048,
    "kernels": {
        "attention": "splash",
        **dict.fromkeys(
            SPLASH_BLOCKS,
            2048,
        ),
    },
}


def test_splash_blocks_2048_need_the_scoped_vmem_the_limit_gives(tmp_path):
    """Splash with 2048 blocks overflows a 16 MiB scoped VMEM limit (oom_vmem) and compiles
    under 48 MiB. Under libtpu's default limit: oom_vmem with jax 0.10.2 / libtpu 0.0.42.1;
    compiles with jax 0.12.0.1 / libtpu 0.0.52 / tokamax 0.0.17 (at 32 MiB too; 28 overflows)."""
    xla = {"scoped_vmem_kib": 16384, "judge": False}  # a flag's verdict: tested on its own
    code, events, _ = _compile(tmp_path, {**SPLASH_2048, "xla": xla})
    assert (
        code == EXIT_CODES["oom_vmem"]
        and "CompileTimeScopedVmemOom" in events["failure"]["message"]
    )
    xla = {"scoped_vmem_kib": 49152, "judge": False}
    code, events, err = _compile(tmp_path, {**SPLASH_2048, "xla": xla})
    assert code == 0, err[-2000:]
    assert events["accepted"]["libtpu_init_args"] == ["--xla_tpu_scoped_vmem_limit_kib=49152"]
    assert "xla.scoped_vmem_kib" not in events["compiled"]["effects"]
    assert events["accepted"]["effects"]["kernels.splash_blocks"]["status"] == "active"
    # The limit that lets the larger blocks compile makes the step faster than the 256-wide
    # blocks that fit the tight one: 64 grid steps per sequence and head where 2048 take one,
    # each under the floor a step costs (`GRID_STEP_S`), against 1.8x the causal FLOPs.
    small = {**SPLASH_2048["kernels"], **dict.fromkeys(SPLASH_BLOCKS, 256)}
    tight = {"scoped_vmem_kib": 16384, "judge": False}
    code, small_events, err = _compile(tmp_path, {**SPLASH_2048, "kernels": small, "xla": tight})
    assert code == 0, err[-2000:]
    large_s, small_s = (e["summary"]["est_step_time_s"] for e in (events, small_events))
    assert large_s < small_s


def test_flag_knobs_are_judged_by_the_program_they_compile_to(tmp_path):
    """A flag bundle whose program is byte-identical to the default's is inert; a VMEM limit
    that changes the program is active; the same trial again shares the first compile."""
    config = {
        "model": SMALL,
        "convergence": {"enabled": False, "cache_dir": str(tmp_path / "cache")},
        "xla": {"collective_mode": "sparsecore_offload", "scoped_vmem_kib": 8192},
    }
    code, events, err = _compile(tmp_path, config)
    assert code == 0, err[-2000:]
    compiled = events["compiled"]
    effects = compiled["effects"]
    assert effects["xla.collective_mode"]["status"] == "inert", effects
    assert effects["xla.scoped_vmem_kib"]["status"] == "active", effects
    assert not compiled["shared_compile"]
    code, again, _ = _compile(tmp_path, config)
    assert code == 0 and again["compiled"]["shared_compile"]
    assert again["compiled"]["program_fingerprint"] == compiled["program_fingerprint"]
    assert again["summary"]["hbm_per_device_gib"] == events["summary"]["hbm_per_device_gib"]


def test_unknown_libtpu_flag_is_invalid_config(tmp_path):
    code, events, _ = _compile(
        tmp_path,
        {"model": {"preset": "tiny-dense"}, "xla": {"extra": ["--xla_tpu_bogus_flag=true"]}},
    )
    assert code == EXIT_CODES["invalid_config"]
    failure = events["failure"]
    assert failure["field"] == "xla" and "xla_tpu_bogus_flag" in failure["message"]


def test_collective_bundles_are_flags_libtpu_knows():
    assert unknown_flag(SPARSECORE_OFFLOAD) is None
    assert unknown_flag(ASYNC_FUSION) is None
    assert "xla_tpu_nonsense" in unknown_flag(("--xla_tpu_nonsense=1",))


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
        summary["est_memory_per_device"][k]
        for k in ("params_f32", "optimizer_state", "gradients_f32")
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


def test_splash_with_context_parallelism_compiles_for_tpu7x(tmp_path):
    config = {
        "model": SMALL,
        "seq_len": 2048,
        "mesh": {"fsdp": 4, "context": 2},
        "kernels": {"attention": "splash", **dict.fromkeys(SPLASH_BLOCKS, 512)},
    }
    code, events, err = _compile(tmp_path, config)
    assert code == 0, err[-2000:]
    assert events["accepted"]["mesh"]["context"] == 2
    assert (
        events["compiled"]["collectives"]["all-gather"] > 0
    )  # keys and values gathered over context


def test_fp8_is_in_the_compiled_tpu7x_program():
    """The compiled TPU program (not only the lowered one) holds fp8 operands: fp8 is really on."""
    from trainer.compile.aot import topology_devices
    from trainer.program.build import build_program, compile_step

    texts = {}
    for mode in ("bf16", "fp8"):
        config = load_config(
            {"model": SMALL, "seq_len": 256, "per_device_batch": 1, "precision": {"mode": mode}}
        )
        compiled, _ = compile_step(build_program(config, topology_devices(TARGET)))
        texts[mode] = compiled.as_text().lower()
    assert "f8e4m3fn" not in texts["bf16"] and "f8e5m2" not in texts["bf16"]
    assert "f8e4m3fn" in texts["fp8"] and "f8e5m2" in texts["fp8"]
    # The products themselves read fp8 (not only a cast next to a bf16 product).
    bf16, fp8 = count_matmuls(texts["bf16"]), count_matmuls(texts["fp8"])
    assert bf16["fp8"] == 0 and bf16["total"] > 0
    assert fp8["fp8"] >= fp8["total"] // 2, fp8


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


# The tiles, not the model, set the kernel's VMEM need: one Mixtral-style layer (8 experts,
# top-2) with 2048-wide projections, the largest tile, splits the two tile sets as the full
# Mixtral layer of TPU7X.md does, at a third of the compile time.
MOE_LAYER = {
    "preset": "mixtral-8x7b",
    "num_layers": 1,
    "vocab_size": 256,
    "d_model": 2048,
    "mlp_dim": 2048,
    "num_heads": 8,
    "num_kv_heads": 8,
}


@pytest.mark.parametrize(
    ("tiles", "code"),
    [
        ((512, 1024, 1024), 0),
        # The oom_vmem verdict is also the Splash 2048 test's; this one in `make test-slow`.
        pytest.param((1024, 2048, 2048), EXIT_CODES["oom_vmem"], marks=pytest.mark.slow),
    ],
)
@pytest.mark.xdist_group("megablox")  # shares the (512,1024,1024) compile with the next test
def test_megablox_tiles_meet_tpu7x_vmem(compile_once, tiles, code):
    """TPU7X.md: GMM tiles (512,1024,1024) compile; (1024,2048,2048) overflow the default scoped VMEM."""
    tm, tk, tn = tiles
    config = {
        "model": MOE_LAYER,
        "seq_len": 512,
        "per_device_batch": 1,
        "mesh": {"fsdp": 8},
        "kernels": {"moe_gmm": "megablox", "gmm_tm": tm, "gmm_tk": tk, "gmm_tn": tn},
    }
    got, events, err = compile_once(config)
    assert got == code, (events.get("failure"), err[-1500:])
    if code:
        assert "vmem" in events["failure"]["message"].lower()


@pytest.mark.xdist_group("megablox")
def test_megablox_tiles_set_the_kernel_work_the_estimate_counts(compile_once):
    """Megablox runs whole row tiles, one more for each group boundary inside a tile (its
    group metadata): 1,024 routed rows per device over 8 experts are 2 + 7 tiles of 512
    rows (4.5x the rows) but 8 + 7 tiles of 128 (1.875x). The estimate reads each call's
    tiles from its Mosaic module in the compiled program, and counts the calls it makes."""
    from trainer.spec.hardware import Topology
    from trainer.spec.mxu import MXU_EFFICIENCY

    summaries = {}
    for tm in (512, 128):
        kernels = {"moe_gmm": "megablox", "gmm_tm": tm, "gmm_tk": 1024, "gmm_tn": 1024}
        config = {"model": MOE_LAYER, "seq_len": 512, "per_device_batch": 1,
                  "mesh": {"fsdp": 8}, "kernels": kernels}  # fmt: skip
        code, events, err = compile_once(config)
        assert code == 0, err[-2000:]
        summaries[tm] = events["summary"]
        calls = [c for c in summaries[tm]["program_cost"]["kernel_calls"]
                 if c["name"] in ("gmm", "tgmm")]  # fmt: skip
        assert {tuple(c["blocks"][0]) for c in calls} == {(tm, 1024)}, calls
        # Forward, its recomputation and the input gradient of 3 expert matmuls; then
        # their 3 weight gradients. Each call states 2mkn: 1,024 rows x 2,048 x 2,048.
        times = {
            name: sum(c["times"] for c in calls if c["name"] == name) for name in ("gmm", "tgmm")
        }
        assert times == {"gmm": 9, "tgmm": 3}
        assert {c["flops"] for c in calls} == {2 * 1024 * 2048 * 2048}
        # Splash's calls are read too (their metadata spans lines in the HLO text).
        names = {c["name"] for c in summaries[tm]["program_cost"]["kernel_calls"]}
        assert {"splash_mqa_fwd_residuals", "splash_mqa_dkv_no_residuals"} <= names, names
    mxu = Topology.parse(TARGET).accelerator
    rate = mxu.peak_tflops["bf16"] * 1e12 / mxu.devices_per_chip * MXU_EFFICIENCY
    # gmm holds (tk, tn) = 1024 x 1024 weight tiles; tgmm (contracting the rows) holds (tm,
    # tn) gradient tiles: 128 rows fill half of TPU7x's 256-wide MXU, twice the time.
    spent = {512: 9 * 4.5 + 3 * 4.5, 128: 9 * 1.875 + 3 * 1.875 / 0.5}
    extra = 2 * 1024 * 2048 * 2048 * (spent[512] - spent[128]) / rate
    gap = summaries[512]["est_compute_s"] - summaries[128]["est_compute_s"]
    assert gap == pytest.approx(extra, rel=1e-6)


def test_tokamax_grouped_matmul_compiles_to_its_own_kernels_for_tpu7x(compile_once):
    """tokamax picks its kernel by the default device; the AOT compile makes that the
    target's TPU device, so the program is the one a TPU host runs: tokamax's Mosaic gmm
    and tgmm, the expert weight gradient included."""
    from trainer.compile.step_model import kernel_flops
    from trainer.model.grouped_matmul import _TOKAMAX_TILE_TABLES
    from trainer.spec.config import load_config
    from trainer.spec.hardware import ACCELERATORS

    programs = {}
    config = {"model": MOE_LAYER, "seq_len": 512, "per_device_batch": 1,
              "mesh": {"fsdp": 8}, "kernels": {"moe_gmm": "tokamax"}}  # fmt: skip
    code, events, err = compile_once(config)
    assert code == 0, err[-2000:]
    programs["tokamax"] = events["summary"]["program_cost"]
    times = collections.Counter()
    for call in programs["tokamax"]["kernel_calls"]:
        times[_kernel(call)] += call["times"]
    # Forward and its recomputation, input gradient; weight gradient: 3 expert matmuls each.
    assert times["gmm_megablox"] == 6 and times["gmm_megablox_transpose_rhs"] == 3, times
    assert times["tgmm_megablox"] == 3, times
    # tokamax pipelines by hand (no grid in the module) and states its tiles in the call's
    # metadata. With no knob: tokamax 0.0.12's default 128-row tiles for shapes its table
    # does not list; with tokamax 0.0.17 (no table) MaxText's 512x1024x1024. 1,024 rows over
    # 8 experts run 8 + 7 tiles of 128 rows (the estimate counts 1.875x the stated 2mkn) or
    # 2 + 7 of 512 (4.5x); 128 x 128 held tiles fill a quarter of TPU7x's 256-wide MXU (4x
    # the MXU time), 1024 x 1024 ones all of it.
    grouped = [c for c in programs["tokamax"]["kernel_calls"] if "gmm" in c["name"]]
    tables = any(_TOKAMAX_TILE_TABLES.values())
    tiles, rows, fill = ((128, 128, 128), 1.875, 4.0) if tables else ((512, 1024, 1024), 4.5, 1.0)
    assert {tuple(c["tiling"]) for c in grouped} == {tiles}, grouped
    each = kernel_flops(load_config({**config, "kernels": {"moe_gmm": "tokamax"},
                                          "compile_target": TARGET}), 8, 8, calls=grouped).each  # fmt: skip
    assert [f / c["flops"] for f, c in zip(each, grouped, strict=True)] == pytest.approx(
        [rows] * len(grouped)
    )
    spent = kernel_flops(load_config({**config, "kernels": {"moe_gmm": "tokamax"},
                                      "compile_target": TARGET}), 8, 8, calls=grouped,
                         mxu_width=ACCELERATORS["tpu7x"].mxu_width).each  # fmt: skip
    assert [s / f for s, f in zip(spent, each, strict=True)] == pytest.approx([fill] * len(each))


def test_ragged_dot_runs_libtpus_ragged_dot_kernels_on_tpu7x(compile_once):
    """On TPU the trainer runs XLA's ragged_dot as libtpu's ragged-dot kernels (every TPU
    trial sets RAGGED_DOT_KERNEL): the step's 12 expert matmuls (forward and its
    recomputation, input and weight gradients of 3 weights) are kernel calls. libtpu 0.0.52
    left to its default (the flag false) lowers each to a dense dot over all 8 experts, 8x
    the work: 12 x 2 x experts x rows x d x mlp more counted FLOPs, and no kernel call."""
    rows, d, mlp, experts = 1024, MOE_LAYER["d_model"], MOE_LAYER["mlp_dim"], 8
    programs = {}
    for name, extra in (("kernels", []), ("dense", ["--xla_tpu_enable_ragged_dot_kernel=false"])):
        config = {"model": MOE_LAYER, "seq_len": 512, "per_device_batch": 1, "mesh": {"fsdp": 8},
                  "kernels": {"moe_gmm": "ragged_dot"}, "xla": {"extra": extra, "judge": False}}  # fmt: skip
        code, events, err = compile_once(config)
        assert code == 0, err[-2000:]
        programs[name] = events["summary"]["program_cost"]
    matmuls = collections.Counter()
    for name, cost in programs.items():
        for call in cost["kernel_calls"]:
            if call["name"].startswith("ragged-dot-none"):
                matmuls[name] += call["times"]
    assert matmuls == {"kernels": 12}, matmuls
    dense = 12 * 2 * experts * rows * d * mlp
    counted = {name: cost["flops"]["bf16"] for name, cost in programs.items()}
    assert counted["dense"] - counted["kernels"] == pytest.approx(dense, rel=0.01)


def test_fp8_experts_in_tokamax_are_fp8_kernel_calls_on_tpu7x(compile_once):
    """With fp8 experts and moe_gmm tokamax, all three grouped matmuls of the step (forward,
    input and weight gradient) are tokamax kernel calls with fp8 operands, as MaxText's fp8
    MoE recipes run them; the step model runs them at the fp8 rate. With bf16 experts (the
    test above's program) none is fp8."""
    from trainer.compile.step_model import step_time

    def calls(precision: dict) -> tuple[dict, list]:
        config = {"model": MOE_LAYER, "seq_len": 512, "per_device_batch": 1,
                  "mesh": {"fsdp": 8}, "kernels": {"moe_gmm": "tokamax"}, **precision}  # fmt: skip
        code, events, err = compile_once(config)
        assert code == 0, err[-2000:]
        cost = events["summary"]["program_cost"]
        return cost, [c for c in cost["kernel_calls"] if "gmm" in c["name"]]

    _, bf16 = calls({})
    cost, fp8 = calls({"precision": {"mode": "fp8", "granularity": "per_axis"}})
    assert {c["precision"] for c in bf16} == {"bf16"}
    assert {c["precision"] for c in fp8} == {"fp8"}, fp8
    names = collections.Counter()
    for call in fp8:
        names[_kernel(call)] += call["times"]
    assert names == {"gmm_megablox": 6, "gmm_megablox_transpose_rhs": 3, "tgmm_megablox": 3}
    as_bf16 = {**cost, "kernel_calls": [{**c, "precision": "bf16"} for c in cost["kernel_calls"]]}
    tpu7x = ACCELERATORS["tpu7x"]
    assert step_time(cost, tpu7x)["est_compute_s"] < step_time(as_bf16, tpu7x)["est_compute_s"]


def test_tokamax_tiles_reach_their_kernels_on_tpu7x(compile_once):
    """`kernels.tokamax_tiles` sets the tiles of the pass and weight it names (clamped to the
    matmul's dims), in bf16 (tokamax's own VJP) and fp8 experts alike; the other passes keep
    the default tiles."""
    from trainer.model.grouped_matmul import _TOKAMAX_TILE_TABLES

    tiles = {"wi_fwd": "256x4096x512", "wo_drhs": "512x256x4096"}
    model = {**MOE_LAYER, "mlp_dim": 1024}  # wi and wo told apart by their shapes
    for precision in ({}, {"precision": {"mode": "fp8", "granularity": "per_axis"}}):
        config = {"model": model, "seq_len": 512, "per_device_batch": 1, "mesh": {"fsdp": 8},
                  "kernels": {"moe_gmm": "tokamax", "tokamax_tiles": tiles}, **precision}  # fmt: skip
        code, events, err = compile_once(config)
        assert code == 0, err[-2000:]
        by_name = collections.defaultdict(set)
        for call in events["summary"]["program_cost"]["kernel_calls"]:
            if "gmm" in call["name"]:
                by_name[_kernel(call), tuple(call["out"])].add(tuple(call["tiling"]))
        d, mlp = model["d_model"], model["mlp_dim"]
        # wi forward: 1024 rows x d_model -> mlp, tk clamped to d_model.
        assert by_name["gmm_megablox", (1024, mlp)] == {(256, d, 512)}, by_name
        # wo weight gradient (tgmm, out [experts, mlp, d_model]), tn clamped to d_model.
        assert by_name["tgmm_megablox", (8, mlp, d)] == {(512, 256, d)}, by_name
        # The passes not named keep the default: tokamax 0.0.12's choice (its 128s for these
        # shapes), or with tokamax 0.0.17 (no table) MaxText's 512x1024x1024.
        unset = {(512, 1024, 1024)} if not any(_TOKAMAX_TILE_TABLES.values()) else {(128,) * 3}
        assert by_name["gmm_megablox", (1024, d)] == unset, by_name
        assert by_name["tgmm_megablox", (8, d, mlp)] == unset, by_name


def test_compile_trials_give_the_compiler_large_stacks_and_the_same_program(tmp_path, monkeypatch):
    """Compile trials run libtpu with 32 MiB thread stacks (libtpu 0.0.42.1 overflows a
    compiler fiber's stack on qwen3-235b's MoE layer). A compiler setting, not a program
    one: without them a model compiles to the same program."""
    from trainer.cli import prepare_environment
    from trainer.spec.flags import COMPILER_STACKS, RAGGED_DOT_KERNEL

    config = {"model": SMALL, "per_device_batch": 2}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what prepare_environment sets goes
    for name in ("LIBTPU_INIT_ARGS", "SWEEPER_BASE_LIBTPU_INIT_ARGS"):
        os.environ.pop(name, None)
    trial = load_config({**config, "compile_target": TARGET})
    prepare_environment(trial)
    host = [RAGGED_DOT_KERNEL, *COMPILER_STACKS]  # the first a program setting of every TPU trial
    assert os.environ["LIBTPU_INIT_ARGS"].split() == host
    # A twin compile's child starts from the base (programs.twin_fingerprint): no second copy,
    # or its program key (which holds the flags) would differ from the same program's.
    os.environ.pop("SWEEPER_BASE_LIBTPU_INIT_ARGS")
    prepare_environment(trial)
    assert os.environ["LIBTPU_INIT_ARGS"].split() == host
    for name in ("LIBTPU_INIT_ARGS", "SWEEPER_BASE_LIBTPU_INIT_ARGS"):
        os.environ.pop(name)
    prints = {}
    for stacks in (True, False):
        if not stacks:  # a base already set: the trainer adds nothing to the host's flags
            os.environ["SWEEPER_BASE_LIBTPU_INIT_ARGS"] = ""
        (tmp_path / str(stacks)).mkdir()
        code, events, err = _compile(tmp_path / str(stacks), config)
        assert code == 0, err[-2000:]
        flags = events["compiled"]["effects"].get("xla", {}).get("reason", "")
        prints[stacks] = events["summary"]["program_fingerprint"]
        assert all(f not in flags for f in host)  # not the trial's knobs
    assert prints[True] == prints[False]


# A one-layer model with Llama 3's 128k vocabulary: the loss head is most of its memory.
BIG_VOCAB = {**SMALL, "vocab_size": 128256, "num_layers": 1}


def test_vocab_tiling_frees_the_logits_and_no_float32_copy_is_made_on_tpu7x(tmp_path):
    """The loss keeps bf16 logits and computes in float32 inside its fusions: untiled, the
    loss head holds the saved logits and their gradient (2 bf16 copies), no float32 copy
    (before: 2.57 bf16 copies, a float32 one materialized for TPU's SparseCore gather of
    the targets' logits); 8 tiles hold one tile's."""
    config = {"model": BIG_VOCAB, "seq_len": 2048, "per_device_batch": 2}
    memory = {}
    for tiles in (1, 8):
        (tmp_path / str(tiles)).mkdir()
        code, events, err = _compile(tmp_path / str(tiles), {**config, "vocab_tiling": tiles})
        assert code == 0, err[-2000:]
        memory[tiles] = events["compiled"]["memory_per_device"]
    bf16_logits = 2 * 2048 * 128256 * 2  # tokens on one device (fsdp) x vocab x bf16
    freed = memory[1]["temp_size_in_bytes"] - memory[8]["temp_size_in_bytes"]
    assert bf16_logits < freed <= 2 * bf16_logits
    assert memory[1]["argument_size_in_bytes"] == memory[8]["argument_size_in_bytes"]


@pytest.mark.slow
def test_the_published_70b_recipe_fits_tpu7x_within_8_percent_of_maxtext(tmp_path):
    """llama3.1-70b 8k on tpu7x:4x4x4 exactly as published (tpu-recipes; the loss untiled,
    as MaxText's default) fits a device: 5.15 + 87.16 GiB here, where it was 0.32 GiB over
    before the unembedding weight's gather waited for the decoder loop. MaxText 0.2.5
    compiled it to 5,525,434,368 + 86,750,150,656 B per device (benchmarks.maxtext_parity,
    2026-12-01)."""
    space = load_space("spaces/llama31_70b_8k_tpu7x.yaml")
    recipe = assemble(space, space.search.warm_start[0])
    assert recipe["vocab_tiling"] == 1
    config = {**recipe, "xla": {**recipe["xla"], "judge": False}}
    code, events, err = _compile(tmp_path, config, target=space.target, timeout=2400)
    assert code == 0, err[-2000:]
    memory = events["compiled"]["memory_per_device"]
    maxtext = 5_525_434_368 + 86_750_150_656
    ours = memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]
    assert abs(ours / maxtext - 1) < 0.08
    assert memory["argument_size_in_bytes"] == pytest.approx(5_525_434_368, rel=0.01)  # mu bf16
    assert events["summary"]["fits"] is True


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_published_70b_128k_recipe_fits_tpu7x_within_5_percent_of_maxtext(tmp_path):
    """llama3.1-70b 128k on tpu7x:4x8x8 as published (FSDP 64 x context 8, dq_reduction_steps
    3) fits a device: it was oom_hbm (103.35 GiB of temporaries) while each layer's values
    were saved gathered over the whole sequence and dQ came out of Splash in 32 float32
    copies. MaxText 0.2.5 compiled it to 1,672,031,744 + 82,882,297,856 B per device under
    libtpu 0.0.52 (docs/TPU7X.md); ours, with that compiler (SWEEPER_NEWER_JAX_PYTHON), is
    held within 5% of it; with ours (libtpu 0.0.42.1), it must fit."""
    from benchmarks.compile_real_models import compile_trial

    space = load_space("spaces/llama31_70b_128k_tpu7x.yaml")
    recipe = assemble(space, space.search.warm_start[0])
    assert recipe["kernels"]["dq_reduction_steps"] == 3
    for python in (None, NEWER_JAX) if NEWER_JAX else (None,):
        events, _ = compile_trial(recipe, space.target, python=python)
        assert "compiled" in events, events.get("failure")
        memory = events["compiled"]["memory_per_device"]
        ours = memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]
        assert ours <= ACCELERATORS["tpu7x"].usable_hbm_per_device
        if python:
            assert abs(ours / (1_672_031_744 + 82_882_297_856) - 1) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_published_qwen3_moe_recipe_compiles_and_fits_tpu7x(precision, tmp_path):
    """qwen3-235b-a22b 4k on tpu7x:4x8x8 as published (tpu-recipes; the loss untiled, as
    MaxText's default), bf16 and fp8: it compiles (libtpu 0.0.42.1 overflowed a compiler
    stack on it before compile trials ran with 32 MiB stacks, and failed a SparseCore gather
    of bf16 logits) and fits (float32 logits took 37 GiB more before), every expert matmul
    in tokamax's own kernels (3 weight gradients a layer by tgmm; with fp8 operands in the
    fp8 recipe) and the 94 layers' inputs in host memory."""
    space = load_space("spaces/qwen3_235b_4k_tpu7x.yaml")
    recipe = assemble(space, space.search.warm_start[["bf16", "fp8"].index(precision)])
    assert recipe["precision"]["mode"] == precision
    assert recipe["vocab_tiling"] == 1
    config = {**recipe, "xla": {**recipe["xla"], "judge": False}}
    code, events, err = _compile(tmp_path, config, target=space.target, timeout=3600)
    assert code == 0, err[-2000:]
    assert events["summary"]["fits"] is True
    layers, tokens, d = 94, 16 * 4096, 4096
    memory = events["compiled"]["memory_per_device"]
    assert memory["host_temp_size_in_bytes"] == layers * tokens * d * 2
    calls = collections.Counter()
    for call in events["summary"]["program_cost"]["kernel_calls"]:
        calls[_kernel(call)] += call["times"]
        if "gmm" in call["name"]:
            assert call["precision"] == precision, call
    assert calls["tgmm_megablox"] == 3 * layers, calls


@pytest.mark.slow
def test_offloading_the_70b_layer_input_saves_its_20_gib_on_tpu7x(tmp_path):
    """The 70B recipe with the newer recipe's Splash layouts (queries and keys seq_minor) and
    the layer input offloaded: its 80 layers' inputs live in host memory, and the trial's
    verdict (the same program with them on device, compiled as its twin) is that device
    memory drops by about that much. With the default layouts a 20 GiB layout copy of the
    saved queries cancelled the saving (benchmarks/offload_at_size.py)."""
    space = load_space("spaces/llama31_70b_8k_tpu7x.yaml")
    recipe = assemble(space, space.search.warm_start[0])
    config = {
        **recipe,
        "vocab_tiling": 8,
        "kernels": {**recipe["kernels"], "q_layout": "seq_minor", "k_layout": "seq_minor"},
        "remat": {
            "policy": "custom",
            "custom": {**recipe["remat"]["custom"], "decoder_layer_input": "offload"},
        },
    }
    code, events, err = _compile(tmp_path, config, target=space.target, timeout=3600)
    assert code == 0, err[-2000:]
    inputs = 80 * 2 * 8192 * 8192 * 2  # layers x batch x seq x d_model, bf16, per device
    assert events["compiled"]["memory_per_device"]["host_temp_size_in_bytes"] == inputs
    verdict = events["compiled"]["effects"]["remat.offload"]
    assert verdict["status"] == "active", verdict
    saved_gib = float(re.search(r"saves ([\d.]+) GiB", verdict["reason"]).group(1))
    assert saved_gib > 0.9 * inputs / 2**30, verdict


def _compiled_text(config: dict, target: str = TARGET) -> str:
    from trainer.compile.aot import topology_devices
    from trainer.program.build import build_program, compile_step

    compiled, _ = compile_step(build_program(load_config(config), topology_devices(target)))
    return compiled.as_text()


def _compiled_text_in(python: str, config: dict, target: str) -> str:
    """The compiled program's text, compiled in a child run by `python` (this interpreter, or
    another with its own JAX and libtpu), with this repository on its path."""
    code = (
        "import json, sys\n"
        "from trainer.compile.aot import topology_devices\n"
        "from trainer.spec.config import load_config\n"
        "from trainer.run.train import build_program, compile_step\n"
        "program = build_program(load_config(json.loads(sys.argv[1])), topology_devices(sys.argv[2]))\n"
        "sys.stdout.write(compile_step(program)[0].as_text())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "TPU_ACCELERATOR_TYPE": "tpu7x-8", "TPU_WORKER_HOSTNAMES": "localhost",
           "LIBTPU_INIT_ARGS": " ".join(COMPILER_STACKS)}  # fmt: skip
    proc = subprocess.run([python, "-c", code, json.dumps(config), target],
                          capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def most_live_at_once(hlo: str, shape: str, op: str) -> int:
    """How many values of `shape` made by ops named `op` the entry computation holds at once,
    in its schedule order (each from its definition to its last use)."""
    computations, entry, _ = parse(hlo)
    body = computations[entry]
    spans = []
    for i, instr in enumerate(body):
        if instr.type.startswith(shape + "{") and op in instr.attrs:
            uses = [j for j in range(i + 1, len(body)) if instr.name in body[j].operands]
            spans.append((i, max(uses, default=i)))
    return max((sum(a <= i <= b for a, b in spans) for i, _ in spans), default=0)


# The shape that made libtpu 0.0.52 keep two gradients of the logits: d_model 8192 on 128
# devices (neither d_model 4096 there nor d_model 8192 on tpu7x:2x2x2 did).
WIDE_HEAD = {**SMALL, "d_model": 8192, "num_heads": 64, "num_kv_heads": 8, "mlp_dim": 1024,
             "vocab_size": 128256, "num_layers": 1}  # fmt: skip
NEWER_JAX = os.environ.get("SWEEPER_NEWER_JAX_PYTHON")  # e.g. a MaxText 0.2.5 venv's python


@pytest.mark.slow
@pytest.mark.parametrize(
    "python",
    [sys.executable, pytest.param(NEWER_JAX, marks=pytest.mark.skipif(
        not NEWER_JAX, reason="SWEEPER_NEWER_JAX_PYTHON names no interpreter"))],
    ids=["pinned", "newer-jax"],
)  # fmt: skip
def test_the_loss_backward_holds_one_logits_gradient_at_a_time_on_tpu7x(python):
    """The unembedding's two gradient matmuls read d loss / d logits one after the other.
    Left to it, libtpu 0.0.52 (MaxText 0.2.5's) made that gradient twice, once for each
    matmul, both live at once: 3.91 GiB per device more than MaxText at the 70B recipe,
    the whole gap to it. libtpu 0.0.42.1 fuses the gradient into both matmuls; this checks
    it in whichever compiler runs (SWEEPER_NEWER_JAX_PYTHON: a second one)."""
    config = {"model": WIDE_HEAD, "seq_len": 8192, "per_device_batch": 2,
              "convergence": {"enabled": False}}  # fmt: skip
    text = _compiled_text_in(python, config, "tpu7x:4x4x4")
    assert most_live_at_once(text, "bf16[2,8192,128256]", "transpose(") <= 1


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


def test_the_unembedding_weight_is_gathered_after_the_decoder_loop_on_tpu7x():
    """The unembedding weight's FSDP all-gather starts after the forward layer loop: left
    free, XLA's scheduler started it before the loop, and the full [d_model, vocab] copy
    lived through the whole forward pass (1.96 GiB per device at llama3.1-70b's peak)."""
    d, vocab = SMALL["d_model"], 32768
    config = {"model": {**SMALL, "vocab_size": vocab, "num_layers": 4}, "seq_len": 256,
              "per_device_batch": 1, "mesh": {"fsdp": 8}}  # fmt: skip
    text = _compiled_text(config)
    entry = text[text.index("\nENTRY") :].splitlines()
    loop = next(i for i, line in enumerate(entry) if " while(" in line)

    # The gather's instructions (a plain all-gather-start, or a SparseCore-offloaded
    # call-start/update/done, whose start names no shape in libtpu 0.0.52), then its start.
    def instruction(line: str) -> str:  # "%all-gather.128.call-update = ...": %all-gather.128
        return line.split(" = ")[0].strip().rsplit(".call-", 1)[0]

    gather = {instruction(line) for line in entry
              if "all-gather" in line.split(" = ")[0] and f"bf16[{d},{vocab}]" in line}  # fmt: skip
    gathers = [i for i, line in enumerate(entry)
               if re.search(r"(call|all-gather)-start\(", line) and instruction(line) in gather]  # fmt: skip
    assert gathers and min(gathers) > loop, (gathers, loop)


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


def _forward_stacks(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array the forward layer loop hands the backward: what a remat
    policy saves, stacked over layers."""
    for line in hlo.splitlines():
        if " while(" in line and 'jvp(Transformer)/while"' in line:
            head = line.split(" while(")[0]
            return [(t, tuple(int(d) for d in dims.split(",")))
                    for t, dims in re.findall(r"\b(bf16|f32)\[([0-9,]+)\]", head)]  # fmt: skip
    raise AssertionError("no forward layer loop in the program")


@pytest.mark.parametrize("attention", ["splash", "xla"])
def test_context_parallelism_saves_each_devices_chunk_of_keys_and_values(attention):
    """Saved keys and values stay each device's chunk of the sequence (as named: before the
    gather). Broken: the gather's sharding reached back to the saved values, and the 70B at
    128k kept all 131,072 positions of each layer's values on every device (+17.5 GiB)."""
    seq, context = 2048, 4
    saved = dict.fromkeys(["decoder_layer_input", "query_proj", "key_proj", "value_proj"],
                          "device")  # fmt: skip
    config = {
        "model": {**SMALL, "num_heads": 4, "num_layers": 2},
        "seq_len": seq,
        "per_device_batch": 0.25,
        "mesh": {"fsdp": 2, "context": context},
        "remat": {"policy": "custom", "custom": saved},
        "kernels": {"attention": attention, **dict.fromkeys(SPLASH_BLOCKS, 512)},
        "convergence": {"enabled": False},
    }
    stacks = _forward_stacks(_compiled_text(config))
    kv = [dims for _, dims in stacks if len(dims) == 5 and dims[-2:] == (2, 128)]
    assert len(kv) == 2, stacks
    assert all(dims[2] == seq // context for dims in kv), stacks


@pytest.mark.parametrize("steps", [0, 3])
def test_dq_reduction_steps_sum_dq_in_the_splash_kernel(steps):
    """0: the fused backward writes one dQ per key/value block (float32 beyond 4) and XLA sums
    them; 3: the kernel accumulates them in 3. 2048 keys in 256-wide blocks: 8 partials."""
    blocks = {**dict.fromkeys(SPLASH_BLOCKS, 512), "block_kv_dkv": 256,
              "block_kv_dkv_compute": 256}  # fmt: skip
    config = {
        "model": {**SMALL, "num_layers": 1},
        "seq_len": 2048,
        "kernels": {"attention": "splash", **blocks, "dq_reduction_steps": steps},
        "convergence": {"enabled": False},
    }
    # dQ out of the kernel, vmapped over kv heads: [kv heads, partials, group, queries, d].
    dq = re.findall(r"splash_mqa_dkv\S* = \((\w+)\[\d+,(\d+),", _compiled_text(config))
    assert dq, "no Splash dK/dV kernel in the program"
    assert set(dq) == ({("f32", "8")} if steps == 0 else {("bf16", "3")}), dq


@pytest.mark.slow  # 3 minutes here; the lazy mask's unit test and the 2k compile run by default
@pytest.mark.timeout(1800)
def test_128k_context_parallel_splash_compiles_for_tpu7x_4x4x4(tmp_path):
    """seq 128k with context 16: the load-balanced causal mask is computed in the kernel (a
    NumPy mask would be 17 GB), so the trial plans and compiles."""
    config = {
        "model": SMALL,
        "seq_len": 131072,
        "per_device_batch": 1 / 16,
        "mesh": {"fsdp": 8, "context": 16},
        "kernels": {"attention": "splash", **dict.fromkeys(SPLASH_BLOCKS, 2048)},
        "xla": {"scoped_vmem_kib": 49152},  # 2048 blocks need it (test above)
    }
    code, events, err = _compile(tmp_path, config, target="tpu7x:4x4x4", timeout=1700)
    assert code == 0, err[-2000:]
    assert events["accepted"]["mesh"]["context"] == 16
    assert events["compiled"]["memory_per_device"]["total_bytes"] < 94 * 2**30


def test_program_cost_counts_scanned_layers_by_trip_count(compile_once):
    """XLA's cost analysis counts a scanned layer once; the HLO walk counts it L times, and
    its matrix FLOPs agree with the model formula (plus full remat's recomputed forward)."""
    from trainer.spec.config import load_config
    from trainer.spec.flops import training_flops_per_step

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
