"""The guide's decision table, searched by the estimate: every mesh, remat placement and
per-device batch this trainer can run on the target is estimated, and the fastest that fits
is advised, with the figures behind it.

All figures are estimates (trainer.estimate.analytic: datasheet + formulas); they choose where a
sweep starts, they are not results. `sweeper plan --compile` holds the advice against a compile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from trainer.estimate.analytic import estimate, parameter_count
from trainer.trial.checks import check_static
from trainer.trial.config import SPLASH_BLOCKS, TrialConfig, load_config
from trainer.trial.hardware import GIB, Accelerator, Backend, Topology

LONG_SEQUENCE = 32768  # the guide contrasts 8k (compute-bound) with 128k (memory-bound)
STATE_BYTES_PER_PARAM = 16  # f32 parameters, gradients and two Adam moments
# Candidates within this share of the fastest are ties (the step estimate does not resolve
# less): the simplest mesh, then the largest batch, then the lightest remat is advised.
TIE = 0.03
# Advice keeps this share of a device's usable HBM free: the memory estimate's largest error
# on the published recipes' trial 0 is 6% (benchmarks/memory_model.py).
HEADROOM = 0.05
BATCHES = (0.125, 0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# The loss untiled, or in tiles of the vocabulary (the published 128k and qwen3 recipes' 4 and 8):
# at long sequences the logits' copies are what does not fit.
VOCAB_TILINGS = (1, 4, 8)
# Splash blocks, all six alike: the kernel's default and the published recipes' larger ones.
DEFAULT_BLOCK = 512
SPLASH_BLOCK_SIZES = (DEFAULT_BLOCK, 1024, 2048)
# Lightest first: what the backward recomputes grows down the list.
REMATS: tuple[dict[str, Any], ...] = (
    {"policy": "minimal_with_context"},
    {"policy": "minimal"},
    {"policy": "save_dot_with_context_except_mlp"},
    {"policy": "save_dot_except_mlp"},
    {"policy": "save_qkv_proj"},
    {"policy": "minimal_offloaded"},
    {"policy": "qkv_proj_offloaded"},
    {"policy": "full"},
    # What the published 405B and qwen3 recipes run: full remat, the layer input on host.
    {"policy": "custom", "custom": {"decoder_layer_input": "offload"}},
    # The published llama3.1-70b 8k recipe's placements (attention's inputs kept on device).
    {"policy": "custom", "custom": dict.fromkeys(
        ("decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "qkv_proj"),
        "device")},
    # The published llama3.1-70b 128k recipe's (the MLP's output kept; its input recomputed).
    {"policy": "custom", "custom": dict.fromkeys(
        ("decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "mlpwo"),
        "device")},
)  # fmt: skip


@dataclass
class Candidate:
    mesh: dict[str, int]
    remat: dict[str, Any]
    per_device_batch: float
    estimate: dict[str, Any]
    vocab_tiling: int = 1  # the loss computed in this many tiles of the vocabulary
    splash_block: int = 512  # every Splash block (the kernel's default, or the recipes' larger)

    @property
    def gib(self) -> float:
        return float(self.estimate["est_memory_per_device"]["total"]) / GIB

    @property
    def tokens(self) -> float:
        return float(self.estimate["est_tokens_per_sec_per_chip"])

    def trial(self) -> dict[str, Any]:
        """The knobs a trial config takes for this candidate."""
        return {
            "per_device_batch": self.per_device_batch,
            "mesh": {"fsdp": -1, **self.mesh},
            "remat": self.remat,
            **({"vocab_tiling": self.vocab_tiling} if self.vocab_tiling > 1 else {}),
            **({"kernels": dict.fromkeys(SPLASH_BLOCKS, self.splash_block)}
               if self.splash_block != DEFAULT_BLOCK else {}),
        }  # fmt: skip

    def describe(self) -> str:
        mesh = ", ".join(f"{k} {v}" for k, v in self.mesh.items() if v > 1) or "fsdp only"
        remat = self.remat["policy"]
        if remat == "custom":
            remat += " " + ", ".join(f"{k}: {v}" for k, v in self.remat["custom"].items())
        tiles = f", the loss in {self.vocab_tiling} tiles" if self.vocab_tiling > 1 else ""
        if self.splash_block != DEFAULT_BLOCK:
            tiles += f", Splash blocks {self.splash_block}"
        return (
            f"mesh fsdp -1 ({mesh}), remat {remat}, per-device batch {self.per_device_batch:g}"
            f"{tiles}"
        )


@dataclass
class Recommendation:
    workload: str
    primary: str
    secondary: str
    best: Candidate
    alternatives: list[Candidate] = field(
        default_factory=list
    )  # the others that fit, fastest first
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    # The fastest fp8 candidate, searched as the bf16 ones are (bf16 advice on a target with
    # an fp8 peak): what an fp8 trial is held against.
    fp8: Candidate | None = None

    @property
    def mesh(self) -> dict[str, int]:
        return {"fsdp": -1, **self.best.mesh}

    @property
    def remat(self) -> dict[str, Any]:
        return self.best.remat


def _divisors(n: int, devices: int, cap: int) -> list[int]:
    return [
        d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= cap and n % d == 0 and devices % d == 0
    ]


def meshes(config: TrialConfig, devices: int) -> list[dict[str, int]]:
    """The axes this trainer shards over besides fsdp: tensor (over heads), expert (over
    experts), context (over the sequence, long sequences only). No pipeline axis: the
    guide's PP row runs through MaxText, not this trainer."""
    m = config.model
    tensors = _divisors(m.num_kv_heads, devices, 8)
    experts = _divisors(m.num_experts, devices, 16) if m.is_moe else [1]
    contexts = (
        _divisors(config.seq_len, devices, devices) if config.seq_len >= LONG_SEQUENCE else [1]
    )
    out = []
    for t, e, c in itertools.product(tensors, experts, contexts):
        if devices % (t * e * c) == 0 and devices // (t * e * c) >= 1:
            out.append({"tensor": t, "expert": e, "context": c})
    return out


