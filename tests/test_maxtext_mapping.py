"""The knob -> MaxText mapping (trainer/trial/maxtext.py), both ways: every mapped setting of a
trial parses back from its MaxText settings to the same value, and what MaxText cannot take
is listed, never dropped."""

from __future__ import annotations

import pytest

from sweeper.space.load import load_space
from sweeper.space.points import assemble
from tests.helpers import trial
from trainer.trial.config import SPLASH_BLOCKS, TrialConfig, load_config
from trainer.trial.maxtext import BASE_KEYS, GMM_TILE_KEYS, RENAMED, from_maxtext, to_maxtext

GMM_WI_FWD = GMM_TILE_KEYS["wi_fwd"]


def _round_trip(config: TrialConfig) -> TrialConfig:
    settings = to_maxtext(config)
    return load_config(from_maxtext(settings.args, settings.libtpu_init_args))


def _values(config: TrialConfig) -> dict:
    """The config's values by dotted field, its kernels as they run on TPU (MaxText has no
    `auto`: the export resolves it)."""
    resolved = config.model_copy(update={"kernels": config.resolved_kernels("tpu")})
    data = resolved.model_dump(mode="json")
    flat: dict = {}

    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value and key != "custom" and key != "recipe":
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(data)
    return flat


# Every knob the mapping carries, with a value other than its default.
VARIANTS = {
    "mesh": {"mesh": {"data": 2, "fsdp": 2, "context": 2, "expert": 1, "tensor": 2,
                      "context_load_balance": False}},
    "batch and sequence": {"seq_len": 512, "per_device_batch": 0.5, "vocab_tiling": 4},
    "recipe": {"steps": 40, "warmup_steps": 10, "learning_rate": 1e-4, "weight_decay": 0.05,
               "grad_clip": 0.5, "mu_dtype": "bfloat16", "seed": 3, "init_seed": 7},
    "remat custom": {"remat": {"policy": "custom", "custom": {"decoder_layer_input": "offload",
                                                             "context": "device",
                                                             "query_proj": "remat"}}},
    "remat named": {"remat": {"policy": "save_dot_except_mlp"}},
    "splash": {"kernels": {"attention": "splash", **dict.fromkeys(SPLASH_BLOCKS, 256),
                           "block_q": 512, "q_layout": "seq_minor", "v_layout": "seq_minor",
                           "max_logit_const": 30.0, "dq_reduction_steps": 3}},
    "fp8 fixed": {"precision": {"mode": "fp8", "granularity": "per_axis", "scaling": "fixed",
                                "fixed_bound": 224.0}},
    "fp8 e4m3 backward": {"precision": {"mode": "fp8", "granularity": "per_axis",
                                        "backward_format": "e4m3"}},
    "int8": {"precision": {"mode": "int8", "granularity": "per_axis"}},  # was fp8_full
    "flags": {"xla": {"scoped_vmem_kib": 65536, "collective_mode": "sparsecore_offload",
                      "extra": ["--xla_tpu_dvfs_p_state=3"]}},
    "compile target": {"compile_target": "tpu7x:4x4x4", "backend": "tpu"},
    "two slices": {"compile_target": "tpu7x:4x4x4x2", "backend": "tpu"},
}  # fmt: skip
MOE_VARIANTS = {
    "megablox": {"kernels": {"moe_gmm": "megablox", "gmm_tm": 256, "gmm_tk": 512,
                             "gmm_tn": 768}, "model": {"preset": "tiny-moe",
                                                       "capacity_factor": 1.25,
                                                       "load_balance_loss_weight": 0.001}},
    "tokamax tiles": {"kernels": {"moe_gmm": "tokamax", "tokamax_tiles": {
        "wi_fwd": "256x512x768", "wo_dlhs": "128x256x384"}}},
    "ragged_dot": {"kernels": {"moe_gmm": "ragged_dot"}},
}  # fmt: skip


