"""FP8 through qwix, Splash and Megablox (interpreted on CPU), and the max-logit estimate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import run_trainer, trial
from trainer.model.attention import reference_attention
from trainer.model.grouped_matmul import grouped_matmul
from trainer.model.splash import splash_attention, splash_config
from trainer.program.build import build_program
from trainer.run.train import check_convergence, train
from trainer.trial.checks import check_static
from trainer.trial.config import SPLASH_BLOCKS, ConfigError, KernelsConfig, load_config
from trainer.trial.events import EXIT_CODES, Emitter

ONE_DEVICE = {
    "num_devices": 1,
    "per_device_batch": 8,
    "mesh": {"fsdp": 1},
    "steps": 20,
    "learning_rate": 1e-2,
}


def _converges(cache_dir, model: str = "tiny-dense", **changes) -> dict:
    config = load_config(
        trial(
            model,
            **ONE_DEVICE,
            convergence={"enabled": True, "cache_dir": str(cache_dir), "tolerance": 0.05},
        )
        | changes
    )
    return train(config, Emitter(quiet=True)).summary["convergence"]


FP8_VARIANTS = {
    "per_tensor": {},
    "per_axis": {"granularity": "per_axis"},
    "subchannel": {"granularity": "subchannel", "tile_size": 8},
    "static": {"scaling": "static"},
    "fixed_224": {"scaling": "fixed", "fixed_bound": 224.0},
    "e4m3_everywhere": {"backward_format": "e4m3"},
    "e5m2_everywhere": {"forward_format": "e5m2"},
}


@pytest.mark.parametrize(  # make test: the default scaling; the other variants in test-slow
    "name",
    [
        n if n == "per_axis" else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(FP8_VARIANTS)
    ],
)
def test_fp8_dense_loss_within_tolerance_of_bf16(name, cache_dir):
    verdict = _converges(cache_dir, precision={"mode": "fp8", **FP8_VARIANTS[name]})
    assert verdict["passed"], verdict
    assert verdict["reference_source"] in ("computed", "cache")  # judged against the bf16 run


@pytest.mark.slow  # a minute here; fp8 experts' own program: the tokamax fp8 MoE test
def test_fp8_moe_with_grouped_matmul_quantized(cache_dir):
    verdict = _converges(cache_dir, "tiny-moe", precision={"mode": "fp8", "targets": "dense+moe"})
    assert verdict["passed"], verdict


def _lowered_text(devices: int = 1, **changes) -> str:
    base = trial("tiny-moe", num_devices=devices, mesh={"fsdp": devices}, per_device_batch=2)
    config = load_config(base | changes)
    program = build_program(config, jax.devices()[:devices])
    batch = jax.ShapeDtypeStruct(
        (program.global_batch, config.seq_len), np.int32, sharding=program.batch_sharding
    )
    return program.step_fn.lower(program.abstract_state, batch, batch, batch).as_text()


def _fp8_dots(text: str) -> int:
    return sum(
        1 for line in text.splitlines() if "stablehlo.dot_general" in line and "xf8E4M3FN>" in line
    )


def test_fp8_is_really_in_the_program():
    bf16 = _lowered_text()
    fp8 = _lowered_text(precision={"mode": "fp8", "targets": "dense+moe"})
    dense_only = _lowered_text(precision={"mode": "fp8", "targets": "dense"})
    assert "f8E4M3FN" not in bf16 and "f8E5M2" not in bf16
    assert "f8E5M2" in fp8  # e5m2 gradients in the backward pass
    # Weight matmuls get e4m3 dot operands; targeting the MoE grouped matmul quantizes more of them.
    assert _fp8_dots(fp8) > _fp8_dots(dense_only) > 0


def test_fp8_reaches_the_experts_under_expert_parallelism():
    """The grouped matmuls inside the expert-parallel shard_map are quantized too."""
    ep = {"mesh": {"fsdp": 2, "expert": 4}}
    fp8 = _lowered_text(8, precision={"mode": "fp8", "targets": "dense+moe"}, **ep)
    dense_only = _lowered_text(8, precision={"mode": "fp8", "targets": "dense"}, **ep)
    assert _fp8_dots(fp8) > _fp8_dots(dense_only) > 0
    # ... and in tokamax's path (trainer/model/fp8_gmm.py) the experts' operands are quantized too.
    tokamax = _lowered_text(8, precision={"mode": "fp8"}, kernels={"moe_gmm": "tokamax"}, **ep)
    assert tokamax.count("xf8E4M3FN>") > dense_only.count("xf8E4M3FN>")


def test_per_tensor_and_per_axis_scales_differ():
    per_tensor = _lowered_text(precision={"mode": "fp8"})
    per_axis = _lowered_text(precision={"mode": "fp8", "granularity": "per_axis"})
    assert per_tensor != per_axis
    config = trial(**{**ONE_DEVICE, "steps": 3})
    a = train(load_config(config | {"precision": {"mode": "fp8"}}), Emitter(quiet=True)).losses
    b = train(
        load_config(config | {"precision": {"mode": "fp8", "granularity": "per_axis"}}),
        Emitter(quiet=True),
    ).losses
    assert a[0] != b[0]  # different scales, different rounding, different loss


BLOCKS = {
    "all_128": dict.fromkeys(
        SPLASH_BLOCKS,
        128,
    ),
    "q256_kv128": {
        "block_q": 256,
        "block_kv": 128,
        "block_kv_compute": 128,
        "block_q_dkv": 256,
        "block_kv_dkv": 128,
        "block_kv_dkv_compute": 128,
    },
    "kv256_compute128": {
        "block_q": 128,
        "block_kv": 256,
        "block_kv_compute": 128,
        "block_q_dkv": 128,
        "block_kv_dkv": 256,
        "block_kv_dkv_compute": 128,
    },
}


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, h, kv, d = 2, 256, 4, 2, 32
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kv, d))
    v = jax.random.normal(keys[2], (b, s, kv, d))
    cotangent = jax.random.normal(keys[3], (b, s, h, d))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    return q, k, v, cotangent, pos


@pytest.mark.parametrize("blocks", sorted(BLOCKS))
def test_splash_matches_reference_forward_and_gradients(blocks, qkv):
    q, k, v, cot, pos = qkv
    kernels = KernelsConfig(attention="splash", **BLOCKS[blocks])

    def ref(q, k, v):
        return jnp.sum(reference_attention(q, k, v, pos, pos) * cot)

    def spl(q, k, v):
        return jnp.sum(splash_attention(q, k, v, kernels, interpret=True) * cot)

    np.testing.assert_allclose(
        splash_attention(q, k, v, kernels, True), reference_attention(q, k, v, pos, pos), atol=2e-5
    )
    for g_spl, g_ref in zip(
        jax.grad(spl, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v), strict=True
    ):
        np.testing.assert_allclose(g_spl, g_ref, atol=2e-4)


@pytest.mark.parametrize(
    "layouts",
    [("seq_minor", "seq_minor", "head_dim_minor"), ("seq_minor", "seq_minor", "seq_minor")],
    ids=["recipe", "all_seq_minor"],
)
def test_splash_layouts_keep_the_numerics(layouts, qkv):
    """A physical layout (MaxText's sa_*_layout) reaches the kernel and leaves its results:
    forward and gradients against the reference, as for the default layout."""
    q, k, v, cot, pos = qkv
    kernels = KernelsConfig(
        attention="splash", **dict(zip(("q_layout", "k_layout", "v_layout"), layouts, strict=True)),
        **BLOCKS["all_128"],
    )  # fmt: skip
    config = splash_config(kernels, True, 256, 256)
    assert [c.name.lower() for c in (config.q_layout, config.k_layout, config.v_layout)] == list(
        layouts
    )

    def loss(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), (0, 1, 2))(q, k, v)

    np.testing.assert_allclose(
        splash_attention(q, k, v, kernels, True), reference_attention(q, k, v, pos, pos), atol=2e-5
    )
    grads = zip(
        loss(lambda q, k, v: splash_attention(q, k, v, kernels, interpret=True)),
        loss(lambda q, k, v: reference_attention(q, k, v, pos, pos)),
        strict=True,
    )
    for g_spl, g_ref in grads:
        np.testing.assert_allclose(g_spl, g_ref, atol=2e-4)


def test_splash_max_logit_constant_matches_when_safe(qkv):
    q, k, v, _, pos = qkv
    kernels = KernelsConfig(attention="splash", max_logit_const=8.0, **BLOCKS["all_128"])
    np.testing.assert_allclose(
        splash_attention(q, k, v, kernels, True), reference_attention(q, k, v, pos, pos), atol=1e-4
    )
    np.testing.assert_allclose(
        reference_attention(q, k, v, pos, pos, max_logit_const=8.0),
        reference_attention(q, k, v, pos, pos),
        atol=1e-5,
    )


def test_max_logit_too_small_overflows_visibly(qkv):
    q, k, v, _, pos = qkv
    out = reference_attention(q * 30, k * 30, v, pos, pos, max_logit_const=-100.0)
    assert not bool(jnp.all(jnp.isfinite(out)))


def test_megablox_matches_ragged_dot_forward_and_gradients():
    keys = jax.random.split(jax.random.key(1), 3)
    m, kdim, n, groups = 512, 256, 384, 4
    x = jax.random.normal(keys[0], (m, kdim))
    w = jax.random.normal(keys[1], (groups, kdim, n))
    sizes = jnp.array([100, 0, 300, 112], jnp.int32)  # ragged, one empty group
    xla, mega = (
        KernelsConfig(),
        KernelsConfig(moe_gmm="megablox", gmm_tm=128, gmm_tk=128, gmm_tn=128),
    )
    np.testing.assert_allclose(
        grouped_matmul(x, w, sizes, mega, True),
        grouped_matmul(x, w, sizes, xla, True),
        rtol=1e-5,
        atol=1e-4,
    )

    def loss(kernels):
        return jax.grad(
            lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, kernels, True) ** 2), (0, 1)
        )(x, w)

    for g_mega, g_xla in zip(loss(mega), loss(xla), strict=True):
        np.testing.assert_allclose(g_mega, g_xla, rtol=1e-4, atol=1e-2)


def _relative_errors(outs, refs) -> list[float]:
    return [
        float(jnp.max(jnp.abs(o.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
        for o, r in zip(outs, refs, strict=True)
    ]


def test_fp8_experts_in_tokamax_quantize_forward_and_both_gradients():
    """trainer/model/fp8_gmm.py (through tokamax's XLA path here: the operands the TPU kernels get,
    dequantized) against a float32 grouped matmul: output, input and weight gradients carry
    fp8's error, as large as qwix's own quantized ragged_dot's and far above bf16's; and
    each knob it reads changes the result."""
    from qwix._src.core import ragged_dot_qt

    from trainer.model.fp8_gmm import Fp8Gmm, fp8_grouped_matmul
    from trainer.trial.config import PrecisionConfig

    keys = jax.random.split(jax.random.key(0), 3)
    m, kdim, n, groups = 512, 256, 384, 4
    x = jax.random.normal(keys[0], (m, kdim))
    w = jax.random.normal(keys[1], (groups, kdim, n)) * kdim**-0.5
    g = jax.random.normal(keys[2], (m, n))
    sizes = jnp.array([100, 0, 250, 162], jnp.int32)  # ragged, one empty group

    def with_vjp(fn, *operands):
        out, vjp = jax.vjp(fn, *operands)
        return [out, *vjp(g.astype(out.dtype))]

    exact = with_vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes, precision="highest"), x, w)
    bf16_x, bf16_w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def fp8(**knobs):
        how = Fp8Gmm.of(PrecisionConfig(mode="fp8", **knobs), ("xla",) * 3)
        return with_vjp(lambda x, w: fp8_grouped_matmul(x, w, sizes, how), bf16_x, bf16_w)

    qwix_config = ragged_dot_qt.RaggedDotQtConfig(
        lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2,
    )  # fmt: skip
    qwix = with_vjp(
        lambda x, w: ragged_dot_qt.ragged_dot_qt(x, w, sizes, qwix_config), bf16_x, bf16_w
    )
    bf16 = with_vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), bf16_x, bf16_w)
    ours = fp8(granularity="per_axis")  # the scales qwix's ragged_dot takes
    errors = _relative_errors(ours, exact)
    for mine, theirs, plain in zip(
        errors, _relative_errors(qwix, exact), _relative_errors(bf16, exact), strict=True
    ):
        assert mine < 1.5 * theirs and mine > 4 * plain, (errors, theirs, plain)
    assert max(errors) < 0.1
    # Rows of the empty group get nothing; each knob the op reads changes the result.
    for variant in (
        fp8(),  # per tensor
        fp8(granularity="per_axis", scaling="fixed", fixed_bound=8.0),
        fp8(granularity="per_axis", backward_format="e4m3"),
    ):
        assert any(not jnp.array_equal(a, b) for a, b in zip(variant, ours, strict=True))
        assert max(_relative_errors(variant, exact)) < 0.1


def test_tokamax_tpu_tiles_are_the_knobs_else_tokamaxs_tuned_ones_else_maxtexts():
    """The knob's tiles win, for either precision, clamped to the matmul's dims. Without it,
    tokamax 0.0.17 (no tile table; its own choice can overflow libtpu's default scoped VMEM):
    MaxText 0.2.5's default 512x1024x1024 in every pass and precision, clamped. tokamax
    0.0.12's tile table lists qwen3-235b's grouped matmuls (524,288 routed rows per device,
    d_model 4096, mlp 1536, 128 experts) for bf16 operands only, and for fp8 ones tokamax
    would take 128 x 128 x 128, a quarter of TPU7x's MXU: fp8 experts take the bf16 entry,
    bf16 keeps tokamax's own choice."""
    from trainer.model.grouped_matmul import _TOKAMAX_TILE_TABLES, tokamax_tpu_configs
    from trainer.trial.config import TokamaxTiles

    x = jax.ShapeDtypeStruct((524288, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 4096, 1536), jnp.bfloat16)
    if not any(_TOKAMAX_TILE_TABLES.values()):  # tokamax 0.0.17
        small = jax.ShapeDtypeStruct((128, 4096, 768), jnp.bfloat16)  # mlp under 1024
        for fp8 in (True, False):
            configs = tokamax_tpu_configs(x, w, "wo", TokamaxTiles(), fp8=fp8)
            tiles = {p: (c.tile_m, c.tile_k, c.tile_n) for p, c in configs.items()}
            assert set(tiles.values()) == {(512, 1024, 1024)}, tiles
            configs = tokamax_tpu_configs(x, small, "wi", TokamaxTiles(), fp8=fp8)
            tiles = {p: (c.tile_m, c.tile_k, c.tile_n) for p, c in configs.items()}
            # fwd and drhs: rows x d_model x mlp; dlhs: rows x mlp x d_model.
            assert tiles == {"fwd": (512, 1024, 768), "dlhs": (512, 768, 1024),
                             "drhs": (512, 1024, 768)}, tiles  # fmt: skip
    else:  # tokamax 0.0.12
        fp8 = tokamax_tpu_configs(x, w, "wi", TokamaxTiles(), fp8=True)
        for name, table in _TOKAMAX_TILE_TABLES.items():
            assert (524288, 4096, 1536, 128, True) not in table
            (tm, tk, tn), buffers = table[524288, 4096, 1536, 128, False]
            assert (fp8[name].tile_m, fp8[name].tile_k, fp8[name].tile_n) == (tm, tk, tn)
            assert fp8[name].input_buffer_count == buffers
        assert set(tokamax_tpu_configs(x, w, "wi", TokamaxTiles(), fp8=False).values()) == {None}
    knob = TokamaxTiles(wi_dlhs="512x4096x8192")  # contraction 1536, output 4096
    for precision in (True, False):
        dlhs = tokamax_tpu_configs(x, w, "wi", knob, fp8=precision)["dlhs"]
        assert (dlhs.tile_m, dlhs.tile_k, dlhs.tile_n) == (512, 1536, 4096)


def test_fp8_moe_in_tokamax_converges_and_is_its_own_program(cache_dir):
    """fp8 experts with moe_gmm tokamax train to within tolerance of bf16, and are not qwix's
    ragged_dot path: the lowered programs differ."""
    fp8 = {"mode": "fp8", "granularity": "per_axis"}
    verdict = _converges(cache_dir, "tiny-moe", precision=fp8, kernels={"moe_gmm": "tokamax"})
    assert verdict["passed"], verdict
    tokamax = _lowered_text(precision=fp8, kernels={"moe_gmm": "tokamax"})
    ragged = _lowered_text(precision=fp8, kernels={"moe_gmm": "ragged_dot"})
    dense_only = _lowered_text(precision={**fp8, "targets": "dense"})
    assert tokamax != ragged
    assert "f8E5M2" in tokamax  # the experts' output gradients quantized to e5m2
    # The experts' operands are quantized (casts to fp8) beyond the dense layers'.
    assert tokamax.count("xf8E4M3FN>") > dense_only.count("xf8E4M3FN>")


def test_tokamax_off_tpu_and_gpu_is_xla_ragged_dot_itself():
    """moe_gmm tokamax where tokamax has no kernel (here, CPU) is reported inert as the same
    program as moe_gmm ragged_dot: it is, to the lowered text."""
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def lowered(gmm):
        kernels = KernelsConfig(moe_gmm=gmm)

        def loss(x, w, sizes):
            out = grouped_matmul(x, w, sizes, kernels, True, "cpu")
            return jnp.sum(out.astype(jnp.float32) ** 2)

        text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w, sizes).as_text()
        return text.replace("jit(loss)", "")

    assert "stablehlo.dot_general" in lowered("ragged_dot")
    assert lowered("tokamax") == lowered("ragged_dot")


def test_a_tokamax_gpu_kernel_that_does_not_build_is_named_and_ragged_dot_runs():
    """Which tokamax GPU kernel builds depends on the JAX and tokamax a host carries; one that
    does not is named with its error, and the experts run XLA's ragged_dot, said inert."""
    from trainer.model.grouped_matmul import tokamax_gpu_gmm
    from trainer.trial.effects import knob_effects

    cpu = jax.devices()[0]  # no sm90 here: tokamax's Mosaic GPU kernel refuses to build
    kernel, failures = tokamax_gpu_gmm(cpu, ("mosaic_gpu",))
    assert kernel is None and failures["mosaic_gpu"].startswith("NotImplementedError")
    # The next candidate that builds is the one taken (tokamax's XLA path builds anywhere).
    assert tokamax_gpu_gmm(cpu, ("mosaic_gpu", "xla")) == ("xla", failures)
    # Triton traces with no architecture where the host's tokamax builds it (0.0.12 under jax
    # 0.10.2); tokamax 0.0.17 knows it only with jax_triton installed: then it is named too.
    taken, both = tokamax_gpu_gmm(cpu, ("mosaic_gpu", "triton"))
    assert taken == "triton" or both["triton"] == "ValueError: Unknown implementation: triton"
    moe = load_config(trial() | {"model": {"preset": "tiny-moe"}})
    effect = knob_effects(moe, "gpu", gpu_gmm=(kernel, failures))["kernels.moe_gmm"]
    assert effect.status == "inert"
    assert effect.reason.startswith("auto resolved to tokamax on gpu: no tokamax")
    assert f"mosaic_gpu: {failures['mosaic_gpu']}" in effect.reason
    built = knob_effects(moe, "gpu", gpu_gmm=("triton", failures))["kernels.moe_gmm"]
    assert built.model_dump(mode="json") == {
        "status": "active",
        "reason": "auto resolved to tokamax on gpu: tokamax's triton grouped matmul",
    }


def test_kernels_in_the_trainer_match_the_reference_numerics(cache_dir):
    splash_verdict = _converges(
        cache_dir, kernels={"attention": "splash", **BLOCKS["all_128"]}, seq_len=128
    )
    assert splash_verdict["passed"] and abs(splash_verdict["relative_delta"]) < 0.01, splash_verdict
    mega = _converges(
        cache_dir,
        "tiny-moe",
        kernels={"moe_gmm": "megablox", "gmm_tm": 128, "gmm_tk": 128, "gmm_tn": 128},
    )
    assert mega["passed"] and abs(mega["relative_delta"]) < 0.01, mega


def test_bad_max_logit_constant_is_diverged(tmp_path):
    bad = trial(steps=4, kernels={"max_logit_const": -200.0}, learning_rate=1e-2)
    code, events, _ = run_trainer(bad, tmp_path)
    assert code == EXIT_CODES["diverged"]
    assert events[-1]["failure_class"] == "diverged"


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        (
            {"kernels": {"attention": "splash", "block_q": 100}},
            "kernels.block_q",
            "multiple of 128",
        ),
        (
            {"kernels": {"attention": "splash", "block_kv": 384}, "seq_len": 512},
            "kernels.block_kv",
            "must divide seq_len",
        ),
        (
            {
                "kernels": {
                    "attention": "splash",
                    **BLOCKS["all_128"],
                    "block_kv": 256,
                    "block_kv_compute": 384,
                },
                "seq_len": 768,
            },
            "kernels.block_kv_compute",
            "must divide block_kv",
        ),
        (
            {"model": {"preset": "tiny-moe"}, "kernels": {"moe_gmm": "megablox", "gmm_tm": 96}},
            "kernels.gmm_tm",
            "must divide the routed token count",
        ),
        ({"precision": {"mode": "fp8", "rounding": "stochastic"}}, "precision", "qwix ignores"),
        (
            {"precision": {"mode": "fp8", "granularity": "subchannel"}},
            "precision",
            "tile_size is required",
        ),
        (
            {"precision": {"mode": "fp8", "granularity": "subchannel", "tile_size": 32}},
            "precision.tile_size",
            "{'head_dim': 16}",
        ),
        (
            {
                "model": {"preset": "tiny-moe"},
                "precision": {"mode": "fp8"},
                "kernels": {"moe_gmm": "megablox", "gmm_tm": 128},
            },
            "kernels.moe_gmm",
            "silently stay bf16",
        ),
        (
            {
                "model": {"preset": "tiny-moe"},
                "precision": {"mode": "fp8", "scaling": "static"},
                "kernels": {"moe_gmm": "tokamax"},
            },
            "precision.scaling",
            "dynamic or fixed",
        ),
        (
            {
                "model": {"preset": "tiny-moe"},
                "precision": {"mode": "fp8", "granularity": "subchannel", "tile_size": 8},
                "kernels": {"moe_gmm": "tokamax"},
            },
            "precision.granularity",
            "per tensor or per axis",
        ),
        (
            {
                "kernels": {"attention": "splash", **BLOCKS["all_128"]},
                "mesh": {"fsdp": 4, "context": 2},
                "seq_len": 384,
            },
            "kernels.block_q",
            "per-device query length",
        ),
    ],
)
def test_invalid_kernel_and_precision_configs_name_the_field(change, field, fragment):
    with pytest.raises(ConfigError) as err:
        check_static(load_config(trial() | change), 8)
    assert err.value.field == field and fragment in err.value.message


