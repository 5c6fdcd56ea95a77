"""The trainer's programs compiled for an NVIDIA H200 on this host (XLA's deviceless GPU
compile, `benchmarks.gpu_compile`): what the GPU program does, not how fast."""

from __future__ import annotations

import pytest

from benchmarks.gpu_compile import PLUGIN_DIR, run_case

pytestmark = pytest.mark.skipif(
    not (PLUGIN_DIR / "jax_plugins").is_dir(), reason="no CUDA compiler: run `make gpu-compile`"
)


def test_the_default_moe_on_gpu_runs_tokamax_kernels_not_a_dense_dot_over_every_expert():
    """XLA:GPU expands ragged_dot into a dense dot over all 8 experts: the program's dot
    FLOPs are 4.4x the model's (the H200 ran that MoE at 0.14 MFU with its matmuls at the
    measured peak). `moe_gmm: auto` takes tokamax's grouped-matmul kernel there: 3 expert
    matmuls x (forward + 2 gradients) per layer as kernel calls, no [experts, rows, d]
    value, and the remaining dots under the model's FLOPs."""
    auto, ragged = run_case("moe-8x", 600), run_case("moe-8x-ragged-dot", 600)
    assert "error" not in auto and "error" not in ragged, (auto, ragged)
    assert ragged["moe_gmm"] == "ragged_dot"
    assert ragged["dot_flops_over_model"] > 4
    assert ragged["largest_dot_value"] == "bf16[8,65536,2048]"  # experts x routed rows x d
    assert auto["moe_gmm"].startswith("tokamax ")  # a kernel built: not ragged_dot (why)
    assert auto["kernel_calls"] == 8 * 3 * 3
    assert auto["dot_flops_over_model"] < 1
    assert "[8,65536" not in auto["largest_dot_value"]
    temp = [r["memory_per_device"]["temp_size_in_bytes"] for r in (auto, ragged)]
    assert temp[0] < temp[1]