@pytest.mark.parametrize("name", [*VARIANTS, *MOE_VARIANTS])
def test_every_mapped_setting_parses_back_to_the_same_value(name):
    variant = {**VARIANTS, **MOE_VARIANTS}[name]
    rest = {k: v for k, v in variant.items() if k != "model"}
    config = trial("tiny-moe" if name in MOE_VARIANTS else "tiny-dense", **rest)
    config = load_config({**config, **({"model": variant["model"]} if "model" in variant else {})})
    back = _round_trip(config)
    mine, theirs = _values(config), _values(back)
    unmapped = {u.field for u in to_maxtext(config).unmapped}
    differ = {
        k: (mine[k], theirs.get(k))
        for k in mine
        if mine[k] != theirs.get(k) and not any(k.startswith(u) for u in unmapped)
        and not k.startswith(("convergence", "limits", "fault", "backend", "data.", "xla.judge",
                              "measure", "num_devices", "model.preset"))
    }  # fmt: skip
    assert differ == {}
    assert back.remat.custom == config.remat.custom


# A value other than the default for each renamed knob outside the mesh, model and blocks
# (the variants change those, keeping the mesh and blocks valid).
CHANGED = {"seq_len": 256, "per_device_batch": 2.0, "steps": 40, "learning_rate": 1e-4,
           "weight_decay": 0.01, "grad_clip": 0.25, "mu_dtype": "bfloat16", "vocab_tiling": 2,
           "seed": 5, "remat.policy": "minimal"}  # fmt: skip


def test_each_renamed_knob_is_its_maxtext_key():
    """A change to one knob changes its MaxText key (the table is the mapping)."""
    before = to_maxtext(load_config(trial())).args
    assert set(CHANGED) == {k for k in RENAMED if not k.startswith(("mesh.", "model.", "kernels."))}
    for ours, value in CHANGED.items():
        section, _, name = ours.rpartition(".")
        update = {ours: value} if not section else {section: {name: value}}
        after = to_maxtext(load_config(trial(**update))).args
        assert after[RENAMED[ours]] != before[RENAMED[ours]], ours


def test_what_maxtext_cannot_take_is_listed_with_why():
    config = load_config(
        trial(
            "tiny-moe",
            precision={"mode": "fp8", "granularity": "per_tensor", "targets": "dense"},
            remat={"policy": "custom", "custom": {"moe_mlpwo": "device"}},
            num_devices=4,
        )
    )
    unmapped = {u.field: u.why for u in to_maxtext(config).unmapped}
    assert {"precision.granularity", "precision.targets", "remat.custom.moe_mlpwo",
            "num_devices", "data.source"} <= set(unmapped)  # fmt: skip
    assert all(why for why in unmapped.values())


@pytest.mark.parametrize("preset", ["tiny-moe", "mixtral-8x7b"])
def test_a_shared_expert_is_never_dropped_on_the_way_to_maxtext(preset):
    """A shared expert on an MoE shape, ours or one MaxText names (mixtral-8x7b has none):
    MaxText's program would lack it, so it is unmapped (the space refused), never dropped."""
    base = trial(preset)
    config = load_config({**base, "model": {**base["model"], "shared_experts": 1}})
    settings = to_maxtext(config)
    assert [u.field for u in settings.unmapped if u.field.startswith("model.")] == [
        "model.shared_experts"
    ]


def test_the_published_recipes_export_to_their_maxtext_names_and_flags():
    """Trial 0 of the 70B space is MaxText's llama3.1-70b with the recipe's knobs."""
    space = load_space("llama31_70b_8k_tpu7x")
    config = load_config({**assemble(space, space.search.warm_start[0]),
                          "compile_target": str(space.target)})  # fmt: skip
    settings = to_maxtext(config)
    args = settings.args
    assert args["model_name"] == "llama3.1-70b" and "base_emb_dim" not in args
    assert args["remat_policy"] == "custom" and args["decoder_layer_input"] == "device"
    assert args["attention"] == "flash" and args["sa_block_q"] == "2048"
    assert args["compile_topology"] == "tpu7x-128"
    assert "--xla_tpu_scoped_vmem_limit_kib=61440" in settings.libtpu_init_args
    assert load_config(from_maxtext(args, settings.libtpu_init_args)).compile_target == (
        "tpu7x:4x4x4"
    )


def test_a_multi_slice_target_is_maxtexts_slice_topology_and_slice_count():
    """tpu7x:4x4x4x2 is two 4x4x4 slices: MaxText compiles them as compile_topology tpu7x-128
    (one slice's devices) with compile_topology_num_slices 2."""
    config = load_config(trial("tiny-dense", compile_target="tpu7x:4x4x4x2", backend="tpu"))
    args = to_maxtext(config).args
    assert (args["compile_topology"], args["compile_topology_num_slices"]) == ("tpu7x-128", "2")
    assert load_config(from_maxtext(args)).compile_target == "tpu7x:4x4x4x2"