def test_fp8_experts_in_tokamax_are_refused_on_gpu_and_reported_per_backend():
    """tokamax's GPU grouped matmuls take fp8 weights only with subchannel scales and
    multiply in bf16, so fp8 experts there are refused with tokamax; on TPU they are its fp8
    kernels, on CPU an emulation; through ragged_dot, the sub-knobs the experts ignore are
    named."""
    from trainer.trial.effects import knob_effects

    moe = {"model": {"preset": "tiny-moe"}, "precision": {"mode": "fp8"}}
    config = load_config(trial() | moe | {"kernels": {"moe_gmm": "tokamax"}})
    with pytest.raises(ConfigError) as err:
        check_static(config, 8, "gpu")
    assert err.value.field == "kernels.moe_gmm" and "precision.targets dense" in err.value.message
    check_static(config, 8, "tpu")
    assert knob_effects(config, "tpu")["kernels.moe_gmm"].status == "active"
    assert knob_effects(config, "cpu")["kernels.moe_gmm"].status == "emulated"
    assert "precision.experts" not in knob_effects(config, "tpu")
    tiled = load_config(
        trial()
        | moe
        | {"kernels": {"moe_gmm": "tokamax", "tokamax_tiles": {"wo_fwd": "512x512x512"}}}
    )
    assert knob_effects(tiled, "tpu")["kernels.tokamax_tiles"].status == "active"
    assert knob_effects(tiled, "cpu")["kernels.tokamax_tiles"].status == "inert"
    ragged = load_config(trial() | moe | {"kernels": {"moe_gmm": "ragged_dot"}})
    reason = knob_effects(ragged, "tpu")["precision.experts"].reason
    assert "granularity per_tensor reaches the dense layers only" in reason
    per_axis = {"mode": "fp8", "granularity": "per_axis"}
    same = load_config(
        trial() | moe | {"precision": per_axis, "kernels": {"moe_gmm": "ragged_dot"}}
    )
    assert "precision.experts" not in knob_effects(same, "tpu")


