"""The step model's kernel prices against tokamax's own timings of its kernels on TPU7x (its
shipped autotuning results: benchmarks/kernel_reference.py), the only TPU7x kernel timings
held here."""

from __future__ import annotations

import pytest

from benchmarks import kernel_reference


@pytest.fixture(scope="module")
def families() -> dict[str, dict[str, float]]:
    return kernel_reference.summary(kernel_reference.grouped_matmuls() + kernel_reference.splash())


def test_a_grouped_matmul_waits_on_every_experts_tiles_as_tokamax_measured(families):
    """tokamax's grouped matmul with 128-row tiles over 256 experts: 3.84 ms on TPU7x; its
    tiles' compute alone prices 2.78 (-28%); with every expert's weights read while the MXU
    waits, 3.80. Over every forward and input-gradient entry the waits take the median error
    from -18% to within 10% (weight gradient: -31% to -16%)."""
    (entry,) = [e for e in kernel_reference.grouped_matmuls()
                if e.tiles == "128x7168x1024" and e.shapes.startswith("bf16[131072,7168] bf16[256,")
                and "1024] G=256" in e.shapes]  # fmt: skip
    assert abs(entry.error) < 0.03, entry
    for family in ("gmm forward", "gmm input gradient"):
        assert families[family]["entries"] >= 20
        assert families[family]["median_abs_error"] < 0.10, (family, families[family])
    assert families["gmm weight gradient"]["median_abs_error"] < 0.20


def test_the_step_model_ranks_each_kernels_calls_as_tpu7x_times_them(families):
    """What the tile tuner ranks candidates by (the step model's price) orders each family's
    calls as their TPU7x times do; at each family's own efficiency (KERNEL_MXU_EFFICIENCY)
    each family's median error is within 6% (Splash had been priced 17-32% fast at the one
    efficiency fitted on whole steps)."""
    for family, figures in families.items():
        assert figures["spearman"] > 0.9, (family, figures)
        assert abs(figures["median_error"]) < 0.06, (family, figures)


def test_each_kernel_familys_constants_are_the_ones_its_timings_fit():
    """KERNEL_MXU_EFFICIENCY and SPLASH_RESCALE_S hold what `python -m
    benchmarks.kernel_reference --fit` fits on tokamax's timings: a change to how the step
    model counts a kernel's work (its FLOPs, steps, waits, rescaled elements) fails here until
    they are fitted again."""
    from trainer.trial.mxu import KERNEL_MXU_EFFICIENCY, SPLASH_RESCALE_S

    entries = kernel_reference.grouped_matmuls() + kernel_reference.splash()
    held = {family: (efficiency, SPLASH_RESCALE_S["tpu7x"].get(family))
            for family, efficiency in KERNEL_MXU_EFFICIENCY["tpu7x"].items()}  # fmt: skip
    assert kernel_reference.fit(entries) == held


def test_the_step_model_orders_splash_blocks_of_one_shape_as_tpu7x_times_them():
    """What the tile tuner picks Splash blocks by: of tokamax's pairs of configurations for
    the same shapes whose TPU7x times differ by 3% or more, the model orders 27 of 36 as
    measured (at its FLOPs alone, 1): each grid step costs GRID_STEP_S on top of the work, and
    each block_kv_compute keys the (block_q x head_dim) accumulator is touched again."""
    entries = kernel_reference.grouped_matmuls() + kernel_reference.splash()
    orders = kernel_reference.block_orders(entries)
    right = sum(r for r, _ in orders.values())
    pairs = sum(n for _, n in orders.values())
    assert pairs == 36 and right >= 27, orders


def test_a_programs_kernel_calls_take_their_familys_efficiency():
    """The families by the names compiled programs give the calls (ours and MaxText's Splash,
    tokamax's grouped matmul by pass and precision); an fp8 gradient pass, never timed, takes
    its bf16 pass's efficiency times the forward's fp8/bf16 ratio; a kernel of no measured
    family, or another chip, none (the whole step's)."""
    from trainer.trial import mxu

    measured = mxu.KERNEL_MXU_EFFICIENCY["tpu7x"]
    names = {"splash_mha_fwd_segmented_residuals": mxu.SPLASH_RESIDUALS,
             "splash_mqa_fwd_no_residuals": mxu.SPLASH_FORWARD,
             "splash_mha_dkv_segmented_no_residuals": mxu.SPLASH_BACKWARD,
             "splash_mha_dq_no_residuals": mxu.SPLASH_BACKWARD,
             "pallas_tpu_ragged_dot_gmm": mxu.GMM_FORWARD,
             "pallas_tpu_ragged_dot_gmm_transpose_rhs": mxu.GMM_INPUT_GRADIENT,
             "pallas_tpu_ragged_dot_tgmm": mxu.GMM_WEIGHT_GRADIENT}  # fmt: skip
    for name, family in names.items():
        assert mxu.kernel_efficiency("tpu7x", {"name": name}) == measured[family], name
    fp8_tgmm = {"name": "pallas_tpu_ragged_dot_tgmm", "precision": "fp8"}
    ratio = measured[mxu.GMM_FORWARD + mxu.FP8] / measured[mxu.GMM_FORWARD]
    assert mxu.kernel_efficiency("tpu7x", fp8_tgmm) == pytest.approx(
        measured[mxu.GMM_WEIGHT_GRADIENT] * ratio
    )
    assert mxu.kernel_efficiency("tpu7x", {"name": "gmm"}) is None  # Megablox: not timed
    assert mxu.kernel_efficiency("v6e", {"name": "pallas_tpu_ragged_dot_gmm"}) is None
