"""FP8 experts in tokamax's grouped-matmul kernels: the three grouped matmuls of a training
step (forward, input gradient, weight gradient) with fp8 operands, as MaxText's fp8 MoE
recipes run them (Mosaic TPU kernels with qwix QArrays).

qwix quantizes the experts only where it can intercept `lax.ragged_dot`; tokamax's kernels
are Pallas calls it does not enter. So this is the quantized op itself, a custom VJP in the
shape of qwix's own for ragged_dot: the forward quantizes the routed rows (a scale per row)
and the weights (a scale per output column), the backward quantizes the output gradient in
the backward format, once with the weights' column scales folded in (for the input
gradient, contracting the columns) and once with the rows' scales folded in (for the weight
gradient, contracting the rows), so each product's scales stay outside its contraction.
Unlike qwix's ragged_dot path, the trial's `granularity` and `scaling` apply here as they
do to its dense layers.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import qwix
import tokamax

from trainer.model.precision import FORMATS
from trainer.trial.config import PrecisionConfig

# dlhs [M, N] x [G, K, N] -> [M, K]; drhs [M, K] x [M, N] -> [G, K, N] (tokamax's names).
DLHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
DRHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


class Fp8Gmm(NamedTuple):
    """How the experts' grouped matmuls quantize (static: hashable, a custom-VJP argument)."""

    forward: Any  # dtype of the forward operands
    backward: Any  # dtype of the output gradient
    calibration: str  # of the forward operands (qwix's names); gradients: absmax
    channelwise: bool  # a scale per row / column, else one per tensor
    # tokamax's implementation of each pass (forward, input gradient, weight gradient): a
    # name, an implementation object (its tiles), or a sequence of them to try in order
    implementations: tuple[Any, Any, Any]

    @classmethod
    def of(cls, precision: PrecisionConfig, implementations: tuple[Any, Any, Any]) -> Fp8Gmm:
        calibration = "absmax"
        if precision.scaling == "fixed":
            calibration = f"fixed,{-precision.fixed_bound},{precision.fixed_bound}"
        return cls(
            FORMATS[precision.forward_format],
            FORMATS[precision.backward_format],
            calibration,
            precision.granularity == "per_axis",
            implementations,
        )

    def quantize(self, x, qtype, axis: int, calibration: str = "absmax") -> qwix.QArray:
        axes = [axis] if self.channelwise else []
        return qwix.quantize(x, qtype, channelwise_axes=axes, calibration_method=calibration)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, how: Fp8Gmm):
    """x [M, K] (rows sorted by group) times each group's w [K, N], operands in fp8."""
    return _forward(x_MxK, w_GxKxN, group_sizes_G, how)[0]


def _forward(x_MxK, w_GxKxN, group_sizes_G, how: Fp8Gmm):
    qx = how.quantize(x_MxK, how.forward, 0, how.calibration)  # scales [M, 1]
    qw = how.quantize(w_GxKxN, how.forward, 2, how.calibration)  # scales [1, 1, N]
    out = tokamax.ragged_dot(
        qx,
        qw,
        group_sizes_G,
        preferred_element_type=x_MxK.dtype,
        implementation=how.implementations[0],
    )
    return out, (qx, qw, group_sizes_G)


def _backward(how: Fp8Gmm, residuals, g_MxN):
    qx, qw, group_sizes_G = residuals
    # dx = g w^T contracts N: w's column scales go into g, the product takes w's fp8 values.
    g_for_dx = how.quantize(g_MxN * qw.scale[0], how.backward, 0)
    dx = tokamax.ragged_dot_general(
        g_for_dx, qw.qvalue, group_sizes_G, DLHS,
        preferred_element_type=qx.scale.dtype, implementation=how.implementations[1],
    )  # fmt: skip
    # dw = x^T g contracts M: x's row scales go into g, the product takes x's fp8 values.
    g_for_dw = how.quantize(g_MxN * qx.scale, how.backward, 1)
    dw = tokamax.ragged_dot_general(
        qx.qvalue, g_for_dw, group_sizes_G, DRHS,
        preferred_element_type=qw.scale.dtype, implementation=how.implementations[2],
    )  # fmt: skip
    return dx, dw, None


fp8_grouped_matmul.defvjp(_forward, _backward)
