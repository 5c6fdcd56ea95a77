"""MaxText as a trial program: what it prints read back (on real MaxText 0.2.5 output kept in
tests/data/maxtext_0.2.5, each file with the command that made it), and the spaces that run
it refused by name before any trial where MaxText cannot take a setting. The slow tests run
MaxText itself (`make maxtext`): a local run-fidelity sweep and a compile for TPU7x."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sweeper.cli.app import app
from sweeper.execute.programs import program_of
from sweeper.space.checks import static_check
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from tests.helpers import hlo_excerpt
from trainer.maxtext import logs
from trainer.trial.events import FailureClass
from trainer.trial.maxtext import MaxTextProgram, program_settings

DATA = Path(__file__).parent / "data" / "maxtext_0.2.5"
SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
MAXTEXT = MaxTextProgram().interpreter()


def test_each_step_is_read_from_maxtexts_own_log_line():
    lines = (DATA / "train_cpu.log").read_text().splitlines()
    steps = [s for s in map(logs.step_line, lines) if s is not None]
    assert [s.step for s in steps] == list(range(8))
    third = steps[
        2
    ]  # "completed step: 2, seconds: 0.025, TFLOP/s/device: 0.001, Tokens/s/device: 2539.582, ... loss: 5.648"
    assert (third.seconds, third.tflops_per_device, third.tokens_per_device, third.loss) == (
        0.025, 0.001, 2539.582, 5.648,
    )  # fmt: skip
    assert logs.step_line("Total TFLOPs: 0.00") is None


def test_compile_memory_is_read_from_train_compiles_memory_analysis():
    text = (DATA / "train_compile_70b.log").read_text()
    memory = logs.memory_analysis(text)
    assert memory is not None
    # The published 70B recipe on tpu7x:4x4x4 as MaxText compiles it: about 5.15 GiB of
    # arguments and 80.8 GiB of temporaries per device (docs/facts.md, TPU7x).
    assert 5.0 < memory["argument_size_in_bytes"] / 2**30 < 5.3
    assert 78 < memory["temp_size_in_bytes"] / 2**30 < 84
    assert memory["total_bytes"] == (
        memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
        - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"]
    )  # fmt: skip
    assert logs.memory_analysis("Finished train_compile.py successfully!") is None


@pytest.mark.parametrize(
    ("log", "expected", "field"),
    [
        ("unknown_setting.log", FailureClass.INVALID_CONFIG, "maxtext.not_a_key"),
        ("bad_value.log", FailureClass.INVALID_CONFIG, None),
        ("impossible_mesh.log", FailureClass.INVALID_CONFIG, None),
    ],
)
def test_maxtexts_refusals_are_classified_with_the_setting_they_name(log, expected, field):
    text = (DATA / log).read_text()
    failure_class, message, named = logs.failure(text, "config")
    assert (failure_class, named) == (expected, field)
    assert message and "Traceback" not in message
    # The same output once the step had compiled is no configuration refusal.
    assert logs.failure(text, "run")[0] != FailureClass.INVALID_CONFIG


def test_an_assertion_of_maxtexts_while_tracing_is_a_setting_it_cannot_take():
    """A batch the pipeline's microbatches cannot shard fails in MaxText's own assertion once
    compiling has started: invalid_config, not a compiler error."""
    text = (DATA / "unshardable_microbatch.log").read_text()
    failure_class, message, _ = logs.failure(text, "compile")
    assert failure_class == FailureClass.INVALID_CONFIG and "shardable" in message


def test_a_weight_the_mesh_cannot_shard_is_a_setting_named_by_its_mesh_axis():
    """gpt-oss-120b's 2880-wide weights over fsdp 128: JAX's IndivisibleError once compiling
    has started is invalid_config naming mesh.fsdp, said shortly (the engine's static check
    now refuses that mesh before MaxText starts: tests/test_space_import.py)."""
    text = (DATA / "indivisible.log").read_text()
    failure_class, message, field = logs.failure(text, "compile")
    assert (failure_class, field) == (FailureClass.INVALID_CONFIG, "mesh.fsdp")
    assert message == (
        "the mesh cannot shard model.decoder.layers.layers_0.GptOssAttention.key.kernel.value: "
        "its axis 0 (2880), split 128 ways over fsdp, does not divide evenly (JAX's "
        "IndivisibleError); take mesh degrees that divide it"
    )


def test_a_bare_assertion_says_what_failed_and_where():
    """tokamax's fp8 grouped matmul asserts with no message (gemma4-26b's 704-wide experts,
    fp8 through qwix, MaxText 0.2.5): the message is the failed statement and its place, not
    the traceback's last line of carets."""
    text = (DATA / "fp8_gmm_scale_tile_assert.log").read_text()
    failure_class, message, _ = logs.failure(text, "compile")
    assert failure_class == FailureClass.INVALID_CONFIG
    assert message == (
        "AssertionError: assert scales_per_tile % min_addressable_size == 0 "
        "(tokamax/_src/mosaic_tpu.py:90, in _get_scale_tile_info)"
    )


