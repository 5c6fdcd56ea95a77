"""`kernels.tune: compile` in a MaxText trial (issue 51): Splash's blocks tuned by the
engine's tuner at the trial's shapes under its scoped VMEM limit before MaxText compiles, and
given to MaxText as its sa_block_* settings; what MaxText takes no tiles for (its grouped
matmuls) or whose attention is not the trial's shape (sliding windows, MLA, ...) said inert.
The slow test compiles the tuned trial with MaxText itself and reads the blocks back from its
program."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sweeper.execute.programs import program_of
from sweeper.space.checks import static_check
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from tests.helpers import REPO
from trainer.maxtext.tiles import tuned_for_maxtext
from trainer.trial.config import SPLASH_BLOCKS, load_config
from trainer.trial.events import parse_event
from trainer.trial.hardware import Topology
from trainer.trial.maxtext import MaxTextProgram, MaxTextRecipe, program_settings

MODEL = {"preset": "tiny-dense", "d_model": 256, "num_layers": 1, "num_heads": 8,
         "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
# As tests/test_compile_tiles.py: at 2k under 16 MiB, 2048-row blocks overflow and the
# forward's 512-row blocks are not the cheapest that fit.
TRIAL = {
    "model": MODEL,
    "seq_len": 2048,
    "per_device_batch": 1,
    "kernels": {"attention": "splash", "tune": "compile"},
    "xla": {"scoped_vmem_kib": 16384, "judge": False},
    "compile_target": "tpu7x:2x2x1",
}
# In a fresh process, its environment prepared as `python -m trainer` prepares a MaxText
# compile trial's: the tuner starts libtpu with the trial's flags.
_TUNE = """
import json, sys
from trainer.cli import prepare_environment
from trainer.maxtext.tiles import tuned_for_maxtext
from trainer.trial.config import load_config
from trainer.trial.hardware import Topology
from trainer.trial.maxtext import MaxTextProgram, program_settings
config = load_config(json.loads(sys.argv[1]))
prepare_environment(config)
tuned, effects, tuning = tuned_for_maxtext(config, MaxTextProgram(), Topology.parse("tpu7x:2x2x1"))
args = program_settings(tuned, MaxTextProgram()).args
print(json.dumps({"effects": effects, "tuning": tuning, "args": args}))
"""


@pytest.mark.tpu_compile
@pytest.mark.slow  # 1.5 min; what MaxText is told: the untuned/inert tests
def test_maxtext_is_given_the_splash_blocks_the_tuner_chose(tmp_path):
    config = {**TRIAL, "convergence": {"enabled": False, "cache_dir": str(tmp_path)}}
    done = subprocess.run([sys.executable, "-c", _TUNE, json.dumps(config)], capture_output=True,
                          text=True, cwd=REPO, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    tuning = {k["kernel"]: k for k in out["tuning"]["kernels"]}
    assert set(tuning) == {"splash forward", "splash backward"}
    for tuned in tuning.values():  # refused by the compiler under the trial's 16 MiB
        assert any(2048 in t["blocks"] and "vmem" in t["failure"] for t in tuned["tried"])
    assert tuning["splash forward"]["chosen"] != tuning["splash forward"]["given"]
    assert out["effects"]["kernels.tune"]["status"] == "active"
    assert "sa_block_*" in out["effects"]["kernels.tune"]["reason"]
    # MaxText's settings carry every chosen block (the given 512s if the choice were dropped).
    chosen = {f: b for t in tuning.values() for f, b in zip(t["knobs"], t["chosen"], strict=True)}
    assert set(chosen) == set(SPLASH_BLOCKS)
    assert {f: int(out["args"][f"sa_{f}"]) for f in chosen} == chosen


def test_grouped_matmuls_and_other_attention_shapes_are_said_untuned():
    """MaxText 0.2.5's tokamax path takes no tiles: its grouped matmuls are not tuned, said
    (no compile: no Splash here, and nothing else MaxText takes tiles for). A recipe with sliding windows has Splash calls of other
    shapes than the trial's model: not tuned, said."""
    moe = {"preset": "tiny-moe", "d_model": 512, "mlp_dim": 1024, "num_layers": 1,
           "num_heads": 8, "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
    config = load_config({**TRIAL, "model": moe,
                          "kernels": {"attention": "xla", "moe_gmm": "tokamax", "tune": "compile"}})  # fmt: skip
    same, effects, tuning = tuned_for_maxtext(
        config, MaxTextProgram(), Topology.parse("tpu7x:2x2x1")
    )
    assert same == config and tuning is None
    assert effects["kernels.tune"]["status"] == "inert"
    reason = effects["kernels.tune"]["reason"]
    assert "Splash alone" in reason and "MaxText 0.2.5's tokamax path" in reason
    recipe = MaxTextRecipe(settings={"model_name": "gemma4-26b"}, trial={},
                           unmodeled=["shared_experts=1: 1 shared expert(s)",
                                      "sliding_window_size=1024: sliding-window attention"])  # fmt: skip
    splash = load_config(TRIAL)
    same, effects, tuning = tuned_for_maxtext(splash, MaxTextProgram(recipe=recipe),
                                              Topology.parse("tpu7x:2x2x1"))  # fmt: skip
    assert same == splash and tuning is None
    assert "sliding_window_size=1024" in effects["kernels.tune"]["reason"]
    assert "shared_experts" not in effects["kernels.tune"]["reason"]


def _space(**trial) -> dict:
    return {"name": "t", "target": "tpu7x:2x2x1", "fidelity": "compile", "program": "maxtext",
            "model": MODEL, "trial": {"seq_len": 2048, **trial}}  # fmt: skip


def test_a_maxtext_space_may_tune_at_compile_fidelity_and_not_time():
    space = load_space(_space(kernels={"attention": "splash", "tune": "compile"}))
    settings = program_settings(static_check(space, {}), space.maxtext_program(), {})
    assert "kernels.tune" not in {u.field for u in settings.unmapped}
    with pytest.raises(SpaceError, match=r"kernels\.tune = 'time': MaxText has no setting"):
        load_space(_space(kernels={"attention": "splash", "tune": "time"}))


def test_a_maxtext_run_says_the_compile_tuner_inert():
    """At run fidelity a MaxText trial takes its Splash blocks as set: `kernels.tune: compile`
    is inert there, said in the trial's effects (at compile fidelity the tuner acts)."""
    from trainer.maxtext.driver import _accepted
    from trainer.trial.events import Fidelity
    from trainer.trial.maxtext import program_settings as settings_of

    run = load_config({k: v for k, v in TRIAL.items() if k != "compile_target"})
    said = {}
    for config, fidelity in ((run, Fidelity.RUN), (load_config(TRIAL), Fidelity.COMPILE)):
        settings = settings_of(config, MaxTextProgram(), {})
        accepted = _accepted(config, settings, {}, fidelity=fidelity, backend="cpu",
                             hardware="cpu", device_kind="cpu", num_devices=8, chips=8.0)  # fmt: skip
        said[fidelity] = accepted.effects.get("kernels.tune")
    assert said[Fidelity.RUN].status == "inert", said
    assert "MaxText run on cpu takes its Splash blocks as set" in said[Fidelity.RUN].reason
    assert said[Fidelity.COMPILE] is None


MAXTEXT = MaxTextProgram().interpreter()


@pytest.mark.slow
@pytest.mark.tpu_compile
@pytest.mark.skipif(not os.access(MAXTEXT, os.X_OK), reason="no MaxText environment")
def test_maxtexts_program_runs_the_blocks_the_tuner_chose(tmp_path):
    """MaxText's train_compile of the tuned trial: its program's Splash calls carry the blocks
    the tuner chose (they would carry the trial's 512s if the choice were ignored)."""
    space = load_space(_space(kernels={"attention": "splash", "tune": "compile"},
                              xla={"scoped_vmem_kib": 16384, "judge": False}))  # fmt: skip
    trial = static_check(space, {})
    trial = trial.model_copy(update={"convergence": trial.convergence.model_copy(
        update={"cache_dir": str(tmp_path)})})  # fmt: skip
    path = tmp_path / "trial.json"
    path.write_text(trial.to_json())
    [flag, request] = program_of(space).args(space, {})
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path), flag, request],
                          capture_output=True, text=True, timeout=1800, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = {e.event: e for e in map(parse_event, done.stdout.splitlines()) if e}
    compiled = events["compiled"]
    assert compiled.effects["kernels.tune"].status == "active"
    tuning = {k["kernel"]: k for k in compiled.kernel_tuning["kernels"]}
    blocks = {}
    for call in compiled.program_cost["kernel_calls"]:
        if call["name"].startswith("splash_") and call["blocks"]:
            kernel = "splash forward" if "_fwd" in call["name"] else "splash backward"
            blocks[kernel] = (call["blocks"][0][-2], call["blocks"][1][-2])
    assert blocks == {k: tuple(t["chosen"][:2]) for k, t in tuning.items()}