def _estimate(
    base: dict[str, Any], knobs: dict[str, Any], accel: Accelerator, devices: int
) -> dict[str, Any] | None:
    """The estimate of one candidate, or None where the trainer would refuse it."""
    try:
        config = load_config({**base, **knobs})
        check_static(config, devices, Backend.TPU)
        return estimate(config, accel, devices)
    except ValueError:  # ConfigError and pydantic's ValidationError: not a trial this trainer runs
        return None


def candidates(
    model: dict[str, Any], seq_len: int, target: str, precision: str = "bf16"
) -> list[Candidate]:
    """Every candidate the trainer accepts and the estimate fits (with HEADROOM), fastest first."""
    topology = Topology.parse(target)
    accel, devices = topology.accelerator, topology.devices
    base = {"model": model, "seq_len": seq_len, "precision": {"mode": precision}}
    limit = accel.usable_hbm_per_device * (1 - HEADROOM)
    found: list[Candidate] = []
    tilings = [t for t in VOCAB_TILINGS if seq_len % t == 0]
    blocks = [b for b in SPLASH_BLOCK_SIZES if seq_len % b == 0]
    for mesh, remat, tiles, block in itertools.product(
        meshes(load_config(base), devices), REMATS, tilings, blocks
    ):
        for batch in BATCHES:
            knobs = {"mesh": {"fsdp": -1, **mesh}, "remat": remat, "per_device_batch": batch,
                     "vocab_tiling": tiles,
                     "kernels": dict.fromkeys(SPLASH_BLOCKS, block)}  # fmt: skip
            est = _estimate(base, knobs, accel, devices)
            if est is None:
                continue
            if est["est_memory_per_device"]["total"] > limit or not est["fits"]:
                break  # a larger batch only needs more (device or host memory)
            found.append(Candidate(mesh, remat, batch, est, tiles, block))
    return sorted(found, key=lambda c: (-c.tokens, sum(c.mesh.values())))


