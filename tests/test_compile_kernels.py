"""Compile fidelity, kernels and flags: Splash blocks against scoped VMEM, the grouped-matmul
kernels, fp8 in the program, LIBTPU flags judged by the program they make (libtpu, no TPU)."""

from __future__ import annotations

import collections
import re

import pytest

from tests.compile_helpers import (
    SMALL,
    SMALL_MOE,
    TARGET,
    _compile,
    _compiled_text,
    _kernel,
)
from trainer.program.hlo import count_matmuls
from trainer.trial.config import SPLASH_BLOCKS, load_config
from trainer.trial.events import EXIT_CODES
from trainer.trial.flags import ASYNC_FUSION, SPARSECORE_OFFLOAD, unknown_flag
from trainer.trial.hardware import ACCELERATORS

pytestmark = pytest.mark.tpu_compile


@pytest.mark.slow  # 1.5 min; EP dispatch: test_compile_cost's own-tokens test
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


@pytest.mark.slow  # 1-3 min; 2048 blocks' VMEM refusal: the CP tuner test, by default
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


# The tiles, not the model, set the kernel's VMEM need: one Mixtral-style layer (8 experts,
# top-2) with 2048-wide projections, the largest tile, splits the two tile sets as the full
# Mixtral layer of docs/facts.md does, at a third of the compile time.
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
    """docs/facts.md: GMM tiles (512,1024,1024) compile; (1024,2048,2048) overflow the default scoped VMEM."""
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
@pytest.mark.slow  # 1 min; megablox tiles in the program: the megablox tuner test
def test_megablox_tiles_set_the_kernel_work_the_estimate_counts(compile_once):
    """Megablox runs whole row tiles, one more for each group boundary inside a tile (its
    group metadata): 1,024 routed rows per device over 8 experts are 2 + 7 tiles of 512
    rows (4.5x the rows) but 8 + 7 tiles of 128 (1.875x). The estimate reads each call's
    tiles from its Mosaic module in the compiled program, and counts the calls it makes."""
    from trainer.trial.hardware import Topology
    from trainer.trial.mxu import MXU_EFFICIENCY

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


@pytest.mark.slow  # 1 min; tokamax's kernels compiled: the tokamax-tiles tuner tests
def test_tokamax_grouped_matmul_compiles_to_its_own_kernels_for_tpu7x(compile_once):
    """tokamax picks its kernel by the default device; the AOT compile makes that the
    target's TPU device, so the program is the one a TPU host runs: tokamax's Mosaic gmm
    and tgmm, the expert weight gradient included."""
    from trainer.compile.step_model import kernel_flops
    from trainer.model.grouped_matmul import _TOKAMAX_TILE_TABLES
    from trainer.trial.config import load_config
    from trainer.trial.hardware import ACCELERATORS

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


@pytest.mark.slow  # 1.5 min; XLA's ragged_dot path: the default MoE compile tests
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


@pytest.mark.slow  # 1 min; fp8 in the TPU7x program: test_fp8_is_in_the_compiled_tpu7x_program
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


@pytest.mark.slow  # 2 min; tokamax's tiles reach its kernels: megablox test
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


@pytest.mark.parametrize("steps", [pytest.param(0, marks=pytest.mark.slow), 3])
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