def test_effects_say_emulated_and_interpreted_on_cpu(tmp_path):
    config = trial(
        "tiny-moe",
        steps=1,
        seq_len=128,
        precision={"mode": "fp8", "targets": "dense"},
        kernels={"attention": "splash", **BLOCKS["all_128"], "moe_gmm": "megablox", "gmm_tm": 128},
        mesh={"fsdp": 2, "expert": 4},
    )
    code, events, err = run_trainer(config, tmp_path)
    assert code == 0, err[-2000:]
    effects = events[0]["effects"]
    assert effects["precision"]["status"] == "emulated"
    assert effects["kernels.splash_blocks"]["status"] == "interpreted"
    assert effects["kernels.gmm_tiles"]["status"] == "interpreted"
    assert effects["mesh.expert"]["status"] == "emulated"  # no ragged all-to-all on XLA:CPU


def test_convergence_reference_for_fp8_is_the_bf16_run(cache_dir):
    config = load_config(
        trial(
            **ONE_DEVICE,
            seed=11,
            precision={"mode": "fp8"},
            convergence={"enabled": True, "cache_dir": str(cache_dir / "fresh")},
        )
    )
    first = check_convergence(
        config,
        train(
            config.model_copy(
                update={"convergence": config.convergence.model_copy(update={"enabled": False})}
            ),
            Emitter(quiet=True),
        ).losses,
        "cpu",
        global_batch=8,
        num_devices=1,
    )
    assert first["reference_source"] == "computed"
    bf16 = train(config.baseline(), Emitter(quiet=True)).losses
    assert first["reference_final_loss"] == pytest.approx(
        np.mean(bf16[-first["window"] :]), rel=1e-6
    )


