"""`sweeper plan`: advice its own estimate and the trainer accept, on the published workloads."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from benchmarks.plan_against_screen import WORKLOADS as PUBLISHED
from benchmarks.plan_against_screen import compare
from sweeper.cli.app import app
from sweeper.search.plan import space_for
from sweeper.space.load import load_space
from sweeper.space.points import assemble
from trainer.estimate.analytic import estimate, memory_per_device
from trainer.estimate.plan import HEADROOM, candidates, recommend
from trainer.trial.checks import check_static, global_batch_size
from trainer.trial.config import load_config
from trainer.trial.hardware import GIB, Topology

# The published Ironwood workloads (tpu-recipes) on their topologies.
WORKLOADS = {name: w[:3] for name, w in PUBLISHED.items()}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_advice_fits_by_its_own_estimate_and_the_trainer_takes_it(name):
    preset, seq, target = WORKLOADS[name]
    rec = recommend({"preset": preset}, seq, target)
    topology = Topology.parse(target)
    config = load_config({"model": {"preset": preset}, "seq_len": seq, **rec.best.trial()})
    check_static(config, topology.devices, "tpu")  # the trainer's own checks: raises if refused
    assert set(rec.mesh) <= {"fsdp", "tensor", "expert", "context"}  # no axis it lacks
    est = estimate(config, topology.accelerator, topology.devices)
    usable = topology.accelerator.usable_hbm_per_device
    assert est["fits"] and est["est_memory_per_device"]["total"] <= (1 - HEADROOM) * usable
    assert est["est_memory_per_device"]["host_activations"] <= 94.5 * GIB
    assert all("estimate" in r for r in rec.reasons[:2])
    # The fastest candidate that fits is the one advised, whatever its context degree.
    everything = candidates({"preset": preset}, seq, target)
    assert rec.best.tokens == max(c.tokens for c in everything)
    if seq < 32768:
        assert rec.best.mesh["context"] == 1
    # FP8 is estimated before it is advised, and so is the other side of each axis.
    assert any(r.startswith("fp8: ") for r in rec.reasons)
    if config.model.is_moe:
        assert any("expert parallelism" in r for r in rec.reasons)


def _recipe_128k():
    """The published 70B 128k recipe: FSDP x context 8, batch 0.125, its custom placements."""
    return load_config({
        "model": {"preset": "llama3.1-70b"}, "seq_len": 131072, "per_device_batch": 0.125,
        "mesh": {"fsdp": -1, "context": 8}, "vocab_tiling": 4,
        "remat": {"policy": "custom", "custom": dict.fromkeys(
            ("decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "mlpwo"),
            "device")},
    })  # fmt: skip


def test_the_published_long_context_recipe_fits_where_the_old_plan_said_it_did_not():
    """The 70B 128k recipe (FSDP x context 8, batch 0.125, its custom placements): the old
    estimate said 189 GiB; MaxText compiles it to 78.7 GiB per device."""
    recipe = _recipe_128k()
    degrees = check_static(recipe, 512, "tpu")
    memory = memory_per_device(recipe, degrees, global_batch_size(recipe, 512))
    assert memory["total"] / GIB == pytest.approx(78.7, rel=0.10)


def test_memory_follows_the_placements_a_custom_policy_names():
    base = {"model": {"preset": "llama3.1-70b"}, "seq_len": 8192, "per_device_batch": 2}

    def memory(custom):
        config = load_config({**base, "remat": {"policy": "custom", "custom": custom}})
        return memory_per_device(config, check_static(config, 128, "tpu"), 256)

    boundary = memory({})
    kept = memory({"context": "device"})
    moved = memory({"context": "offload"})
    context = 16384 * 64 * 128 * 2 * 80  # tokens x heads x head_dim x bf16 x layers
    assert kept["activations"] - boundary["activations"] == pytest.approx(context)
    assert moved["activations"] == boundary["activations"]
    assert moved["host_activations"] - boundary["host_activations"] == pytest.approx(context)
    offload_input = memory({"decoder_layer_input": "offload"})
    assert offload_input["activations"] == 0 and offload_input["host_activations"] > 0


def test_the_intensity_line_and_the_bound_use_one_ridge():
    """ICI-bound exactly when the FLOPs per link byte fall below the hardware's figure."""
    seen = set()
    for tensor in (1, 2, 4, 8, 16):
        for batch in (1 / tensor, 4 / tensor, 16 / tensor):
            config = load_config({"model": {"preset": "llama3.1-70b"}, "seq_len": 8192,
                                  "per_device_batch": batch, "mesh": {"fsdp": -1, "tensor": tensor}})  # fmt: skip
            est = estimate(config, Topology.parse("tpu7x:4x4x4").accelerator, 128)
            below = est["arithmetic_intensity_ici"] < est["hardware_intensity_ici"]
            assert below == (est["est_ici_s"] > est["est_compute_s"]), (tensor, batch)
            seen.add(below)
    assert seen == {True, False}  # both sides of the ridge were tried


