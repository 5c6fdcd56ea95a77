"""TPU v5e as a target: its datasheet, its topologies (MaxText's names too), compile fidelity
through libtpu, the estimate, a local chip read as v5e; and int8, the precision its MXU runs
natively, through qwix."""

from __future__ import annotations

import pytest

from tests.compile_helpers import SMALL, _compile
from tests.helpers import run_trainer, trial
from trainer.run.metrics import chip_for
from trainer.trial.config import ConfigError, load_config
from trainer.trial.hardware import ACCELERATORS, GIB, Target, Topology


@pytest.mark.parametrize(
    ("name", "target", "devices"),
    [
        ("v5e-1", "v5e:1x1", 1),
        ("v5e-4", "v5e:2x2", 4),
        ("v5e-8", "v5e:2x4", 8),
        ("v5e-16", "v5e:4x4", 16),
        ("v5e-256", "v5e:16x16", 256),
        ("v5e:2x2", "v5e:2x2", 4),
        ("tpu7x-128", "tpu7x:4x4x4", 128),
    ],
)
def test_maxtexts_slice_names_read_as_libtpus_topologies(name, target, devices):
    topology = Topology.parse(name)
    assert (topology.target, topology.devices) == (target, devices)
    assert str(Target.parse(name)) == target  # what every later step hands libtpu


def test_a_slice_no_standard_shape_has_is_refused_with_the_ones_that_exist():
    with pytest.raises(ValueError, match=r"v5e-3: no standard TPU v5e slice.*v5e-4, v5e-8"):
        Topology.parse("v5e-3")


def test_the_local_chip_reads_as_v5e_with_its_int8_peak():
    chip = chip_for("TPU v5 lite", "tpu", 1, None)
    assert chip.name == "TPU v5e"
    assert chip.peak_tflops == {"bf16": 197.0, "fp8": 197.0, "int8": 394.0}
    assert ACCELERATORS["v5e"].usable_hbm_per_device == 15.75 * GIB


def test_a_cpu_host_reads_with_its_cores_in_words(monkeypatch):
    """A one-core host read 'cpu (x86_64, 1 cores)' in every table."""
    from trainer.run import metrics

    monkeypatch.setattr(metrics, "measured_cpu_peak_tflops", lambda cache_dir: 1.0)
    for cores, said in ((1, "1 core)"), (2, "2 cores)")):
        monkeypatch.setattr(metrics, "_usable_cores", lambda cores=cores: cores)
        assert chip_for("cpu", "cpu", 8, None).name.endswith(said)


def test_compile_fidelity_for_one_v5e_chip_counts_int8_products(tmp_path):
    """libtpu compiles for v5e:1x1 (one chip: libtpu's default host of 2x2x1 chips is given
    as the slice); the int8 program's matrix products are counted at int8."""
    precision = {"mode": "int8", "granularity": "per_axis"}
    config = {"model": {**SMALL, "vocab_size": 512}, "per_device_batch": 2, "precision": precision}
    code, events, err = _compile(tmp_path, config, "v5e:1x1")
    assert code == 0, err[-2000:]
    summary = events["summary"]
    assert summary["hardware"] == "TPU v5e" and summary["fits"]
    flops = summary["program_cost"]["flops"]
    assert flops["int8"] > 10 * flops.get("bf16", 0)  # the decoder's products run in int8
    assert summary["est_tokens_per_sec_per_chip"] > 0


def test_int8_trains_on_cpu_and_its_fp8_only_fields_are_refused(tmp_path):
    code, events, _ = run_trainer(
        trial(steps=4, precision={"mode": "int8", "granularity": "per_axis"}), tmp_path, devices=1
    )
    assert code == 0
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
    with pytest.raises(ValueError, match="only read when mode is 'fp8'"):
        load_config(trial(precision={"mode": "int8", "scaling": "fixed"}))