def test_an_out_of_memory_compile_is_oom_hbm():
    text = (DATA / "train_compile_oom.log").read_text()
    failure_class, message, _ = logs.failure(text, "compile")
    assert failure_class == FailureClass.OOM_HBM and "memory" in message.lower()


def _space(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((SPACES / "smoke_maxtext.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_point_becomes_maxtexts_settings_with_its_maxtext_knobs(tmp_path):
    space = load_space(SPACES / "smoke_maxtext.yaml")
    point = {"mesh.tensor": 2, "remat.policy": "minimal", "maxtext.scan_layers": False}
    args = program_of(space).args(space, point)
    request = json.loads(args[args.index("--maxtext") + 1])
    assert request["knobs"] == {"maxtext.scan_layers": False}
    config = static_check(space, point)  # the maxtext.* knob is MaxText's, not the trial's
    settings = program_settings(
        config, MaxTextProgram.model_validate(request["program"]), request["knobs"], "cpu"
    )
    assert settings.args["ici_tensor_parallelism"] == "2"
    assert settings.args["remat_policy"] == "minimal"
    assert settings.args["scan_layers"] == "false"
    assert settings.args["attention"] == "dot_product"  # no Splash on CPU


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"knobs": {"maxtext.not_a_setting": {"values": [1, 2]}}}, None, "knobs: maxtext.not_a"),
        (
            {
                "knobs": {
                    "precision.mode": {"values": ["fp8"]},
                    "precision.granularity": {
                        "values": ["per_axis", "per_tensor"],
                        "when": {"precision.mode": "fp8"},
                    },
                }
            },
            "knobs.precision.granularity",
            "MaxText has no setting",
        ),
        ({"program": None}, None, "knobs: maxtext.scan_layers is a MaxText setting"),
        (
            {"fidelity": "estimate", "target": "tpu7x:2x2x1", "objective": None},
            None,
            "fidelity: MaxText trials are compiled or run",
        ),
        ({"maxtext": {"extra": {"no_such_key": 1}}}, "maxtext.extra", "not a MaxText"),
        (  # a custom MoE shape runs as MaxText's mixtral block, which has no shared expert
            {"model": {"preset": "tiny-moe", "shared_experts": 1}},
            "trial.model.shared_experts",
            "MaxText has no setting for it (the block a custom MoE shape runs as",
        ),
        (
            {
                "program": None,
                "knobs": {"mesh.tensor": {"values": [1, 2]}},
                "target": "tpu7x:4x4x4x2",
                "fidelity": "compile",
                "objective": None,
            },
            None,
            "target: tpu7x:4x4x4x2 is 2 tpu7x:4x4x4 slices joined by the data center network; "
            "this project's trainer compiles one slice",
        ),
        (
            {"target": "tpu7x:2x2x1x2", "objective": None},
            None,
            "fidelity: run on tpu7x:2x2x1x2 is 2 tpu7x:2x2x1 slices",
        ),
    ],
)
def test_what_maxtext_cannot_take_is_refused_by_name_before_any_trial(
    tmp_path, changes, field, words
):
    with pytest.raises(SpaceError) as info:
        load_space(_space(tmp_path, **changes))
    assert words in info.value.message, info.value
    if field:
        assert info.value.field == field, info.value