@pytest.mark.parametrize("load_balance", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_splash_with_context_parallelism_matches_reference(load_balance):
    """Query chunks per device, keys/values all-gathered, mask rows sharded by query."""
    mesh = {"fsdp": 4, "context": 2, "context_load_balance": load_balance}
    base = trial(mesh=mesh, seq_len=512, steps=3)
    reference = train(load_config(base), Emitter(quiet=True)).losses
    splash = train(
        load_config(base | {"kernels": {"attention": "splash", **BLOCKS["all_128"]}}),
        Emitter(quiet=True),
    ).losses
    np.testing.assert_allclose(splash, reference, rtol=2e-3)


@pytest.mark.parametrize(
    ("model", "kernels"),
    [
        ("tiny-dense", {"attention": "splash", **BLOCKS["all_128"]}),
        ("tiny-moe", {"moe_gmm": "megablox", "gmm_tm": 128, "gmm_tk": 128, "gmm_tn": 128}),
    ],
)
def test_selected_pallas_kernel_is_really_in_the_step(model, kernels):
    """A kernel knob must change the program: the step's jaxpr holds a pallas_call only when chosen."""
    base = trial(model, num_devices=1, mesh={"fsdp": 1}, per_device_batch=2, seq_len=128)

    def jaxpr(config: dict) -> str:
        program = build_program(load_config(config), jax.devices()[:1])
        batch = jax.ShapeDtypeStruct(
            (program.global_batch, 128), np.int32, sharding=program.batch_sharding
        )
        with program.mesh:
            return str(jax.make_jaxpr(program.step_fn)(program.abstract_state, batch, batch, batch))

    assert "pallas_call" not in jaxpr(base)
    assert "pallas_call" in jaxpr(base | {"kernels": kernels})


def test_max_logit_const_changes_the_splash_program():
    """The constant reaches the kernel: the step's program differs with and without it."""
    base = trial(num_devices=1, mesh={"fsdp": 1}, per_device_batch=2, seq_len=128)
    splash = {"attention": "splash", **BLOCKS["all_128"]}

    def jaxpr(kernels: dict) -> str:
        program = build_program(load_config(base | {"kernels": kernels}), jax.devices()[:1])
        batch = jax.ShapeDtypeStruct(
            (program.global_batch, 128), np.int32, sharding=program.batch_sharding
        )
        with program.mesh:
            return str(jax.make_jaxpr(program.step_fn)(program.abstract_state, batch, batch, batch))

    without, with_const = jaxpr(splash), jaxpr(splash | {"max_logit_const": 8.0})
    assert "pallas_call" in without and without != with_const
    assert jaxpr(splash | {"max_logit_const": 8.0}) == with_const  # deterministic, not noise


def test_fused_attention_call_matches_the_reference():
    """The cuDNN path's call (jax.nn.dot_product_attention: GQA, causal, scale) through XLA
    agrees with the reference; on an H200 cuDNN itself was held to a float32 reference
    (benchmarks.accelerator_mfu --checks attention-check)."""
    from trainer.model.attention import fused_attention, reference_attention

    b, s, h, kv, d = 2, 64, 4, 2, 16
    q, k, v = (
        jax.random.normal(key, (b, s, n, d))
        for key, n in zip(jax.random.split(jax.random.key(3), 3), (h, kv, kv), strict=True)
    )
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    np.testing.assert_allclose(
        fused_attention(q, k, v, "xla"), reference_attention(q, k, v, pos, pos), atol=1e-5
    )


def test_cudnn_attention_is_refused_where_it_cannot_run():
    """cuDNN exists on NVIDIA GPUs only, and attends whole sequences: named ConfigErrors."""
    with pytest.raises(ConfigError, match="does not run on cpu") as err:
        build_program(load_config(trial(kernels={"attention": "cudnn"})), jax.devices()[:8])
    assert err.value.field == "kernels.attention"
    config = load_config(trial(kernels={"attention": "cudnn"}, mesh={"fsdp": 4, "context": 2}))
    with pytest.raises(ConfigError, match="context"):
        check_static(config, 8, "gpu")


def test_load_balanced_mask_is_lazy_and_causal_in_positions():
    """The context-parallel Splash mask is computed from each row's position (no S x S array),
    and undoing the pipeline's chunk order puts gathered keys back in position order."""
    from trainer.model.splash import LoadBalancedCausalMask
    from trainer.parallel.context import load_balance_order, natural_chunk_order

    s, context = 32, 2
    order = load_balance_order(s, context)
    mask = LoadBalancedCausalMask((s, s), context)
    np.testing.assert_array_equal(mask[0:s, 0:s], order[:, None] >= np.arange(s)[None, :])
    assert not any(isinstance(v, np.ndarray) and v.size >= s * s for v in vars(mask).values())
    x = jnp.arange(s)[None, :, None]
    np.testing.assert_array_equal(natural_chunk_order(x[:, order], context), x)