@pytest.mark.tpu_compile
def test_tiles_on_a_maxtext_space_tunes_what_maxtext_takes_and_says_what_it_does_not(
    tmp_path, monkeypatch
):
    """`sweeper tiles` on a MaxText MoE space: Splash tuned, the grouped matmuls (which our
    trainer's tiles would tune) said untaken by MaxText; on a recipe with sliding windows,
    exit 2 naming why."""
    import yaml
    from typer.testing import CliRunner

    from sweeper.cli import app
    from sweeper.cli.app import console

    moe = {"preset": "tiny-moe", "d_model": 512, "mlp_dim": 1024, "num_layers": 1,
           "num_heads": 8, "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
    space = {**_space(kernels={"attention": "splash", "moe_gmm": "tokamax"},
                      xla={"judge": False}), "model": moe}  # fmt: skip
    space["trial"]["seq_len"] = 1024
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(console, "width", 200)
    said = CliRunner().invoke(app, ["tiles", str(path), "--vmem", "65536"])
    assert said.exit_code == 0, said.output
    kernels = {line.split("│")[1].strip() for line in said.output.splitlines() if "│" in line}
    assert {"splash forward", "splash backward"} <= kernels
    assert not any(k.startswith(("wi ", "wo ")) for k in kernels), kernels  # gmm passes
    assert "gmm wi: MaxText 0.2.5's tokamax path" in " ".join(said.output.split())
    recipe = {"settings": {"model_name": "gemma4-26b"}, "trial": {**space["trial"], "model": moe},
              "unmodeled": ["sliding_window_size=1024: sliding-window attention"]}  # fmt: skip
    path.write_text(yaml.safe_dump({**space, "maxtext": {"recipe": recipe}}))
    refused = CliRunner().invoke(app, ["tiles", str(path), "--vmem", "65536"])
    assert refused.exit_code == 2 and "sliding_window_size=1024" in refused.output, refused.output


# (m, k, n) forwards: gpt-oss-120b's recipe (its compiled tiles: 128x2880x1408, weight gradient
# 1024x256x2880), qwen3-235b's, deepseek3's, a small one, rows under 1024 and a wide one.
HEURISTIC_SHAPES = [(327680, 2880, 2880), (327680, 4096, 1536), (262144, 7168, 2048),
                    (4096, 1024, 1024), (640, 2048, 768), (65536, 1536, 8192)]  # fmt: skip


@pytest.mark.parametrize("dims", HEURISTIC_SHAPES)
def test_the_tiles_tokamax_picks_on_tpu7x_are_its_own(dims, monkeypatch):
    """MaxText 0.2.5's unquantized tokamax grouped matmul passes no tiles: tokamax picks them
    on TPU7x (`_get_heuristics_config`). The estimate's port (JAX-free) gives what tokamax's
    own function gives for each pass, the chip's query answered as TPU7x's (generation 7,
    64 MiB of VMEM)."""
    import types

    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as kernel

    from trainer.trial.tokamax_tiles import HEURISTIC_VMEM_BYTES, heuristic_tiles

    vmem = HEURISTIC_VMEM_BYTES["tpu7x"]
    info = types.SimpleNamespace(generation=7, vmem_capacity_bytes=vmem)
    monkeypatch.setattr(kernel, "pltpu", types.SimpleNamespace(get_tpu_info=lambda: info))
    op = kernel.PallasMosaicTpuRaggedDot()
    m, k, n = dims
    bf16 = jnp.bfloat16

    def theirs(lhs: tuple, rhs: tuple, numbers: object) -> tuple[int, int, int]:
        args = (jax.ShapeDtypeStruct(lhs, bf16), jax.ShapeDtypeStruct(rhs, bf16))
        ba = types.SimpleNamespace(args=args, arguments={"ragged_dot_dimension_numbers": numbers})
        config = op._get_heuristics_config(ba)
        return config.tile_m, config.tile_k, config.tile_n

    ours = heuristic_tiles(dims, vmem)
    assert ours["fwd"] == theirs((m, k), (8, k, n), kernel.DEFAULT_RAGGED_DOT_DIM_NUMS)
    tm, tk, tn = theirs((m, n), (8, k, n), kernel.DLHS_RAGGED_DOT_DIM_NUMS)
    assert ours["dlhs"] == (tm, tn, tk)  # the estimate's order: rows, contracted, columns
    assert ours["drhs"] == theirs((m, k), (m, n), kernel.DRHS_RAGGED_DOT_DIM_NUMS)


def test_the_estimate_of_a_maxtext_program_prices_tokamaxs_own_tiles():
    """A MaxText trial of an unquantized tokamax grouped matmul on TPU7x is priced at the
    tiles tokamax picks (gpt-oss-120b's recipe: 128-row tiles, where our trainer runs
    512x1024x1024): more grid steps, a slower step than our program's; its tile knobs inert
    there; fp8 (MaxText's quantized path, which takes its tiles) priced as before."""
    from benchmarks.recipe_rows import imported
    from sweeper.search.screen import judge
    from sweeper.space.points import first_point, maxtext_knobs
    from trainer.estimate.analytic import estimate, expert_tiles, recomputed, routed_rows
    from trainer.trial.checks import check_static, global_batch_size

    space = imported("training/ironwood/gpt-oss-120b/8k-bf16-tpu7x-4x4x4/xpk/run_recipe.sh")[1]
    point = first_point(space)
    ours = {k: v for k, v in point.items() if k not in maxtext_knobs(point)}
    config = static_check(space, ours, space.target.tpu.devices)
    accel, devices = space.target.tpu.accelerator, space.target.tpu.devices
    degrees = check_static(config, devices)
    tokens = (
        global_batch_size(config, devices) * config.seq_len / (degrees["data"] * degrees["fsdp"])
    )
    rows = routed_rows(config, degrees, tokens)
    again = recomputed(config)
    tiles = {vmem: expert_tiles(config, degrees, rows, 256, None, again, vmem)
             for vmem in (None, 64 * 2**20)}  # fmt: skip
    # 1408-column tiles over 2880 columns: a third tile mostly padding; 128-row tiles
    (waste, steps), (waste_ours, steps_ours) = tiles[64 * 2**20], tiles[None]
    assert waste > 1.2 * waste_ours and steps > steps_ours

    def speed(cfg, maxtext: bool) -> float:
        return estimate(cfg, accel, devices, maxtext=maxtext)["est_tokens_per_sec_per_chip"]

    assert speed(config, True) < 0.97 * speed(config, False)
    # the screen judges a MaxText space's points as MaxText's program
    assert judge(space, point)["est_tokens_per_sec_per_chip"] == speed(config, True)
    tiled = config.model_copy(update={"kernels": config.kernels.model_copy(
        update={"tokamax_tiles": config.kernels.tokamax_tiles.model_copy(
            update={"wi_fwd": "1024x1024x1024"})})})  # fmt: skip
    assert speed(tiled, True) == speed(config, True) != speed(tiled, False)
    fp8 = static_check(space, {**ours, "precision.mode": "fp8"}, devices)
    assert speed(fp8, True) == speed(fp8, False)
