"""Space schema, YAML errors, the Optuna converter, conditional knobs, inert pinning (no Ray)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.distributions import IntDistribution

from sweeper.search.distributions import DefineByRun, from_distribution, to_distribution
from sweeper.search.outcomes import constraint_vector, outcome
from sweeper.space.errors import SpaceError
from sweeper.space.inert import pin_inert
from sweeper.space.load import load_space, resolve_path
from sweeper.space.points import assemble, count_points, in_words, points
from sweeper.space.schema import Knob
from tests.helpers import unfolded

GOOD = """\
name: t
model: {preset: tiny-dense}
trial: {seq_len: 64, steps: 4, backend: cpu}
knobs:
  mesh.tensor: {values: [1, 2]}
  remat.policy: {values: [full, custom]}
  remat.custom.context: {values: [device, remat], when: {remat.policy: custom}}
  per_device_batch: {low: 1, high: 3}
"""


def _write(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_builtin_spaces_resolve_by_name_and_by_spaces_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any directory
    assert resolve_path("moe_short") == resolve_path("spaces/moe_short.yaml")
    assert load_space("spaces/moe_short.yaml").name == "moe_short"
    assert load_space("smoke").name == "smoke"


@pytest.mark.parametrize(
    ("text", "line", "field", "fragment"),
    [
        (GOOD.replace("name: t", "name: t\nsampler: tpe"), 2, "sampler", "unknown key"),
        (
            GOOD.replace("[full, custom]", "[full, sideways]"),
            6,
            "knobs.remat.policy",
            "invalid trial",
        ),
        (
            GOOD.replace("trial: {seq_len: 64", "trial: {seq_len: 1"),
            3,
            "trial.seq_len",
            "greater than or equal",
        ),
        (
            GOOD.replace("{preset: tiny-dense}", "{preset: tiny-dense, num_heads: 3}"),
            2,
            "model",
            "num_kv_heads",
        ),
        (GOOD + "search: {trials: 0}\n", 9, "search.trials", "greater than 0"),
        (
            GOOD.replace("when: {remat.policy: custom}", "when: {remat.polcy: custom}"),
            7,
            "knobs.remat.custom.context.when",
            "not a knob",
        ),
        ("name: t\nmodel: {preset: tiny-dense\n", 3, None, "not valid YAML"),
    ],
)
def test_bad_yaml_names_file_line_and_field(tmp_path, text, line, field, fragment):
    path = _write(tmp_path, text)
    with pytest.raises(SpaceError) as err:
        load_space(path)
    assert err.value.file == str(path)
    assert err.value.line == line
    assert err.value.field == field
    assert fragment in str(err.value)


def test_cli_validate_exits_2_with_location(tmp_path):
    path = _write(tmp_path, GOOD.replace("[full, custom]", "[full, sideways]"))
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper.cli", "validate", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"{path}:6" in unfolded(proc.stderr) and "knobs.remat.policy" in proc.stderr


def test_count_points_respects_conditions_and_inclusive_int_bounds(tmp_path):
    space = load_space(_write(tmp_path, GOOD))
    # tensor(2) x [full + custom x context(2)] x batch(1..3 inclusive = 3)
    assert count_points(space) == 2 * (1 + 2) * 3


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_count_points_counts_what_walking_every_point_finds(tmp_path_factory, data):
    """The count is made without walking the points (a recipe's space holds millions): on
    spaces whose knobs are conditioned on earlier ones, it is the number of distinct points
    that walking them all finds."""
    base = load_space(_write(tmp_path_factory.mktemp("space"), GOOD))
    knobs: dict[str, Knob] = {}
    for i in range(data.draw(st.integers(1, 6))):
        values = list(range(data.draw(st.integers(1, 3))))
        when = {}
        if knobs and data.draw(st.booleans()):
            on = data.draw(st.sampled_from(sorted(knobs)))
            given = knobs[on].values or [0]
            when = {on: data.draw(st.sampled_from([given[0], given[:2]]))}
        knobs[f"k{i}"] = Knob(values=values, when=when)
    space = base.model_copy(update={"knobs": knobs})
    walked = {in_words(p) for p in points(space, limit=10**6)}
    assert count_points(space) == len(walked)


@pytest.mark.parametrize(
    "knob",
    [
        Knob(values=["a", 1, None]),
        Knob(low=1, high=4),
        Knob(low=2, high=64, log=True, type="int"),
        Knob(low=0, high=12, step=4),
        Knob(low=1e-4, high=1e-2, log=True),
        Knob(low=0.0, high=1.0, step=0.25),
    ],
)
def test_knob_distribution_round_trip(knob):
    dist = to_distribution(knob)
    back = from_distribution(dist)
    assert to_distribution(back) == dist
    assert back.candidates() == knob.candidates()


def test_int_upper_bound_is_sampled():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {study.ask({"x": IntDistribution(1, 4)}).params["x"] for _ in range(200)}
    assert seen == {1, 2, 3, 4} == set(Knob(low=1, high=4).candidates())


def test_conditional_knobs_only_asked_when_active(tmp_path):
    space = load_space(_write(tmp_path, GOOD))
    define = DefineByRun(space)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(40):
        trial = study.ask()
        define(trial)
        params = trial.params
        assert ("remat.custom.context" in params) == (params["remat.policy"] == "custom")
        config = assemble(space, params)
        assert config["mesh"]["tensor"] == params["mesh.tensor"]
        study.tell(trial, 1.0)


def test_offload_values_pinned_on_cpu():
    space = load_space("moe_short")
    pinned, notes = pin_inert(space)
    assert "minimal_offloaded" in space.knobs["remat.policy"].values
    assert "minimal_offloaded" not in pinned.knobs["remat.policy"].values
    assert pinned.knobs["remat.custom.context"].values == ["device", "remat"]
    assert len(notes) == 2 and all("inert on cpu" in n for n in notes)


def test_trial_outcomes_map_to_search_semantics():
    from trainer.trial.result import Convergence, TrialResult

    assert outcome(TrialResult(status="ok"), False) == "ok"
    for cls in ("invalid_config", "oom_hbm", "oom_vmem", "diverged"):
        assert outcome(TrialResult.failed(cls, ""), False) == "infeasible"
    for cls in ("crashed", "timeout", "compile_error"):
        assert outcome(TrialResult.failed(cls, ""), False) == "failed"
    assert outcome(None, False, reported=True) == "pruned"  # stopped by the scheduler
    assert outcome(None, True) == "failed"
    assert outcome(None, False, reported=False) == "failed"
    oom = TrialResult.failed("oom_hbm", "", needed_gib=3.0, budget_gib=2.0)
    assert constraint_vector(oom) == [0.0, 0.5, 0.0]
    converged = Convergence(passed=True, relative_delta=0.01, tolerance=0.05)
    feasible = constraint_vector(TrialResult(status="ok", convergence=converged))
    assert feasible[2] == pytest.approx(-0.04) and max(feasible) <= 0


def test_kernel_and_fp8_knobs_pinned_on_cpu(tmp_path):
    extra = (
        "  precision.mode: {values: [bf16, fp8]}\n"
        "  kernels.attention: {values: [xla, splash]}\n"
        "  kernels.block_q: {values: [128, 256]}\n"
    )
    space = load_space(_write(tmp_path, GOOD + extra))
    pinned, notes = pin_inert(space)
    assert space.knobs["precision.mode"].values == ["bf16", "fp8"]
    assert pinned.knobs["precision.mode"].values == ["bf16"]
    assert pinned.knobs["kernels.attention"].values == ["xla"]
    assert pinned.knobs["kernels.block_q"].values == [128]
    assert len(notes) == 3 and "emulation" in notes[0]


def test_pinning_follows_the_backend_trials_run_on(tmp_path):
    extra = (
        "  precision.mode: {values: [bf16, fp8]}\n"
        "  kernels.attention: {values: [xla, splash]}\n"
        "  xla.scoped_vmem_kib: {values: [65536, 98304]}\n"
    )
    text = GOOD.replace("[device, remat]", "[device, remat, offload]") + extra
    space = load_space(_write(tmp_path, text))
    # A TPU runs every value for real: nothing is pinned.
    on_tpu, notes = pin_inert(space, "tpu")
    assert on_tpu.knobs == space.knobs and notes == []
    # A GPU has fp8 units and host offload, but neither Pallas TPU kernels nor LIBTPU flags.
    on_gpu, notes = pin_inert(space, "gpu")
    assert on_gpu.knobs["precision.mode"].values == ["bf16", "fp8"]
    assert on_gpu.knobs["remat.custom.context"].values == ["device", "remat", "offload"]
    assert on_gpu.knobs["kernels.attention"].values == ["xla"]
    assert on_gpu.knobs["xla.scoped_vmem_kib"].values == [65536]
    assert all("on gpu" in n for n in notes) and len(notes) == 2
    on_cpu, _ = pin_inert(space, "cpu")
    assert on_cpu.knobs["precision.mode"].values == ["bf16"]
    assert on_cpu.knobs["remat.custom.context"].values == ["device", "remat"]


def test_a_layer_input_placed_remat_is_its_device_twin_on_every_backend(tmp_path):
    """The layer's input is its checkpoint's input, kept on device placed `remat` (compiled:
    tests/test_compile_memory.py): a trial there would compile `device` again, on a TPU too,
    so `remat` is pinned to `device`, a warm start's with it; where host offload is dropped,
    `offload` is `device` too."""
    text = GOOD.replace("trial: {seq_len: 64, steps: 4, backend: cpu}", "trial: {seq_len: 64}")
    text += (
        "  remat.custom.decoder_layer_input:\n"
        "    values: [remat, device, offload]\n"
        "    when: {remat.policy: custom}\n"
        "search:\n"
        "  warm_start:\n"
        "  - {remat.policy: custom, remat.custom.decoder_layer_input: remat}\n"
    )
    space = load_space(_write(tmp_path, text))
    on_tpu, notes = pin_inert(space, "tpu")
    knob = "remat.custom.decoder_layer_input"
    assert on_tpu.knobs[knob].values == ["device", "offload"]
    assert on_tpu.search.warm_start[0][knob] == "device"
    assert len(notes) == 1 and "same program as 'device'" in notes[0]
    on_cpu, _ = pin_inert(space, "cpu")
    assert on_cpu.knobs[knob].values == ["device"]
    assert on_cpu.knobs["remat.custom.context"].values == ["device", "remat"]


@pytest.mark.parametrize(
    "path", sorted(p.name for p in resolve_path("smoke").parent.glob("*.yaml"))
)
def test_every_shipped_space_validates(path):
    from sweeper.space.checks import check_sampler

    space = load_space(f"spaces/{path}")  # the documented form of a built-in space
    check_sampler(space)
    assert count_points(space) and space.effective_fidelity in ("run", "compile")


def test_kernel_values_are_pinned_to_what_they_run_as(tmp_path):
    """`auto` is measured as what it resolves to; cuDNN only on GPU; tokamax's grouped matmul
    is ragged_dot on CPU; each such value is folded into its twin, with a note."""
    from trainer.trial.config import load_config
    from trainer.trial.effects import knob_effects

    extra = (
        "  kernels.attention: {values: [auto, xla, cudnn, splash]}\n"
        "  kernels.moe_gmm: {values: [auto, ragged_dot, tokamax]}\n"
        "  kernels.tokamax_tiles.wi_fwd: {values: [512x4096x1536, 256x4096x1536]}\n"
    )
    space = load_space(_write(tmp_path, GOOD + extra))
    assert pin_inert(space, "tpu")[0] == space  # TPU trials keep every value
    tiles = "kernels.tokamax_tiles.wi_fwd"
    assert pin_inert(space, "gpu")[0].knobs[tiles].values == ["512x4096x1536"]
    on_gpu, gpu_notes = pin_inert(space, "gpu")
    assert on_gpu.knobs["kernels.attention"].values == ["cudnn", "xla"]
    assert on_gpu.knobs["kernels.moe_gmm"].values == ["tokamax", "ragged_dot"]
    on_cpu, cpu_notes = pin_inert(space, "cpu")
    assert on_cpu.knobs["kernels.attention"].values == ["xla"]
    assert on_cpu.knobs["kernels.moe_gmm"].values == ["ragged_dot"]
    assert any("tokamax" in n for n in cpu_notes)
    assert any(
        "auto pinned to tokamax, ragged_dot on gpu (auto runs as tokamax" in n for n in gpu_notes
    ), gpu_notes
    # With fp8 experts possible, auto stays: on GPU it is ragged_dot for them, tokamax else.
    fp8 = load_space(_write(tmp_path, GOOD + extra + "  precision.mode: {values: [bf16, fp8]}\n"))
    assert pin_inert(fp8, "gpu")[0].knobs["kernels.moe_gmm"].values == [
        "auto",
        "ragged_dot",
        "tokamax",
    ]
    moe = load_config({"model": {"preset": "tiny-moe"}, "kernels": {"moe_gmm": "tokamax"}})
    assert knob_effects(moe, "cpu")["kernels.moe_gmm"].status == "inert"
    assert "kernels.moe_gmm" not in knob_effects(moe, "gpu")
    assert knob_effects(moe, "gpu")["kernels.attention"].reason == "auto resolved to cudnn on gpu"


def test_dq_reduction_steps_act_on_a_splash_backward_on_tpu():
    """Active wherever Splash runs compiled: with 3 buffers tokamax runs its dynamic grid, so
    even 2 key/value blocks compile to another program (tpu7x:2x2x1, seq 2048, 1024-wide
    blocks: 3 dQ buffers instead of 2, 27.2 MB of temporaries instead of 25.7)."""
    from trainer.trial.config import load_config
    from trainer.trial.effects import knob_effects
    from trainer.trial.events import KnobEffect

    def effect(attention: str, block_kv_dkv: int, platform: str = "tpu") -> KnobEffect:
        kernels = {"attention": attention, "block_kv_dkv": block_kv_dkv, "dq_reduction_steps": 3}
        config = load_config(
            {"model": {"preset": "tiny-dense"}, "seq_len": 8192, "kernels": kernels}
        )
        return knob_effects(config, platform)["kernels.dq_reduction_steps"]

    assert effect("splash", 2048).model_dump(mode="json") == {
        "status": "active",
        "reason": "the fused backward sums dQ in 3 buffers in the kernel, not 4 partials after it",
    }
    assert effect("splash", 4096).model_dump(mode="json") == {
        "status": "active",
        "reason": "the fused backward sums dQ in 3 buffers in the kernel, not 2 partials after it",
    }
    assert effect("xla", 2048).status == "inert"
    assert effect("splash", 2048, "cpu").status == "interpreted"
    plain = load_config({"model": {"preset": "tiny-dense"}})
    assert "kernels.dq_reduction_steps" not in knob_effects(plain, "tpu")


def test_a_sampled_learning_rate_is_judged_against_the_recipes(tmp_path):
    """The reference of a trial that samples a hyperparameter trains with the space's value
    of it (or the trainer's default), never the trial's: half the rate is a deviation."""
    from trainer.run.convergence import reference_key
    from trainer.trial.config import load_config

    text = GOOD.replace("steps: 4,", "steps: 4, learning_rate: 0.01,") + (
        "  learning_rate: {values: [0.01, 0.005]}\n  warmup_steps: {values: [0, 5]}\n"
    )
    space = load_space(_write(tmp_path, text))
    point = {"mesh.tensor": 1, "remat.policy": "full", "per_device_batch": 1}
    halved = load_config(assemble(space, point | {"learning_rate": 0.005, "warmup_steps": 0}))
    recipe = load_config(assemble(space, point | {"learning_rate": 0.01, "warmup_steps": 5}))
    assert halved.convergence.recipe == {"learning_rate": 0.01, "warmup_steps": 5}
    assert halved.baseline().learning_rate == 0.01
    assert reference_key(halved, "cpu", 8) == reference_key(recipe, "cpu", 8)
    unswept = load_config(assemble(load_space(_write(tmp_path, GOOD)), point))
    assert unswept.convergence.recipe == {}


def test_remeasure_is_for_run_fidelity_only(tmp_path):
    """A compile's figure is the same each time: asking to measure it again is an error naming
    the setting; a run-fidelity space measures its best two points again unless told."""
    compiled = GOOD + "fidelity: compile\ntarget: tpu7x:2x2x1\nsearch: {remeasure: 2}\n"
    with pytest.raises(SpaceError, match=r"search\.remeasure: compile figures are deterministic"):
        load_space(_write(tmp_path, compiled))
    space = load_space(_write(tmp_path, GOOD + "fidelity: run\n"))
    assert space.search.remeasure_count("run") == 2 and space.search.remeasure_count("compile") == 0
    space = load_space(_write(tmp_path, GOOD + "fidelity: run\nsearch: {remeasure: 0}\n"))
    assert space.search.remeasure_count("run") == 0