def recommend(
    model: dict[str, Any], seq_len: int, target: str, precision: str = "bf16"
) -> Recommendation:
    topology = Topology.parse(target)
    accel, devices = topology.accelerator, topology.devices
    config = load_config({"model": model, "seq_len": seq_len})
    m = config.model
    params = parameter_count(config)
    state_gib = params * STATE_BYTES_PER_PARAM / GIB
    slice_hbm_gib = devices * accel.usable_hbm_per_device / GIB
    fits = candidates(model, seq_len, target, precision)
    if not fits:
        raise ValueError(
            f"{m.preset or 'the model'} at sequence {seq_len:,} fits no mesh, remat policy and "
            f"per-device batch on {target} by the estimate ({state_gib:,.0f} GiB of training "
            f"state against {slice_hbm_gib:,.0f} GiB usable): use a larger topology"
        )
    long = seq_len >= LONG_SEQUENCE
    # The fastest that fits, whatever its context degree and batch: long sequences need a
    # context axis and fractions of a sequence per device to be fast, not only to fit.
    best = fits[0]
    context = best.mesh["context"]
    est = best.estimate
    ridge = accel.intensity_flops_per_ici_byte(precision)
    figures: dict[str, Any] = {
        "params": params,
        "state_gib": state_gib,
        "slice_usable_hbm_gib": slice_hbm_gib,
        "candidates_that_fit": len(fits),
        "est_memory_gib": best.gib,
        "est_tokens_per_sec_per_chip": best.tokens,
        "arithmetic_intensity_ici": est["arithmetic_intensity_ici"],
        # The hardware's ridge: peak FLOP/s per ICI link byte/s, one per target and precision.
        "hardware_intensity_ici": ridge,
        "bound": est["bound"],
    }
    reasons = [*_why_best(best, fits, accel, precision, ridge), *_simpler(best, fits)]
    reasons += _batch_advice(best, fits)
    reasons += _axis_advice(best, fits, config)
    fp8 = None
    if precision == "bf16" and "fp8" in accel.peak_tflops:
        fp8 = next(iter(candidates(model, seq_len, target, "fp8")), None)
    reasons += _fp8_advice(best, fp8, model, seq_len, accel, devices, figures)
    workload, primary, secondary = _row(config, best, long, state_gib, slice_hbm_gib)
    if m.is_moe and state_gib > 0.5 * slice_hbm_gib:
        reasons.append(
            f"training state {state_gib:,.0f} GiB exceeds half of the slice's {slice_hbm_gib:,.0f} "
            "GiB: the guide splits layers across stages (PP), which this trainer has no axis "
            "for; sweep it through MaxText (ici_pipeline_parallelism)"
        )
    if long:
        reasons.append(
            f"sequence {seq_len:,}: context parallelism {context}, the fastest that fits; the "
            f"smallest that fits is {min(c.mesh['context'] for c in fits)}"
        )
    return Recommendation(workload, primary, secondary, best, fits[1:], reasons, figures, fp8)


def _why_best(
    best: Candidate, fits: list[Candidate], accel: Accelerator, precision: str, ridge: float
) -> list[str]:
    """Why the advice: its memory and speed among what fits, and what bounds its step."""
    est = best.estimate
    return [
        f"{best.describe()}: {best.gib:.1f} GiB per device of {accel.usable_hbm_per_device / GIB:.2f} "
        f"usable, {best.tokens:,.0f} tokens/s/chip: the fastest of {len(fits):,} candidates that "
        f"fit (estimate)",
        f"{est['arithmetic_intensity_ici']:,.0f} FLOP per byte over each ICI link against the "
        f"hardware's ridge of {ridge:,.0f} ({accel.name}, {precision} peak); at the rate this "
        f"step computes, {est['hardware_intensity_ici']:,.0f}: {est['bound']}-bound (estimate)",
    ]


def _simpler(best: Candidate, fits: list[Candidate]) -> list[str]:
    """A simpler candidate (fewer sharded axes, then a larger batch, then lighter remat) within
    TIE of the advice, where there is one: what a person might start from instead."""
    ties = [c for c in fits if c.tokens >= (1 - TIE) * best.tokens]
    simplest = min(
        ties,
        key=lambda c: (
            sum(v > 1 for v in c.mesh.values()),
            -c.per_device_batch,
            REMATS.index(c.remat),
        ),
    )
    if simplest is best:
        return []
    return [
        f"within {TIE:.0%} of it, simpler: {simplest.describe()}, {simplest.tokens:,.0f} "
        f"tokens/s/chip ({simplest.tokens / best.tokens - 1:+.1%}, estimate)"
    ]


