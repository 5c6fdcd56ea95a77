"""FP8 training through qwix: the trial's precision knobs as one quantization rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax.numpy as jnp

from trainer.trial.config import ConfigError, PrecisionConfig

if TYPE_CHECKING:  # imported by an fp8 trial only
    import qwix

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# Weight matmuls go through lax.dot_general (dense) and lax.ragged_dot (MoE); attention's
# score and context einsums are neither, so they stay in bf16 as in MaxText's fp8_full.
# Experts in tokamax's kernels are quantized by trainer/model/fp8_gmm.py, not by this rule.
OP_NAMES = {"dense": ("dot_general",), "dense+moe": ("dot_general", "ragged_dot")}
# Decoder layers only: embedding lookup and the logits projection stay in bf16.
MODULE_PATH = "layers/.*"


def qt_rule(precision: PrecisionConfig, experts_in_tokamax: bool = False) -> qwix.QtRule:
    import qwix

    if precision.mode == "int8":  # forward and backward operands alike (MaxText's int8)
        fwd = bwd = jnp.int8
    else:
        fwd, bwd = FORMATS[precision.forward_format], FORMATS[precision.backward_format]
    op_names = OP_NAMES["dense" if experts_in_tokamax else precision.targets]
    calibration = "absmax"
    if precision.scaling == "fixed":
        calibration = f"fixed,{-precision.fixed_bound},{precision.fixed_bound}"
    return qwix.QtRule(
        module_path=MODULE_PATH,
        op_names=op_names,
        weight_qtype=fwd,
        act_qtype=fwd,
        bwd_qtype=bwd,
        weight_calibration_method=calibration,
        act_calibration_method=calibration,
        act_static_scale=precision.scaling == "static",
        disable_channelwise_axes=precision.granularity == "per_tensor",
        tile_size=precision.tile_size if precision.granularity == "subchannel" else None,
    )


def quantize(
    model: nn.Module, precision: PrecisionConfig, experts_in_tokamax: bool = False
) -> tuple[nn.Module, qwix.QtProvider | None]:
    """The model with the trial's fp8 rule; `experts_in_tokamax`: the experts' grouped
    matmuls quantize themselves (trainer/model/fp8_gmm.py), so the rule leaves ragged_dot alone."""
    if precision.mode == "bf16":
        return model, None
    import qwix

    provider = qwix.QtProvider([qt_rule(precision, experts_in_tokamax)])
    return qwix.quantize_model(model, provider), provider


def check_rules_used(provider: qwix.QtProvider | None) -> None:
    """A rule that matched nothing quantizes nothing: refuse it rather than report fp8 falsely."""
    if provider is None:
        return
    unused = provider.get_unused_rules()
    if unused:
        raise ConfigError(
            "precision.targets",
            f"the fp8 rule matched no operation of this model (module_path={MODULE_PATH!r}, "
            f"op_names={unused[0].op_names}); e.g. targets 'dense+moe' on a dense model is fine, "
            "but a model without matching layers is not",
        )