def test_plan_writes_a_space_whose_trial_0_is_the_advice(tmp_path):
    path = tmp_path / "plan.yaml"
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "mixtral-8x7b",
            "--seq",
            "4096",
            "--target",
            "tpu7x:4x4x4",
            "--space",
            str(path),
        ],
    )
    assert result.exit_code == 0, result.output
    space = load_space(str(path))
    rec = recommend({"preset": "mixtral-8x7b"}, 4096, "tpu7x:4x4x4")
    trial = load_config(assemble(space, space.search.warm_start[0]))
    want = load_config({"model": {"preset": "mixtral-8x7b"}, "seq_len": 4096, **rec.best.trial()})
    for key in ("per_device_batch", "remat", "precision"):
        assert getattr(trial, key) == getattr(want, key), key
    assert trial.mesh.resolve(128) == want.mesh.resolve(128)
    assert len(space.knobs) > 1  # it sweeps around the advice
    assert yaml.safe_load(yaml.safe_dump(space.model_dump())) is not None


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_written_space_validates_and_its_first_trials_are_the_advice(name, tmp_path):
    """Trial 0 is the bf16 advice and trial 1 the fastest fp8 candidate, each assembled by
    the engine into the trainer's config (custom placements included)."""
    preset, seq, target = WORKLOADS[name]
    rec = recommend({"preset": preset}, seq, target)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(space_for(rec, {"preset": preset}, seq, target, "p"),
                                   sort_keys=False))  # fmt: skip
    space = load_space(str(path))
    assert rec.fp8 is not None
    for point, candidate, precision in zip(
        space.search.warm_start, (rec.best, rec.fp8), ("bf16", "fp8"), strict=True
    ):
        got = load_config(assemble(space, point))
        want = load_config({"model": {"preset": preset}, "seq_len": seq,
                            "precision": {"mode": precision}, **candidate.trial()})  # fmt: skip
        for key in ("per_device_batch", "remat", "precision", "vocab_tiling", "kernels"):
            assert getattr(got, key) == getattr(want, key), (key, precision)
        assert got.mesh.resolve(Topology.parse(target).devices) == want.mesh.resolve(
            Topology.parse(target).devices
        )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_screen_finds_nothing_faster_than_the_advice_in_the_space_plan_writes(name):
    """Each precision's best point `screen` finds in the written space is the plan's advice
    (bf16) or its fastest fp8 candidate: the space holds only candidates the plan estimated."""
    got = compare(name)
    assert got.written_bf16 == pytest.approx(got.rec.best.tokens, rel=1e-9)
    assert got.rec.fp8 is not None
    assert got.written_fp8 == pytest.approx(got.rec.fp8.tokens, rel=1e-9)
    if got.shipped_bf16 is not None:  # the recipe's own space holds nothing faster either
        assert got.shipped_bf16 <= got.rec.best.tokens * (1 + 1e-9), name


def test_the_long_context_advice_searches_context_degrees_and_fractional_batches():
    """The 70B 128k workload: what the old plan missed (it advised context 2, batch 0.5, 647
    tokens/s/chip) is searched, and the advice beats the published recipe's point."""
    rec = recommend({"preset": "llama3.1-70b"}, 131072, "tpu7x:4x8x8")
    everything = candidates({"preset": "llama3.1-70b"}, 131072, "tpu7x:4x8x8")
    assert {c.mesh["context"] for c in everything} >= {8, 16, 32, 64}
    assert min(c.per_device_batch for c in everything) == 0.125
    assert rec.best.per_device_batch < 1 and rec.best.mesh["context"] >= 8
    published = estimate(_recipe_128k(), Topology.parse("tpu7x:4x8x8").accelerator, 512)
    assert rec.best.tokens > published["est_tokens_per_sec_per_chip"] > 647
    # The ridge is the hardware's: one per target and precision, whatever the model.
    qwen = recommend({"preset": "qwen3-235b-a22b"}, 4096, "tpu7x:4x8x8")
    key = "hardware_intensity_ici"
    assert rec.figures[key] == qwen.figures[key]