def test_points_that_differ_only_in_a_maxtext_setting_are_distinct_points():
    """A sweep runs each point once (`point_key`): MaxText's settings are part of the point (the
    two-slice space's dcn_fsdp 1 and 2 were one point, and the second was skipped as a repeat);
    our trainer's keys are unchanged, so its studies still reuse what they measured."""
    import hashlib

    from sweeper.search.searcher import point_key
    from sweeper.space.points import assemble

    space = load_space(SPACES / "llama31_70b_8k_two_slices_maxtext.yaml")
    one, two = ({"per_device_batch": 2, "maxtext.dcn_fsdp_parallelism": n} for n in (1, 2))
    assert point_key(space, one) != point_key(space, two)
    assert point_key(space, one) == point_key(space, dict(one))
    ours = load_space("llama31_70b_8k_tpu7x")
    point = ours.search.warm_start[0]
    what = {"trial": assemble(ours, point), "fidelity": ours.effective_fidelity,
            "target": ours.target}  # fmt: skip
    old = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    assert point_key(ours, point) == old[:20]


def test_a_multi_slice_target_compiles_maxtext_for_its_slices(tmp_path):
    """tpu7x:4x4x4x2 is two 4x4x4 slices: 256 devices, 128 chips, and MaxText's settings
    compile one slice's topology twice over (compile_topology_num_slices 2)."""
    from trainer.trial.config import ConfigError
    from trainer.trial.hardware import Topology

    two = Topology.parse("tpu7x:4x4x4x2")
    assert (two.shape, two.slices, two.chips, two.devices, two.slice_devices) == (
        "4x4x4", 2, 128, 256, 128,
    )  # fmt: skip
    assert Topology.parse("tpu7x:4x4x4").slices == 1 and Topology.parse("v6e:4x4x2").slices == 2
    # (a model MaxText can shard over a slice's 128 devices: d_model 128)
    path = _space(tmp_path, target="tpu7x:4x4x4x2", fidelity="compile", objective=None,
                  knobs={"maxtext.dcn_data_parallelism": {"values": [2]}},
                  model={"preset": "tiny-dense", "d_model": 128, "num_heads": 4,
                         "num_kv_heads": 2, "head_dim": 32})  # fmt: skip
    space = load_space(path)
    point = {"maxtext.dcn_data_parallelism": 2}
    args = program_of(space).args(space, point)
    request = json.loads(args[args.index("--maxtext") + 1])
    config = static_check(space, point)
    assert space.num_devices == 256 and config.compile_target == "tpu7x:4x4x4x2"
    settings = program_settings(
        config, MaxTextProgram.model_validate(request["program"]), request["knobs"], "tpu"
    )
    assert settings.args["compile_topology"] == "tpu7x-128"
    assert settings.args["compile_topology_num_slices"] == "2"
    assert settings.args["dcn_data_parallelism"] == "2"
    # MaxText's mesh is 128 fsdp within a slice, data across: a 64-wide model cannot be split so.
    with pytest.raises(ConfigError, match=r"fsdp x context x expert = 128 x 1 x 1 = 128"):
        static_check(load_space(path, {"model.d_model": 64}), point)
    # Our trainer, asked for one anyway (`python -m trainer`), names the field.
    from trainer.compile.aot import topology_devices

    with pytest.raises(ConfigError, match="compile_target: tpu7x:4x4x4x2 is several slices"):
        topology_devices("tpu7x:4x4x4x2")


def test_a_maxtext_sweep_without_maxtext_exits_2_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_MAXTEXT_PYTHON", str(tmp_path / "no-python"))
    result = CliRunner().invoke(
        app, ["run", str(SPACES / "smoke_maxtext.yaml"), "--results-dir", str(tmp_path / "r")]
    )
    assert result.exit_code == 2, result.output
    assert "maxtext.python" in result.output and "make maxtext" in result.output