def test_int8_experts_outside_ragged_dot_are_refused_by_name():
    from trainer.trial.checks import check_static

    config = load_config(trial("tiny-moe", precision={"mode": "int8"},
                               kernels={"moe_gmm": "megablox"}))  # fmt: skip
    with pytest.raises(ConfigError, match="int8 experts are quantized through ragged_dot only"):
        check_static(config, 1, "tpu")


def test_the_v5e_fit_moves_v5e_alone_and_prices_what_the_chip_showed():
    """The estimate's constants refitted on the lent v5e (trainer/estimate/analytic.py's
    ACCELERATOR_CONSTANTS) change no other accelerator's; on v5e the estimate orders what the
    chip measured: Splash ahead of XLA's attention, int8 ahead of bf16 ahead of fp8."""
    from sweeper.space.checks import static_check
    from sweeper.space.load import load_space
    from trainer.estimate.analytic import STEP_CONSTANTS, constants_of, estimate

    assert constants_of(ACCELERATORS["tpu7x"]) == STEP_CONSTANTS
    assert constants_of(ACCELERATORS["v5e"]) != STEP_CONSTANTS
    space = load_space("v5e_dense")

    def tokens(**point):
        base = {"precision.mode": "bf16", "remat.policy": "full", "per_device_batch": 8,
                "kernels.attention": "splash", "kernels.q_layout": "head_dim_minor"}  # fmt: skip
        point = {**base, **point}
        if point["kernels.attention"] == "xla":
            point.pop("kernels.q_layout")
        if point["precision.mode"] != "bf16":
            point["precision.granularity"] = "per_axis"
        config = static_check(space, point, 1)
        return estimate(config, ACCELERATORS["v5e"], 1)["est_tokens_per_sec_per_chip"]

    assert tokens() > 1.1 * tokens(**{"kernels.attention": "xla"})
    assert tokens(**{"precision.mode": "int8"}) > tokens() > tokens(**{"precision.mode": "fp8"})