def test_a_space_plan_cannot_validate_is_refused_and_not_written(tmp_path, monkeypatch):
    import sweeper.search.plan as plan_module

    written = plan_module.space_for

    def broken(*args):
        space = written(*args)
        space["knobs"]["remat.policy"] = {"values": ["no_such_policy"]}
        return space

    monkeypatch.setattr(plan_module, "space_for", broken)
    path = tmp_path / "q.yaml"
    result = CliRunner().invoke(
        app, ["plan", "--model", "mixtral-8x7b", "--seq", "4096", "--space", str(path)]
    )
    assert result.exit_code == 2, result.output
    assert "--space" in result.output and "nothing was written" in result.output
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert "Traceback" not in result.output


def test_an_unknown_target_is_a_clear_exit_2():
    result = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--target", "tpu9:2x2"])
    assert result.exit_code == 2 and "tpu9" in result.output


@pytest.mark.tpu_compile
@pytest.mark.slow  # 50 s; plan's advice: its estimate tests, by default
def test_plan_compile_holds_the_advice_against_the_compiler():
    result = CliRunner().invoke(
        app,
        ["plan", "--model", "tiny-dense", "--seq", "1024", "--target", "tpu7x:2x2x1", "--compile"],
    )
    assert result.exit_code == 0, result.output
    assert "compile: " in result.output and "fits: True" in result.output


@pytest.mark.parametrize(
    "name",
    [
        "llama3.1-70b 8k trial 0",
        "llama3.1-405b 8k trial 0",
        "qwen3-235b-a22b 4k trial 0",
    ],
)
def test_the_memory_estimate_is_within_10_percent_of_the_recipes_compiles(name):
    """Trial 0 of each published-recipe space (the recipe) against the installed libtpu's
    compile of it, as recorded (benchmarks/memory_model.py compiles them again; minutes each)."""
    from benchmarks.memory_model import compiled_gib, estimate_gib, rows

    config, target, _ = rows()[name]
    got = compiled_gib(name)
    assert got is not None, f"{name}: no record by the installed compiler"
    assert estimate_gib(config, target) == pytest.approx(got, rel=0.10), name


MOE_MEMORY = pytest.param("search_table_moe", marks=pytest.mark.xfail(strict=True, reason=(
    "held out, the first MoE table (16 experts, top 4): the memory estimate reads every point "
    "high, median +22%, max +32% (4 of 36 verdicts overturned, all said over budget and fit); "
    "not refitted on it: docs/trainer.md")))  # fmt: skip