@pytest.mark.parametrize("name", [*VARIANTS, *MOE_VARIANTS])
def test_every_setting_is_a_key_maxtext_knows(name):
    """MaxText's config refuses unknown keys: every key the mapping writes is one of its
    base.yml (0.2.5's keys, kept as test data with the command that lists them)."""
    variant = {**VARIANTS, **MOE_VARIANTS}[name]
    rest = {k: v for k, v in variant.items() if k != "model"}
    config = trial("tiny-moe" if name in MOE_VARIANTS else "tiny-dense", **rest)
    args = to_maxtext(load_config(config)).args
    assert set(args) - BASE_KEYS == set()


def test_the_parity_benchmark_gives_maxtext_the_published_file_as_a_maxtext_trial_does():
    """One mapping: benchmarks.maxtext_parity compiles the published 8k recipe through MaxText
    with the settings the engine's MaxText program gives trial 0 of the shipped
    llama31_70b_8k_maxtext (the same file imported), so its figure and the sweep's are of one
    program; and that program keeps every setting of the published file but those the
    importer names as changed (the run's name, its output folder, its environment)."""
    from benchmarks.maxtext_parity import RECIPES, maxtext_settings
    from benchmarks.recipe_rows import imported
    from trainer.trial.maxtext import program_settings

    bench, target = maxtext_settings(RECIPES["8k"].published)
    space = load_space("search_spaces/llama31_70b_8k_maxtext.yaml")
    point = space.search.warm_start[0]
    config = TrialConfig.model_validate(
        {**assemble(space, point), "compile_target": str(space.target)}
    )
    program = program_settings(config, space.maxtext_program(), {})
    assert str(space.target) == target == "tpu7x:4x4x4"
    assert program.args == bench.args and program.libtpu_init_args == bench.libtpu_init_args
    command = imported(RECIPES["8k"].published)[0]
    dropped = {"run_name", "base_output_directory"}
    for key, value in command.settings.items():
        if key not in dropped:
            assert bench.args[key].lower() == str(value).lower(), key
    assert (
        bench.args["sa_q_layout"] == "SEQ_MINOR" and bench.args["compile_topology"] == "tpu7x-128"
    )


def test_a_named_model_passes_its_own_settings_as_maxtexts_model_config_has_them():
    """MaxText 0.2.5 refuses a command-line value for a key its model config also sets, with
    another value, unless `override_model_config` is set: its qwen3-235b-a22b.yml sets
    load_balance_loss_weight 0.001, and our 0.01 default made every trial of
    qwen3_235b_4k_maxtext `invalid_config` ("Keys ['load_balance_loss_weight'] are overridden
    by both model config and CLI/kwargs with different values"). The preset carries Qwen3's
    own coefficient; a trial that sets another is passed with the override."""
    space = load_space("spaces/qwen3_235b_4k_maxtext.yaml")
    recipe = to_maxtext(load_config(assemble(space, space.search.warm_start[0]))).args
    assert recipe["model_name"] == "qwen3-235b-a22b"
    assert recipe["load_balance_loss_weight"] == "0.001" and "override_model_config" not in recipe
    other = trial("qwen3-235b-a22b")
    other["model"]["load_balance_loss_weight"] = 0.01
    args = to_maxtext(load_config(other)).args
    assert args["override_model_config"] == "true" and args["load_balance_loss_weight"] == "0.01"
    assert "override_model_config" not in to_maxtext(load_config(trial("llama3.1-70b"))).args


def test_a_moe_model_maxtext_has_no_name_for_runs_in_a_block_with_routed_experts():
    """MaxText's default decoder block (llama2) has a dense MLP whatever num_experts says: a
    MoE model passed by its shape alone compiled as a dense model (no grouped matmul in
    MaxText's program). It is passed with Mixtral's block; a dense one keeps the default."""
    moe = to_maxtext(load_config(trial("tiny-moe"))).args
    assert moe["decoder_block"] == "mixtral" and moe["num_experts"] == "4"
    assert "decoder_block" not in to_maxtext(load_config(trial("tiny-dense"))).args
    named = to_maxtext(load_config(trial("qwen3-235b-a22b"))).args
    assert "decoder_block" not in named  # its model config names its own block (qwen3_moe)


