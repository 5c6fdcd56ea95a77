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
