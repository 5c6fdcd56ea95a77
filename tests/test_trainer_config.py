from __future__ import annotations

import pytest

from tests.helpers import trial
from trainer.trial.config import ConfigError, KernelsConfig, TrialConfig, load_config


def test_json_round_trip_is_identity():
    config = load_config(
        trial(
            "tiny-moe",
            mesh={"fsdp": 2, "expert": 4},
            remat={"policy": "custom", "custom": {"context": "offload"}},
        )
    )
    again = TrialConfig.from_json(config.to_json())
    assert again == config
    assert again.model.num_experts == 4 and again.remat.custom == {"context": "offload"}


def test_preset_fills_fields_and_explicit_fields_win():
    config = load_config(
        trial(model="llama3-8b") | {"model": {"preset": "llama3-8b", "num_layers": 2}}
    )
    assert config.model.d_model == 4096 and config.model.num_layers == 2


@pytest.mark.parametrize(
    ("change", "field", "fragment"),
    [
        ({"stepz": 3}, "stepz", "unknown key"),
        ({"model": {"preset": "tiny-dense", "num_heads": 3}}, "model", "num_kv_heads"),
        ({"model": {"preset": "nope"}}, "model", "unknown preset"),
        ({"mesh": {"fsdp": -1, "tensor": -1}}, "mesh", "at most one"),
        ({"remat": {"policy": "everything"}}, "remat.policy", "full"),
        (
            {"remat": {"policy": "full", "custom": {"context": "device"}}},
            "remat",
            "only read when policy is 'custom'",
        ),
        ({"remat": {"policy": "custom", "custom": {"bogus": "device"}}}, "remat", "unknown tensor"),
        ({"seq_len": 1}, "seq_len", "greater than or equal"),
        (
            {"model": {"preset": "tiny-moe", "capacity_factor": 0}},
            "model",
            "capacity_factor (0.0) must be -1 (dropless) or > 0",
        ),
    ],
)
def test_bad_config_names_the_field(change, field, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(trial() | change)
    assert err.value.field == field
    assert fragment in err.value.message


def test_mesh_fill_and_impossible_products():
    mesh = load_config(trial(mesh={"fsdp": -1, "tensor": 2})).mesh
    assert mesh.resolve(8) == {"data": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(trial(mesh={"fsdp": -1, "tensor": 3})).mesh.resolve(8)
    # In words, not a dict: the degrees and their product against the devices.
    words = r"product of degrees data 1 x fsdp 2 x context 1 x expert 1 x tensor 2 is 4 but"
    with pytest.raises(ConfigError, match=words):
        load_config(trial(mesh={"fsdp": 2, "tensor": 2})).mesh.resolve(8)


def test_convergence_reference_of_a_capacity_trial_is_dropless():
    """Dropping slots changes numerics: such a trial is judged against dropless routing."""
    capped = load_config(trial() | {"model": {"preset": "tiny-moe", "capacity_factor": 1.25}})
    assert not capped.is_baseline_numerics("cpu")
    reference = capped.baseline()
    assert reference.model.capacity_factor == -1.0 and reference.is_baseline_numerics("cpu")
    assert reference.model.num_experts == capped.model.num_experts


def test_a_bfloat16_first_moment_is_judged_against_a_float32_one():
    """mu_dtype changes numerics: such a trial is never its own convergence reference."""
    light = load_config(trial() | {"mu_dtype": "bfloat16", "vocab_tiling": 4})
    assert not light.is_baseline_numerics("cpu")
    reference = light.baseline()
    assert reference.mu_dtype == "float32" and reference.is_baseline_numerics("cpu")
    assert reference.vocab_tiling == 4  # tiling only reorders float sums: not a numerics change


def test_auto_attention_resolves_to_the_fused_kernel_of_each_backend():
    """`auto` is the default; it is Splash on TPU, cuDNN on GPU, and the XLA reference on CPU,
    where a default trial therefore computes the convergence baseline's numerics."""
    config = load_config(trial() | {"model": {"preset": "tiny-moe"}})
    assert config.kernels.attention == "auto"
    resolved = [config.kernels.resolved(p).attention for p in ("tpu", "gpu", "cpu")]
    assert resolved == ["splash", "cudnn", "xla"]
    # cuDNN attends over whole causal sequences: context parallelism keeps the reference;
    # Splash needs 128-row query blocks on each device: shorter chunks keep it too.
    assert config.kernels.resolved_attention("gpu", context=2) == "xla"
    assert config.kernels.resolved_attention("tpu", context=2, seq_len=512) == "splash"
    assert config.kernels.resolved_attention("tpu", context=2, seq_len=128) == "xla"
    assert config.is_baseline_numerics("cpu")
    assert not config.is_baseline_numerics("gpu")
    # On TPU auto is Splash where the sequence fills 128-row blocks, the reference where not.
    assert not config.model_copy(update={"seq_len": 128}).is_baseline_numerics("tpu")
    assert config.is_baseline_numerics("tpu")  # seq_len 64: runs (and is judged as) xla
    assert config.baseline().kernels.resolved("gpu").attention == "xla"
    # Where auto runs the XLA reference (GPU with context shards), the trial is its own
    # reference: the check resolves kernels exactly as the run does (here with XLA's grouped
    # matmul too: auto is tokamax's on GPU).
    ragged = config.kernels.model_copy(update={"moe_gmm": "ragged_dot"})
    assert config.model_copy(update={"kernels": ragged}).is_baseline_numerics("gpu", context=2)
    assert not config.is_baseline_numerics("gpu", context=2)


def test_auto_moe_gmm_is_tokamax_on_gpu_and_ragged_dot_elsewhere():
    """XLA expands ragged_dot on GPU into a dense dot over every expert, so `auto` (the
    default) takes tokamax's Triton kernel there; TPU keeps libtpu's ragged-dot kernels. fp8
    experts keep ragged_dot on every backend (tokamax's GPU kernels do not multiply in fp8;
    on TPU, moe_gmm tokamax runs them in its kernels by choice)."""
    from trainer.trial.effects import knob_effects

    config = load_config(trial() | {"model": {"preset": "tiny-moe"}})
    assert config.kernels.moe_gmm == "auto"
    resolved = [config.resolved_kernels(p).moe_gmm for p in ("tpu", "gpu", "cpu")]
    assert resolved == ["ragged_dot", "tokamax", "ragged_dot"]
    fp8 = load_config(trial() | {"model": {"preset": "tiny-moe"}, "precision": {"mode": "fp8"}})
    assert fp8.fp8_experts and fp8.resolved_kernels("gpu").moe_gmm == "ragged_dot"
    # ... and a GPU trial says what that costs there, and how to avoid it.
    reason = knob_effects(fp8, "gpu")["kernels.moe_gmm"].reason
    assert reason.startswith("auto resolved to ragged_dot on gpu: fp8 experts")
    assert "precision.targets dense" in reason and "dense dot over every expert" in reason
    assert "fp8 experts" not in knob_effects(fp8, "tpu")["kernels.moe_gmm"].reason
    dense_only = {"mode": "fp8", "targets": "dense"}
    fp8_dense = load_config(trial() | {"model": {"preset": "tiny-moe"}, "precision": dense_only})
    assert fp8_dense.resolved_kernels("gpu").moe_gmm == "tokamax"
    effect = knob_effects(config, "gpu")["kernels.moe_gmm"]
    assert effect.model_dump(mode="json") == {
        "status": "active",
        "reason": "auto resolved to tokamax on gpu",
    }
    assert knob_effects(config, "cpu")["kernels.moe_gmm"].reason == (
        "auto resolved to ragged_dot on cpu"
    )
    # Explicit choices are kept as given.
    assert KernelsConfig(moe_gmm="ragged_dot").resolved("gpu").moe_gmm == "ragged_dot"


@pytest.mark.parametrize(
    ("preset", "global_batch", "seq", "chips", "step_s", "tflops_per_chip"),
    [  # AI-Hypercomputer/tpu-recipes@39ff447, training/ironwood/README.md (MaxText's count)
        ("llama3.1-70b", 256, 8192, 64, 12.20, 1207.05),
        ("llama3.1-70b", 64, 131072, 256, 34.23, 892.46),
        ("llama3.1-405b", 1536, 8192, 256, 101.89, 1217.58),
        ("qwen3-235b-a22b", 8192, 4096, 256, 31.58, 615.69),
    ],
)
def test_presets_are_the_published_models(
    preset, global_batch, seq, chips, step_s, tflops_per_chip
):
    """A preset's FLOPs per step equal what the published Ironwood run reports (its TFLOP/s
    per chip x step time x chips): the shapes are the recipes' models, experts included."""
    from trainer.trial.config import ModelConfig
    from trainer.trial.flops import training_flops_per_step

    flops = training_flops_per_step(ModelConfig(preset=preset), global_batch, seq)
    assert flops / chips / step_s / 1e12 == pytest.approx(tflops_per_chip, rel=2e-3)


@pytest.mark.parametrize(
    "flag",
    ["--a b", "--xla_x=1\t", "--xla_x=1\n--xla_y=2", "-x=1", "--xla_x=\x00"],
)
def test_an_extra_flag_is_one_flag(flag):
    with pytest.raises(ValueError, match="must be one flag"):
        load_config({"model": {"preset": "tiny-dense"}, "xla": {"extra": [flag]}})


@pytest.mark.parametrize(
    ("flag", "family"),
    [
        ("--xla_jf_dump_to=/some/path", "write files"),
        ("--xla_dump_hlo_as_text", "write files"),
        ("--tpu_persistent_compilation_cache_location=/tmp/c", "write files"),
        ("--flagfile=/tmp/f", "reads more flags"),
        ("--fromenv=xla_dump_to", "reads more flags"),
        ("--tryfromenv=xla_dump_to", "reads more flags"),
        ("--tpu_hlo_breakpoint_debugger_server_port=7000", "opens a port"),
        ("--megascale_debug_port=7001", "opens a port"),
        ("--v=5", "raises libtpu's logging"),
        ("--vmodule=tpu_compiler=3", "raises libtpu's logging"),
        ("--log_dir=/tmp/l", "raises libtpu's logging"),
    ],
)
def test_an_extra_flag_of_a_refused_family_is_refused_by_what_it_does(flag, family):
    """A flag that reads other flags, opens a port, raises logging or writes files is refused
    by name, with what it does; plain flags pass."""
    with pytest.raises(ValueError, match=family):
        load_config({"model": {"preset": "tiny-dense"}, "xla": {"extra": [flag]}})
    assert load_config(
        {
            "model": {"preset": "tiny-dense"},
            "xla": {
                "extra": ["--xla_tpu_enable_x=true", "--xla_b", "--xla_tpu_scoped_vmem_limit_kib=1"]
            },
        }
    ).xla.extra