def test_ragged_dot_on_tpu_takes_libtpus_ragged_dot_kernels_in_maxtext_too():
    """Our trainer runs moe_gmm ragged_dot on TPU as libtpu's ragged-dot kernels (every TPU
    trial sets RAGGED_DOT_KERNEL; libtpu 0.0.52 otherwise computes each expert matmul densely
    over all experts), so MaxText's settings for it carry the flag too; MaxText's kernels
    (tokamax, Megablox) do not, nor a dense model, nor a CPU run; and it does not come back
    as an extra flag of ours."""
    from trainer.trial.flags import RAGGED_DOT_KERNEL

    def flags(model: str, platform: str = "tpu", **kernels) -> list[str]:
        config = load_config(trial(model, kernels=kernels))
        return to_maxtext(config, platform).libtpu_init_args

    assert RAGGED_DOT_KERNEL in flags("tiny-moe", moe_gmm="ragged_dot")
    assert RAGGED_DOT_KERNEL in flags("tiny-moe", moe_gmm="auto")  # auto is ragged_dot on TPU
    for without in (flags("tiny-moe", moe_gmm="tokamax"), flags("tiny-moe", moe_gmm="megablox"),
                    flags("tiny-dense"), flags("tiny-moe", "cpu", moe_gmm="ragged_dot")):  # fmt: skip
        assert RAGGED_DOT_KERNEL not in without
    back = _round_trip(load_config(trial("tiny-moe", kernels={"moe_gmm": "ragged_dot"})))
    assert back.xla.extra == []


def test_tokamax_tiles_are_said_to_reach_no_maxtext_kernel_and_megablox_tiles_are_written():
    """MaxText 0.2.5's tokamax path takes no tiles (only its gmm v2 does, another kernel): a
    trial's tokamax tiles, set or tuned, are listed as not carried over, not written as
    settings MaxText would ignore; Megablox's tiles are MaxText's wi/wo tiles."""
    tokamax = load_config(trial("tiny-moe", **MOE_VARIANTS["tokamax tiles"]))
    settings = to_maxtext(tokamax)
    unmapped = {u.field: u.why for u in settings.unmapped}
    assert "use_gmm_v2" in unmapped["kernels.tokamax_tiles"]
    assert not any(k.startswith(("wi_tile", "wo_tile")) for k in settings.args)
    megablox = to_maxtext(
        load_config(trial("tiny-moe", kernels=MOE_VARIANTS["megablox"]["kernels"]))
    )
    assert megablox.args["wi_tile_fwd_batch_seq"] == "256" and megablox.args["megablox"] == "true"


def test_maxtexts_mesh_is_read_from_its_settings_within_and_across_slices():
    """MaxText's degrees as its settings make them: ici_* fill a slice (fsdp by default), dcn_*
    the slices (data by default); what check_shardable judges a model's width against."""
    from trainer.trial.maxtext_sharding import maxtext_degrees

    one = maxtext_degrees({"ici_fsdp_parallelism": "64", "ici_data_parallelism": "2"}, 128)
    assert (one["data"], one["fsdp"]) == (2, 64)
    assert maxtext_degrees({"ici_tensor_parallelism": "2"}, 128)["fsdp"] == 64  # fsdp fills
    two = maxtext_degrees({"dcn_data_parallelism": "2"}, 256, slices=2)
    assert (two["data"], two["fsdp"]) == (2, 128)  # each slice 128 fsdp, data across
    across = {"dcn_fsdp_parallelism": "2", "dcn_data_parallelism": "1"}
    assert maxtext_degrees(across, 256, slices=2)["fsdp"] == 256
    # gemma4-31b's published recipe: fsdp 16 x fsdp_transpose 8, both sharding the weights
    folded = {"ici_fsdp_parallelism": "16", "ici_fsdp_transpose_parallelism": "8"}
    assert maxtext_degrees(folded, 128)["fsdp"] == 128