def test_a_collective_newer_libtpu_offloads_to_the_sparsecores_is_counted():
    """MaxText's libtpu (0.0.52) wraps a SparseCore all-gather's body in a custom call's
    called_computations and names its rings ICI_RING_DIM_X_TORUS: the step model reads it as
    it reads ours (without this, MaxText's 70B program showed 0 s of ICI time)."""
    from trainer.compile.cost import program_cost

    hlo = hlo_excerpt("maxtext_0.2.5/sparsecore_all_gather.hlo")
    (op,) = program_cost(hlo)["collective_ops"]
    assert (op["kind"], op["group"], op["torus_dims"], op["engine"]) == (
        "all-gather", 128, 3, "sparsecore",
    )  # fmt: skip
    assert op["bytes"] == 8192 * 128256 * 2  # the gathered bf16 embedding


def test_a_grouped_matmul_whose_config_has_no_cost_estimate_is_counted_from_its_shapes():
    """jax 0.12's Mosaic calls carry no cost estimate: MaxText's qwen3 program read 0 FLOPs
    for every tokamax grouped matmul, 10.7 s of compute where its matmuls take 20.4 (and 5,646
    est. tokens/s/chip where the published recipe makes 4,151). Their FLOPs are 2mkn read
    from the call's operands and result, and their tiles from its metadata."""
    from trainer.compile.cost import program_cost
    from trainer.compile.step_model import grouped_matmul_flops

    hlo = hlo_excerpt("maxtext_0.2.5/tokamax_gmm.hlo")
    gmm, tgmm = program_cost(hlo)["kernel_calls"]
    m, k, n = 524288, 4096, 1536  # routed rows, d_model, the experts' width
    assert (gmm["name"], gmm["flops"], gmm["tiling"]) == (
        "pallas_tpu_ragged_dot_gmm", 2.0 * m * k * n, (128, 4096, 768),
    )  # fmt: skip
    assert (tgmm["name"], tgmm["flops"], tgmm["tiling"]) == (
        "pallas_tpu_ragged_dot_tgmm", 2.0 * m * k * n, (1024, 128, 4096),
    )  # fmt: skip
    # Whole tiles over 128 experts: 4096 + 127 row tiles of 128 rows (the kernel's own group
    # metadata holds 4223 entries).
    assert grouped_matmul_flops(gmm, 128) == 2.0 * (m // 128 + 127) * 128 * k * n


def test_a_two_slice_program_reduces_every_gradient_over_the_data_center_network():
    """MaxText's program for two slices (tpu7x:2x2x1x2, dcn_data_parallelism 2) all-reduces
    each device's shard of every gradient between the slices, as libtpu's megascale sends: the
    step model prices them over the chip's DCN bandwidth (100 Gb/s, a device's half), apart
    from ICI, and the program's collectives list them."""
    import dataclasses

    from trainer.compile.cost import program_cost
    from trainer.compile.step_model import step_time
    from trainer.estimate.analytic import parameter_count
    from trainer.program.hlo import count_collectives
    from trainer.trial.config import load_config
    from trainer.trial.hardware import ACCELERATORS

    hlo = hlo_excerpt("maxtext_0.2.5/two_slices.hlo.gz")
    cost = program_cost(hlo)
    config = load_config({"model": {"preset": "llama3-8b", "num_layers": 2}, "seq_len": 2048})
    shard = parameter_count(config) * 2 / 8  # bf16 gradients, FSDP over a slice's 8 devices
    (between,) = cost["dcn_ops"]
    assert (between["kind"], between["group"]) == ("all-reduce", 2)
    assert between["bytes"] == pytest.approx(shard, rel=1e-4)
    assert all(op["group"] <= 8 for op in cost["collective_ops"])  # ICI: within a slice
    tpu7x = ACCELERATORS["tpu7x"]
    step = step_time(cost, tpu7x)
    # A ring over 2 slices sends each byte once, at 12.5 GB/s per chip, 2 devices per chip.
    assert step["est_dcn_s"] == pytest.approx(between["bytes"] / (100e9 / 8 / 2))
    assert step["bound"] == "dcn"
    # The schedule waits for the sends: without DCN time the step is shorter by most of it.
    free = step_time(cost, dataclasses.replace(tpu7x, dcn_bytes_per_s_per_chip=1e18))
    assert step["est_step_time_s"] - free["est_step_time_s"] > 0.5 * step["est_dcn_s"]
    assert count_collectives(hlo)["dcn all-reduce"] == 20


def test_maxtext_knobs_are_judged_by_the_programs_their_trials_compile_to():
    """MaxText takes a setting as set: a trial says its knobs are unjudged, and the sweep
    judges each by its compiled trials (two that differ in that knob only: one program,
    inert between those values; two programs, active). Failed trials and trials that differ
    in two knobs judge nothing; a sweep of our trainer is judged per trial instead."""
    import pandas as pd

    from sweeper.answer.notes import program_verdicts
    from trainer.maxtext.driver import _effects

    assert _effects({"maxtext.scan_layers": True})["maxtext.scan_layers"].status == "unjudged"
    rows = [  # trial, status, program, knob values
        ("a", "ok", "p1", 1, "x"),
        ("b", "ok", "p1", 2, "x"),  # a/b: only maxtext.log_period differs, same program
        ("c", "ok", "p2", 1, "y"),  # a/c: only per_device_batch differs, another program
        ("d", "error", None, 2, "y"),  # failed: no program
        ("e", "ok", "p3", 3, "z"),  # differs from every other in two knobs
    ]
    frame = pd.DataFrame(
        [{"trial_id": t, "status": s, "program_fingerprint": f, "program": "maxtext",
          "knob:maxtext.log_period": lp, "knob:per_device_batch": b} for t, s, f, lp, b in rows]
    )  # fmt: skip
    assert program_verdicts(frame) == [
        "maxtext.log_period 1 vs 2: inert (the same MaxText program: trials a/b)",
        "per_device_batch x vs y: active (changes MaxText's program: trials a/c)",
    ]
    assert program_verdicts(frame.assign(program="sweeper-trainer")) == []


needs_maxtext = pytest.mark.skipif(
    not os.access(MAXTEXT, os.X_OK), reason="no MaxText environment (make maxtext)"
)


@pytest.mark.slow
@needs_maxtext
def test_a_local_sweep_runs_maxtexts_train_and_records_tokens_from_its_own_log(tmp_path):
    from sweeper.sweep.run import run_sweep

    result = run_sweep(str(SPACES / "smoke_maxtext.yaml"), results_dir=tmp_path, trials=2,
                       set={"search.remeasure": 0})  # fmt: skip
    assert result.counts == {"total": 2, "ok": 2}
    frame = result.trials
    assert set(frame["program"]) == {"maxtext"} and set(frame["fidelity"]) == {"run"}
    assert frame["hardware"].str.contains("via MaxText").all()
    # Each trial's tokens/s per device is the median of MaxText's own step lines in its log,
    # its warm-up steps skipped (measure.skip_steps, 2).
    medians = set()
    for log in tmp_path.rglob("trainer.log"):
        steps = [s for s in map(logs.step_line, log.read_text().splitlines()) if s]
        medians.add(round(statistics.median(s.tokens_per_device for s in steps[2:]), 3))
    assert {round(v, 3) for v in frame["tokens_per_sec_per_device"]} == medians
    # With the noise figures our trainer's runs carry: the median step's 95% interval.
    assert (frame["tokens_per_sec_per_chip_low"] <= frame["tokens_per_sec_per_chip"]).all()
    assert (frame["tokens_per_sec_per_chip"] <= frame["tokens_per_sec_per_chip_high"]).all()
    assert (frame["tokens_per_sec_per_chip_low"] < frame["tokens_per_sec_per_chip_high"]).all()
    assert set(frame["timing_windows"]) == {3}
    # The export of its best trial is the command that reruns it, maxtext.* knobs included.
    best = frame.loc[frame["trial_id"] == result.best.trial_id].iloc[0]
    exported = CliRunner().invoke(
        app, ["export", result.sweep_id, "--results-dir", str(tmp_path), "--format", "maxtext"]
    )
    assert exported.exit_code == 0, exported.output
    assert f"scan_layers={str(best['knob:maxtext.scan_layers']).lower()}" in exported.output


@pytest.mark.slow
@needs_maxtext
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_maxtext_compiles_a_trial_for_tpu7x_and_its_program_is_read(tmp_path, preset):
    """A MoE model runs its experts in tokamax's grouped matmuls, which refuse a CPU host unless
    told they are cross-compiled (every qwen3 trial was `compile_error` before), in a decoder
    block with routed experts (MaxText's default block made it a dense model). tokamax takes
    no dim under 128: tiny-moe at d_model 256."""
    import subprocess
    import sys

    from trainer.trial.events import parse_event, parse_line

    trial = {"seq_len": 512, "per_device_batch": 1}
    if preset == "tiny-moe":
        trial["kernels"] = {"moe_gmm": "tokamax"}
    model: dict = {"preset": preset}
    if preset == "tiny-moe":
        model.update(d_model=256, mlp_dim=256, num_heads=2, num_kv_heads=2, head_dim=128)
    space = load_space(
        {"name": "t", "target": "tpu7x:2x2x1", "fidelity": "compile", "program": "maxtext",
         "model": model, "trial": trial}
    )  # fmt: skip
    path = tmp_path / "trial.json"
    path.write_text(static_check(space, {}).to_json())
    [flag, request] = program_of(space).args(space, {})
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(path), flag, request],
        capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = {e.event: e for e in map(parse_event, proc.stdout.splitlines()) if e}
    assert events["accepted"].program == "maxtext" and events["accepted"].target == "tpu7x:2x2x1"
    summary = events["summary"]
    # The memory is MaxText's own compile's, as its memory analysis printed it.
    assert summary.memory_per_device == logs.memory_analysis(proc.stdout)
    assert summary.fits and summary.fidelity == "compile"
    # Its optimized HLO was read: FSDP over 8 devices gathers weights, and the step model
    # priced the program's work.
    assert summary.collectives["all-gather"] > 0
    assert summary.est_step_time_s > 0 and summary.est_model == "hlo"
    if preset == "tiny-moe":  # the experts are tokamax's TPU kernels in the program
        names = {c["name"] for c in summary.program_cost["kernel_calls"]}
        assert any(n.startswith(("pallas_tpu_ragged_dot", "gmm", "tgmm")) for n in names), names
    assert not [
        line
        for line in proc.stdout.splitlines()
        if parse_line(line) is None and line.startswith("{")
    ]