MOE_STEP = pytest.param("search_table_moe", marks=pytest.mark.xfail(strict=True, reason=(
    "held out, the first MoE table: the screen ranks it like the compile (Spearman +0.88) but "
    "reads it 5.1% off at the median (10% before the kernels' own efficiencies), up to 30% "
    "under tensor 2, where the compile exposes 7-11 ms of a 13-30 ms step and the screen 3-7: "
    "docs/trainer.md")))  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        *["search_table", "search_table_b", "search_table_c", "search_table_d", "search_table_e"],
        MOE_MEMORY,
    ],
)
def test_the_memory_estimate_reads_each_compiled_search_table_near_the_compiler(name):
    """Every point of a search table compiled by libtpu (fitted on: search_table and
    search_table_b; held out: search_table_c, search_table_d and search_table_e, against the
    screen committed before its compile): median |error| within 10%, none beyond 20%
    (benchmarks/memory_model.py)."""
    from benchmarks.memory_model import FIT_TABLES, table_errors

    errors = table_errors(name, frozen_screen=name not in FIT_TABLES)
    if errors is None:
        pytest.skip(f"{name} is not compiled yet")
    assert len(errors) == 36
    assert sorted(errors)[len(errors) // 2] <= 0.10 and max(errors) <= 0.20, name


@pytest.mark.parametrize(
    "name",
    [
        *["search_table", "search_table_b", "search_table_c", "search_table_d", "search_table_e"],
        MOE_STEP,
    ],
)
def test_the_screen_reads_each_compiled_search_table_near_the_step_model(name):
    """The screen's est. tokens/s against the step model read from each compiled program of a
    search table (benchmarks/step_estimate.py; fitted on the first three, search_table_d and
    search_table_e held out and read against their committed screens): median |error|
    within 5%, none beyond 15%, and ranked the same way more often than not (Spearman above
    0.4; the earlier screen: +0.00, +0.62 and +0.09 on the first three)."""
    from benchmarks.step_estimate import HELD_OUT, committed_screen, points, summary

    frame = points(name)
    got = summary(frame, committed_screen(name, frame) if name in HELD_OUT else frame["screen"])
    assert got["points"] >= 24
    assert got["median |error|"] <= 0.05 and got["max |error|"] <= 0.15, got
    assert got["spearman"] > 0.4, got


def test_the_screens_moe_routing_moves_what_the_compiled_recipe_gathers():
    """The screen's MoE routing (`routing_bytes`) against the compiled qwen3-235b-a22b 4k bf16
    recipe (libtpu 0.0.52, kept in results/calibration/): the bytes of its SparseCore gathers
    a step (each token's row per expert, there and back, forward, recompute and backward),
    within 1%; a policy that keeps the experts' inputs and outputs gathers a third less.
    Timed at the SparseCores' rate, the routing brings both qwen3 rows within 10% of the
    published figures (were +18% and +31% without it; these rows were seen before)."""
    import gzip

    from benchmarks.calibration import hlo_path, recipe
    from benchmarks.step_estimate import published
    from trainer.compile.cost import program_cost
    from trainer.estimate.analytic import recomputed, routed_rows, routing_bytes

    name = "qwen3-235b-a22b 4k bf16 256 chips"
    config, target = recipe(name)
    config = load_config({**config, "compile_target": target})
    topology = Topology.parse(target)
    degrees = check_static(config, topology.devices)
    tokens = global_batch_size(config, topology.devices) * config.seq_len
    rows = routed_rows(config, degrees, tokens / topology.devices)
    screen = routing_bytes(config, recomputed(config), rows)

    cost = program_cost(gzip.decompress(hlo_path(name).read_bytes()).decode())
    schedule, gathered = cost["schedule"], 0.0

    def walk(computation: str, times: float) -> None:
        nonlocal gathered
        for event in schedule["computations"].get(computation, []):
            if event["op"] == "loop":
                walk(event["body"], times * event["trips"])
            elif event["op"] == "call":
                walk(event["callee"], times)
            elif event["op"] == "start" and event["name"].startswith("gather_offload"):
                gathered += times * event["work"]["hbm"]

    walk(schedule["entry"], 1.0)
    assert screen == pytest.approx(gathered, rel=0.01)
    kept = {"mlpwi_0": "device", "mlpwi_1": "device", "mlpwo": "device"}
    saving = config.model_copy(update={"remat": config.remat.model_copy(
        update={"custom": {**config.remat.custom, **kept}})})  # fmt: skip
    assert routing_bytes(saving, recomputed(saving), rows) == pytest.approx(screen * 4 / 6)
    errors = published().set_index("row")["error"]
    for precision in ("bf16", "fp8"):
        assert abs(errors[f"qwen3-235b-a22b 4k {precision} 256 chips"]) < 0.10, precision


def test_the_screen_ranks_the_held_out_moe_table_and_the_ladder_finds_its_best_first():
    """search_table_moe (16 experts, top 4, tokamax; its screen committed before any point was
    compiled, the screen's MoE terms shaped on the qwen3 rows only): the committed screen, and
    today's, rank its 26 fitting points like the compile (Spearman above 0.8; +0.88), and the
    ladder reaches within 2% of the table's best with its first compile, on every seed
    (random: 13.7)."""
    from benchmarks.search_efficiency import measure
    from benchmarks.step_estimate import committed_screen, points, summary

    frame = points("search_table_moe")
    for screen in (committed_screen("search_table_moe", frame), frame["screen"]):  # and today's
        got = summary(frame, screen)
        assert got["points"] == 26 and got["spearman"] > 0.8, got
    replay = measure(10, 0.02, "search_table_moe", searches=("ladder", "random"))
    assert replay.set_index("search")["vs_random"]["ladder"] <= 0.3, replay