def test_a_program_libtpu_compiles_fits_whatever_its_memory_analysis_says():
    """On the lent v5e, programs XLA's memory analysis put at 17.57 GiB (over the chip's 15.75)
    compiled and ran: whether a program fits is libtpu's verdict (it refuses one that does not
    with RESOURCE_EXHAUSTED, oom_hbm), the analysis an upper bound; the space's own memory
    budget still holds against it."""
    from trainer.compile.aot import compile_summary
    from trainer.trial.events import TrialFailure

    config = load_config(trial(model="v5e-dense-270m", seq_len=2048, per_device_batch=16))
    memory = {"argument_size_in_bytes": 3 * GIB, "output_size_in_bytes": 3 * GIB,
              "alias_size_in_bytes": 3 * GIB, "temp_size_in_bytes": int(14.57 * GIB),
              "total_bytes": int(17.57 * GIB)}  # fmt: skip
    step = {"op": "tc", "bf16": 1e12, "hbm": 1e9, "matmul": True}  # one op: the whole step
    cost = {"flops": {"bf16": 1e12}, "hbm_bytes": 1e9, "kernel_calls": [], "collective_ops": [],
            "host_transfer_bytes": 0.0, "schedule": {"entry": "main", "computations": {"main": [step]}}}  # fmt: skip
    record = {"compile_s": 1.0, "fingerprint": "x", "memory_per_device": memory,
              "collectives": {}, "cost": cost}  # fmt: skip
    degrees = {"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    summary = compile_summary(config, 16, degrees, Topology.parse("v5e:1x1"), record)
    assert summary["fits"] and summary["hbm_per_device_gib"] == pytest.approx(17.57, abs=0.01)
    budget = load_config(trial(model="v5e-dense-270m", seq_len=2048, per_device_batch=16,
                               limits={"device_memory_gib": 16.0}))  # fmt: skip
    with pytest.raises(TrialFailure, match=r"limits\.device_memory_gib"):
        compile_summary(budget, 16, degrees, Topology.parse("v5e:1x1"), record)


@pytest.mark.parametrize("target", ["tpu7x:9x9", "v5e:4", "tpu7x:2x2x2x2x2"])
def test_a_topology_of_the_wrong_rank_is_refused_naming_the_shape_it_wants(target):
    """`plan --target tpu7x:9x9` was accepted: 81 chips of a 2-D shape for a 3-D torus."""
    from trainer.trial.hardware import Topology

    with pytest.raises(ValueError, match=r"-D torus \((tpu7x:2x2x1|v5e:2x1)\)"):
        Topology.parse(target)


def test_the_estimate_prices_tokamax_at_the_tiles_its_own_tables_pick(monkeypatch):
    """With a tokamax that carries its tuned tables (0.0.12, the chip's), unset tiles are
    tokamax's own choice: its table's entry for the shape, else its Config's 128 x 128 x 128.
    The estimate prices those (their grid steps, the forward's twice under full remat), so
    on v5e tokamax's kernel reads far slower than Megablox's 512 x 1024 x 1024 tiles, as the
    chip measured (v5e_moe: 24,166 against 83,960 tokens/s); with MaxText's tiles it would
    read the same as Megablox."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

    from sweeper.space.checks import static_check
    from sweeper.space.load import load_space
    from trainer.estimate.analytic import estimate, expert_tiles, recomputed, routed_rows
    from trainer.trial import tokamax_tiles
    from trainer.trial.config import TokamaxTiles

    # read from tokamax's source without importing it, they are tokamax's own (this host's)
    for name, table in tokamax_tiles.TABLE_NAMES.items():
        assert tokamax_tiles.TABLES[name] == getattr(pallas_mosaic_tpu, table, {})
    own = pallas_mosaic_tpu.Config()
    assert (own.tile_m, own.tile_k, own.tile_n) == tokamax_tiles.OWN_DEFAULT

    tables = {"fwd": {(4096, 1024, 1024, 8, False): ((256, 1024, 512), 2)}, "dlhs": {},
              "drhs": {}}  # fmt: skip
    monkeypatch.setattr(tokamax_tiles, "TABLES", tables)
    monkeypatch.setattr(tokamax_tiles, "UNSET", None)
    unset = TokamaxTiles()
    assert tokamax_tiles.run_tiles((4096, 1024, 1024), 8, "wi", unset, False) == {
        "fwd": (256, 1024, 512), "dlhs": (128, 128, 128), "drhs": (128, 128, 128)}  # fmt: skip
    given = TokamaxTiles(wi_dlhs="512x512x512")
    assert tokamax_tiles.run_tiles((4096, 1024, 1024), 8, "wi", given, False)[
        "dlhs"] == (512, 512, 512)  # fmt: skip

    space = load_space("v5e_moe")
    point = {"kernels.moe_gmm": "tokamax", "xla.scoped_vmem_kib": 16384,
             "kernels.block_q": 512, "remat.policy": "full"}  # fmt: skip
    config = static_check(space, point, 1)
    degrees = config.mesh.resolve(1)
    rows = routed_rows(config, degrees, config.seq_len * config.per_device_batch)
    full = expert_tiles(config, degrees, rows, 128, None, recomputed(config))[1]
    once = expert_tiles(config, degrees, rows, 128, None, None)[1]
    assert 1.2 < full / once < 1.5  # each weight's forward again: a third more steps
    v5e = ACCELERATORS["v5e"]
    own = estimate(config, v5e, 1)["est_tokens_per_sec_per_chip"]
    megablox = estimate(static_check(space, {**point, "kernels.moe_gmm": "megablox"}, 1), v5e,
                        1)["est_tokens_per_sec_per_chip"]  # fmt: skip
    assert own < 0.4 * megablox
    monkeypatch.setattr(tokamax_tiles, "UNSET", "512x1024x1024")
    assert estimate(config, v5e, 1)["est_tokens_per_sec_per_chip"] > 0.9 * megablox