if __name__ == "__main__":  # the settings the kept logs were made with
    space = load_space(SPACES / "smoke_maxtext.yaml")
    print(
        " ".join(
            program_settings(static_check(space, {}), space.maxtext_program(), {}, "cpu").argv()
        )
    )


def test_a_trials_profile_is_maxtexts_profiler_and_its_traces_are_kept(tmp_path):
    """trial.profile is MaxText's xplane profiler over the same steps, and the traces MaxText
    writes under its (temporary) output folder are copied to the trial's profile folder
    (issue 48, item 7: they were deleted with the folder)."""
    from trainer.maxtext.driver import keep_traces
    from trainer.trial.config import load_config
    from trainer.trial.maxtext import to_maxtext

    config = load_config(
        {"model": {"preset": "tiny-dense"}, "profile": {"start_step": 3, "steps": 2}}
    )
    args = to_maxtext(config).args
    assert (args["profiler"], args["skip_first_n_steps_for_profiler"], args["profiler_steps"]) == (
        "xplane",
        "3",
        "2",
    )
    work = tmp_path / "work" / "sweeper" / "tensorboard" / "plugins" / "profile" / "2026_12_05"
    work.mkdir(parents=True)
    (work / "host.xplane.pb").write_bytes(b"trace")
    kept = keep_traces(tmp_path / "work", tmp_path / "profile")
    assert [p.relative_to(tmp_path) for p in kept] == [
        Path("profile/plugins/profile/2026_12_05/host.xplane.pb")
    ]