def test_settings_are_read_as_maxtext_reads_them():
    """A command's settings read back as MaxText 0.2.5 runs them (layers/moe.py, its config):
    use_tokamax_gmm runs tokamax whatever megablox says, and its wi/wo tiles reach no kernel;
    megablox without tiles runs base.yml's (ours); a tensor's placement is read only under
    remat_policy=custom; fsdp_transpose shards as fsdp does. What the engine cannot read is
    a ConfigError naming the setting, never a KeyError or ValueError."""
    from trainer.trial.config import ConfigError

    def kernels(**args):
        return from_maxtext({k: str(v) for k, v in args.items()}).get("kernels", {})

    both = kernels(megablox=True, use_tokamax_gmm=True, wi_tile_fwd_batch_seq=256)
    assert both == {"moe_gmm": "tokamax"}  # the tile does nothing in tokamax v1
    assert kernels(megablox=True) == {"moe_gmm": "megablox"}  # base.yml's tiles, our defaults
    assert load_config(trial("tiny-moe", kernels={"moe_gmm": "megablox"})).kernels.gmm_tm == 512
    assert kernels(megablox=False, use_tokamax_gmm=False) == {"moe_gmm": "ragged_dot"}
    full = from_maxtext({"remat_policy": "full", "decoder_layer_input": "offload"})
    assert full["remat"] == {"policy": "full"}
    custom = from_maxtext({"remat_policy": "custom", "decoder_layer_input": "offload"})
    assert custom["remat"]["custom"] == {"decoder_layer_input": "offload"}
    folded = {"ici_fsdp_parallelism": "16", "ici_fsdp_transpose_parallelism": "8"}
    assert from_maxtext(folded)["mesh"] == {"fsdp": 128}
    assert from_maxtext({"ici_fsdp_transpose_parallelism": "2"})["mesh"].get("fsdp", -1) == -1
    for bad, field in (
        ({"per_device_batch_size": "two"}, "per_device_batch_size"),
        ({"megablox": "true", **dict.fromkeys(GMM_WI_FWD, "x")}, GMM_WI_FWD[0]),
        ({"attention": "paged"}, "attention"),
        ({"use_qwix_quantization": "true", "quantization": "int4"}, "quantization"),
        ({"compile_topology": "tpu7x-6"}, "compile_topology"),
    ):
        with pytest.raises(ConfigError) as caught:
            from_maxtext(bad)
        assert caught.value.field == field, caught.value


def test_the_parity_table_sets_each_compile_against_maxtexts_in_80_columns():
    """benchmarks.maxtext_parity's table: each row's memory against MaxText's row, fits by
    the target's usable HBM, a failed compile said, and 80 columns wide."""
    from rich.console import Console

    from benchmarks.maxtext_parity import RECIPES, memory_table

    theirs = RECIPES["8k"].recorded
    over = {**theirs, "temp": 95 * 2**30}
    table = memory_table("8k", "tpu7x:4x4x4", [
        ("ours: as published", "compile (this run)", {**theirs, "temp": theirs["temp"] - 2**30}),
        ("ours: over", "compile (this run)", over),
        ("ours: refused", "compile (this run)", {"status": "failed"}),
        ("MaxText 0.2.5", "compile (recorded)", theirs),
    ])  # fmt: skip
    columns = {c.header: list(c.cells) for c in table.columns}
    total = theirs["argument"] + theirs["temp"]
    assert columns["vs MaxText"][0] == f"{(total - 2**30) / total - 1:+.1%}" == "-1.2%"
    assert columns["fits"] == ["yes", "no", "failed", "yes"]
    console = Console(width=80, record=True)
    console.print(table)
    assert max(len(line) for line in console.export_text().splitlines()) <= 80


def test_a_boolean_flag_is_read_as_libtpu_reads_it_the_last_setting_counting():
    """Recipes write a boolean flag `=true`, `=True` or `=ENABLED`, or bare; libtpu reads the
    last setting (a compile with the layer scheduler set true, then false, kept what it keeps
    without it: benchmarks/data/floor_predictions.csv)."""
    from trainer.trial.flags import LAYER_SCHEDULER, flag_on

    for on in ("", "=true", "=True", "=ENABLED", "=1"):
        assert flag_on([f"{LAYER_SCHEDULER}{on}"], LAYER_SCHEDULER), on
    for off in ("=false", "=DISABLED", "=0"):
        assert not flag_on([f"{LAYER_SCHEDULER}{off}"], LAYER_SCHEDULER), off
    assert not flag_on([f"{LAYER_SCHEDULER}=true", f"{LAYER_SCHEDULER}=false"], LAYER_SCHEDULER)
    assert flag_on([f"{LAYER_SCHEDULER}=false", LAYER_SCHEDULER], LAYER_SCHEDULER)
    assert not flag_on([f"{LAYER_SCHEDULER}_x=true", "--xla_other=true"], LAYER_SCHEDULER)