def _row(
    config: TrialConfig, best: Candidate, long: bool, state_gib: float, slice_gib: float
) -> tuple[str, str, str]:
    """The guide's row for this workload and the strategies of the advised mesh."""
    m = config.model
    if m.is_moe:
        size = (
            "very large"
            if state_gib > 0.5 * slice_gib
            else "long sequence"
            if long
            else "short sequence"
        )
        workload = f"MoE, {size}"
    else:
        workload = f"dense, {'long' if long else 'short'} sequence"
    primary = "FSDP" + (" + EP" if best.mesh["expert"] > 1 else "")
    secondary = [
        name for axis, name in (("context", "CP"), ("tensor", "TP")) if best.mesh[axis] > 1
    ]
    return workload, primary, " + ".join(secondary) or "-"


def _batch_advice(best: Candidate, fits: list[Candidate]) -> list[str]:
    same = [c for c in fits if c.mesh == best.mesh and c.remat == best.remat]
    largest = max(c.per_device_batch for c in same)
    most = max(fits, key=lambda c: c.per_device_batch)
    out = [
        f"per-device batch {best.per_device_batch:g}: the largest that fits with this mesh and "
        f"remat is {largest:g}"
    ]
    if most.per_device_batch > best.per_device_batch:
        out.append(
            f"batch {most.per_device_batch:g} fits with {most.describe()} at "
            f"{most.tokens:,.0f} tokens/s/chip: more batch buys less than lighter remat here"
        )
    return out


def _fp8_advice(
    best: Candidate,
    fastest: Candidate | None,
    model: dict[str, Any],
    seq_len: int,
    accel: Accelerator,
    devices: int,
    figures: dict[str, Any],
) -> list[str]:
    """The advice under fp8, and the fastest fp8 candidate where it is another."""
    if fastest is None:
        return []
    base = {"model": model, "seq_len": seq_len, "precision": {"mode": "fp8"}}
    fp8 = _estimate(base, best.trial(), accel, devices)
    if fp8 is None:
        return []
    gain = fp8["est_tokens_per_sec_per_chip"] / best.tokens - 1
    figures["fp8_est_tokens_per_sec_per_chip"] = fp8["est_tokens_per_sec_per_chip"]
    figures["fp8_best_est_tokens_per_sec_per_chip"] = fastest.tokens
    ridge = accel.intensity_flops_per_ici_byte("fp8")
    if best.estimate["bound"] == "compute":
        why = (
            f"compute-bound: fp8 doubles the peak, so the ridge moves to {ridge:,.0f} FLOP per "
            "link byte; worth a trial, with its convergence check"
        )
    else:
        why = f"{best.estimate['bound']}-bound: fp8 shortens only the compute"
    out = [
        f"fp8: {fp8['est_tokens_per_sec_per_chip']:,.0f} tokens/s/chip ({gain:+.0%}, estimate); {why}"
    ]
    if fastest.trial() != best.trial():
        out.append(
            f"fastest in fp8: {fastest.describe()}, {fastest.tokens:,.0f} tokens/s/chip "
            f"({fastest.tokens / best.tokens - 1:+.0%} on the advice, estimate)"
        )
    return out


def _axis_advice(best: Candidate, fits: list[Candidate], config: TrialConfig) -> list[str]:
    """The best candidate with and without each axis the guide names for this row, so the
    advice says what expert or tensor parallelism is estimated to buy or cost."""
    out = []
    axes = ["expert", "tensor"] if config.model.is_moe else ["tensor"]
    for axis in axes:
        other = [c for c in fits if (c.mesh[axis] > 1) != (best.mesh[axis] > 1)]
        if not other:
            continue
        alt = max(other, key=lambda c: c.tokens)
        verb = "with" if alt.mesh[axis] > 1 else "without"
        out.append(
            f"best {verb} {axis} parallelism: {alt.describe()}, {alt.gib:.1f} GiB, "
            f"{alt.tokens:,.0f} tokens/s/chip ({alt.tokens / best.tokens - 1:+.0%}, estimate)"
        )
    return out