@pytest.mark.slow
@needs_maxtext
def test_a_maxtext_run_keeps_its_profile_in_the_trials_folder(tmp_path):
    from sweeper.sweep.run import run_sweep

    result = run_sweep(str(SPACES / "smoke_maxtext.yaml"), results_dir=tmp_path, trials=1,
                       set={"search.remeasure": 0, "trial.profile.start_step": 3})  # fmt: skip
    assert result.counts == {"total": 1, "ok": 1}
    traces = list(tmp_path.rglob("profile/plugins/profile/*/*.xplane.pb"))
    assert traces, sorted(str(p) for p in tmp_path.rglob("*profile*"))


@pytest.mark.slow
@needs_maxtext
def test_a_models_flops_are_maxtexts_own_count_where_the_shape_alone_misses_some():
    """The MFU of a MaxText trial divides by the model's FLOPs as MaxText counts them (its
    maxtext_utils): for llama3.1-70b the engine's count of the shape is the same figure; for
    gemma4-26b (a shared expert, sliding windows, ...) the shape alone is 3% short."""
    from trainer.estimate.analytic import estimate
    from trainer.maxtext.driver import maxtext_tflops
    from trainer.trial.config import load_config
    from trainer.trial.hardware import Topology

    configs = Path(MAXTEXT).parent.parent.glob("lib/python3*/site-packages/maxtext/configs")
    base = str(next(configs) / "base.yml")
    topology = Topology.parse("tpu7x:4x4x4")
    common = ["max_target_length=8192", "compile_topology=tpu7x-128", "dataset_type=synthetic"]
    theirs = {
        name: maxtext_tflops(str(MAXTEXT), [base, f"model_name={name}", f"per_device_batch_size={b}", *common])
        for name, b in (("llama3.1-70b", 2), ("gemma4-26b", 4))
    }  # fmt: skip
    llama = load_config(
        {"model": {"preset": "llama3.1-70b"}, "seq_len": 8192, "per_device_batch": 2}
    )
    ours = estimate(llama, topology.accelerator, topology.devices)["model_flops_per_step"]
    assert ours / topology.devices / 1e12 == pytest.approx(theirs["llama3.1-70b"], rel=1e-3)
    gemma = {"d_model": 2816, "num_layers": 30, "num_heads": 16, "num_kv_heads": 8, "head_dim": 256,
             "mlp_dim": 704, "vocab_size": 262144, "num_experts": 128, "experts_per_token": 8}  # fmt: skip
    shape = load_config({"model": gemma, "seq_len": 8192, "per_device_batch": 4})
    ours = estimate(shape, topology.accelerator, topology.devices)["model_flops_per_step"]
    assert theirs["gemma4-26b"] > ours / topology.devices / 1e12 * 1.02


def test_a_local_target_on_an_accelerator_reads_this_hosts_devices():
    """`target: local` runs MaxText on the chips JAX finds here (the lent v5e's run failed on
    "unknown accelerator 'local'"): read by a child process, which holds no chip when MaxText
    starts. On this CPU host JAX finds no TPU, and the trial says so by its target."""
    from trainer.maxtext.driver import _devices
    from trainer.trial.config import ConfigError, TrialConfig

    config = TrialConfig.model_validate({"model": {"preset": "tiny-dense"}, "backend": "tpu"})
    with pytest.raises(
        ConfigError, match=r"target: MaxText trials run on TPUs; JAX here finds \d+ cpu"
    ):
        _devices(config, "local", cpu=False)
    assert _devices(config, "v5e:2x2", cpu=False).devices == 4  # a named slice needs no probe
