"""A MaxText command read into a space (`sweeper import`): the command as typed, a tpu-recipes
`run_recipe.sh` or an xpk workload command, with its LIBTPU_INIT_ARGS and XLA_FLAGS. The
space's trial 0 is that command; its knobs are the guide's levers around it, each holding the
command's value. Every setting is kept (the recipe record, `maxtext.recipe`); one MaxText 0.2.5
does not know is refused by name, one it renamed is translated, one it constrains otherwise
is named."""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sweeper.space.checks import check_maxtext_mesh
from sweeper.space.errors import SpaceError
from sweeper.space.points import set_path
from trainer.trial.checks import check_static
from trainer.trial.config import ConfigError, TrialConfig, load_config
from trainer.trial.hardware import Topology
from trainer.trial.maxtext import (
    BASE_KEYS,
    MODEL_NAMES,
    MaxTextProgram,
    MaxTextRecipe,
    from_maxtext,
    slice_target,
)

# Settings whose name changed between the recipes' MaxText and 0.2.5, meaning unchanged.
RENAMED_IN_025 = {"fsdp_shard_on_exp": "shard_exp_on_fsdp"}
# The command's settings a mesh refusal names (the engine's mesh fields, as MaxText's keys).
MESH_SETTINGS = {
    "mesh.fsdp": "ici_fsdp_parallelism",
    "mesh.expert": "ici_expert_parallelism",
    "mesh.context": "ici_context_parallelism",
    "mesh.tensor": "ici_tensor_parallelism",
}
# Settings the engine sets for each trial itself (its name, and its folder in the sweep).
ENGINE_SETS = {
    "run_name": "the engine names each trial's run",
    "base_output_directory": "the engine writes each trial in its own folder of the sweep",
}
# MaxText's model configs (its package's configs/models/NAME.yml) -> our shape.
SHAPE_OF = {
    "base_emb_dim": "d_model",
    "base_num_decoder_layers": "num_layers",
    "base_num_query_heads": "num_heads",
    "base_num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "base_mlp_dim": "mlp_dim",
    "vocab_size": "vocab_size",
    "num_experts": "num_experts",
    "num_experts_per_tok": "experts_per_token",
}
# A model config's features the engine's estimate does not model, and what each is.
UNMODELED = {
    "attention_type": "attention of kind {}",
    "q_lora_rank": "low-rank queries (MLA, rank {})",
    "kv_lora_rank": "low-rank keys and values (MLA, rank {})",
    "shared_experts": "{} shared expert(s)",
    "first_num_dense_layers": "{} dense first layer(s)",
    "sliding_window_size": "sliding-window attention ({} tokens)",
    "global_head_dim": "global layers' head width {}",
    "use_sinks": "attention sinks",
    "share_kv_projections": "keys and values from one projection",
    "mlp_activations": "MLP activations {}",
    "final_logits_soft_cap": "logit soft-capping ({})",
    "attention_sink": "attention sinks",
    "attention_bias": "biases in attention's projections",
    "inhomogeneous_layer_cycle_interval": "layers alternating every {} (e.g. sliding and full)",
}
# MaxText 0.2.5's model configs, the keys the engine reads of each (SHAPE_OF, UNMODELED and
# the MoE widths): the file says how to regenerate it from MaxText's configs/models/.
MODELS_FILE = Path(__file__).with_name("maxtext_0.2.5_models.yaml")
MODEL_KEYS = (
    *SHAPE_OF,
    *UNMODELED,
    "base_moe_mlp_dim",
    "load_balance_loss_weight",
    "decoder_block",
)
# Activations as our model computes them (SwiGLU).
OUR_ACTIVATIONS = (["silu", "linear"],)
# An imported space's search: TPE over a few compile trials, one at a time, trial 0 first.
SEARCH = {"sampler": "tpe", "trials": 8, "concurrency": 1, "seed": 0, "trial_timeout_s": 7200}
_ENV = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$", re.S)
_SETTING = re.compile(r"^([a-z_][a-z0-9_]*)=(.*)$", re.S)


@dataclass
class Command:
    """A MaxText command, read: its settings in order, its LIBTPU flags, and where it runs."""

    settings: dict[str, str]
    libtpu_init_args: list[str]
    xla_flags: list[str]
    module: str
    target: str | None = None  # from xpk's --tpu-type / --device-type and --num-slices
    text: str = ""
    changes: list[str] = field(default_factory=list)


def read_command(text: str) -> Command:
    """The MaxText invocation in a shell command or script (the last one, if several)."""
    joined = re.sub(r"\\\r?\n", " ", text)
    lines = [ln for ln in joined.splitlines() if not ln.lstrip().startswith("#")]
    try:  # `;`, `&&` and `|` end a command even unspaced (`export A=1;python3 ...`)
        lexer = shlex.shlex("\n".join(lines), posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError as exc:
        raise SpaceError(
            f"the command does not parse as a shell line ({exc})", field="COMMAND"
        ) from None
    env: dict[str, str] = {}
    found: Command | None = None
    target = _xpk_target(tokens)
    for i, token in enumerate(tokens):
        if token in ("--command", "--command=") and i + 1 < len(tokens):
            found = read_command(tokens[i + 1])  # xpk: the workload's own command
            break
        if token.startswith("--command="):
            found = read_command(token.removeprefix("--command="))
            break
        match = _ENV.match(token)
        if match:
            env[match.group(1)] = match.group(2)
            continue
        if _is_maxtext(tokens, i):
            found = _invocation(tokens, i, env)
            found.changes += [
                f"{name}={value} not carried over: the engine sets each trial's environment"
                for name, value in env.items()
                if name not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")
            ]
    if found is None:
        raise SpaceError(
            "no MaxText training command found (`python3 -m MaxText.train CONFIG key=value ...`, "
            "`python3 -m maxtext.trainers.pre_train.train ...`, or an xpk workload's --command)",
            field="COMMAND",
        )
    found.target = found.target or target
    found.text = text.strip()
    return found


def _is_maxtext(tokens: list[str], i: int) -> bool:
    token = tokens[i]
    module = tokens[i + 1] if token == "-m" and i + 1 < len(tokens) else ""
    trains = re.fullmatch(r"(MaxText|maxtext)(\.[\w.]+)?\.train(_compile)?", module)
    return bool(trains) or bool(re.search(r"(MaxText|maxtext)/train(_compile)?\.py$", token))


def _invocation(tokens: list[str], i: int, env: dict[str, str]) -> Command:
    module = tokens[i + 1] if tokens[i] == "-m" else tokens[i]
    rest = tokens[i + 2 if tokens[i] == "-m" else i + 1 :]
    if rest and not _SETTING.match(rest[0]) and not rest[0].startswith("--"):
        rest = rest[1:]  # its config file (base.yml, as a path or as a $(...) that prints one)
    settings: dict[str, str] = {}
    for token in rest:
        match = _SETTING.match(token)
        if match:
            settings[match.group(1)] = match.group(2)
        elif token.startswith("--"):
            continue  # an absl flag of the process (e.g. --tokamax_cross_compile)
        else:
            break  # the command's end (`;`, `&&`, another program)
    return Command(
        settings=settings,
        libtpu_init_args=env.get("LIBTPU_INIT_ARGS", "").split(),
        xla_flags=env.get("XLA_FLAGS", "").split(),
        module=module,
    )


def _xpk_target(tokens: list[str]) -> str | None:
    """An xpk workload's topology (`--tpu-type=tpu7x-4x4x4` or `tpu7x-128`, `--num-slices`)."""
    kind, slices = None, 1
    for i, token in enumerate(tokens):
        name, _, value = token.partition("=")
        if not value and i + 1 < len(tokens):
            value = tokens[i + 1]
        if name in ("--tpu-type", "--device-type"):
            kind = value
        elif name == "--num-slices" and value.isdigit():
            slices = int(value)
    if kind is None:
        return None
    prefix, _, shape = kind.rpartition("-")
    if not re.fullmatch(r"\d+(x\d+)*", shape):
        return None
    # a device count (tpu7x-128) or a shape (tpu7x-4x4x4)
    base = slice_target(prefix, int(shape)) if "x" not in shape else f"{prefix}:{shape}"
    return base + (f"x{slices}" if slices > 1 else "")


def translate(command: Command) -> None:
    """Settings as MaxText 0.2.5 takes them: renamed keys translated, the engine's own dropped,
    constraints 0.2.5 adds applied and named; an unknown key refused by name."""
    settings: dict[str, str] = {}
    for key, value in command.settings.items():
        if key in RENAMED_IN_025:
            new = RENAMED_IN_025[key]
            command.changes.append(f"{key}={value} is {new}={value} in MaxText 0.2.5 (renamed)")
            key = new
        if key in ENGINE_SETS:
            command.changes.append(f"{key}={value} dropped: {ENGINE_SETS[key]}")
            continue
        if key not in BASE_KEYS:
            raise SpaceError(
                f"{key}={value} is not a MaxText 0.2.5 setting (its configs/base.yml keys); "
                "remove it, or correct its name",
                field=key,
            )
        settings[key] = value
    expert = settings.get("ici_expert_parallelism", "1")
    if _true(settings.get("use_random_routing", "false")) and expert in ("1", ""):
        del settings["use_random_routing"]
        command.changes.append(
            "use_random_routing dropped: MaxText 0.2.5 refuses it when ici_expert_parallelism is "
            "1 ('When EP rank is 1, use_random_routing must be False'); it changes which tokens "
            "each expert gets, not the program's shapes"
        )
    command.settings = settings
    if command.xla_flags:
        command.changes.append(
            f"XLA_FLAGS ({' '.join(command.xla_flags)}) read as compiler flags, with "
            "LIBTPU_INIT_ARGS (libtpu reads both)"
        )
        command.libtpu_init_args = [*command.libtpu_init_args, *command.xla_flags]


def _true(text: str) -> bool:
    return text.strip().lower() == "true"


def maxtext_models() -> dict[str, dict[str, Any]]:
    """MaxText 0.2.5's models by name: the keys of each config the engine reads."""
    return dict(yaml.safe_load(MODELS_FILE.read_text()))


def distill_models(folder: Path) -> dict[str, dict[str, Any]]:
    """The models file's content from MaxText's configs/models/ folder."""
    models = {}
    for path in sorted(folder.glob("*.yml")):
        config = yaml.safe_load(path.read_text()) or {}
        models[path.stem] = {k: config[k] for k in MODEL_KEYS if k in config}
    return models


def model_of(settings: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The model of record: a preset where we have MaxText's model, else the shape MaxText's
    own config gives (its model file, with the command's base_* overrides), and the features
    of it the estimate does not model."""
    name = settings.get("model_name", "default")
    preset = next((ours for ours, theirs in MODEL_NAMES.items() if theirs == name), None)
    if preset is not None and not any(k in settings for k in SHAPE_OF):
        return {"preset": preset}, []
    models = maxtext_models()
    if name not in models:
        raise SpaceError(
            f"model_name={name}: MaxText 0.2.5 has no such model (its models: "
            f"{', '.join(sorted(models))})",
            field="model_name",
        )
    config = {**models[name], **settings}
    shape: dict[str, Any] = {}
    for theirs, ours in SHAPE_OF.items():
        if theirs in config:
            shape[ours] = int(config[theirs])
    if int(config.get("num_experts", 1)) > 1:
        shape["mlp_dim"] = int(config.get("base_moe_mlp_dim", shape.get("mlp_dim", 0)))
        if "load_balance_loss_weight" in config:
            shape["load_balance_loss_weight"] = float(config["load_balance_loss_weight"])
    else:
        shape.update(num_experts=0, experts_per_token=0)
    if "head_dim" not in shape and "d_model" in shape and "num_heads" in shape:
        shape["head_dim"] = shape["d_model"] // shape["num_heads"]
    unmodeled = []
    for key, what in UNMODELED.items():
        value = config.get(key)
        if value in (None, False, 0, "", "mha", "global") or (
            key == "mlp_activations" and list(value) in OUR_ACTIVATIONS
        ):
            continue
        unmodeled.append(f"{key}={value}: {what.format(value)}")
    return shape, unmodeled


def space_of(
    command: Command,
    name: str,
    target: str | None = None,
) -> dict[str, Any]:
    """The space a command makes: program maxtext, compile fidelity on its topology, trial 0
    the command (its recipe record), knobs around its values."""
    translate(command)
    topology = _topology(target or command.target)
    recipe = recipe_of(command)
    config = recipe.config()
    program = MaxTextProgram(recipe=recipe)  # as the space's trials will run it
    try:  # the command itself: a mesh MaxText cannot shard fails every trial of the space
        shardable(config, program, topology)
    except ConfigError as exc:
        raise SpaceError(
            f"the command cannot run on {topology.target} ({topology.devices} devices): "
            f"{exc.message}",
            field=MESH_SETTINGS.get(exc.field, exc.field),
        ) from None
    knobs, start = knobs_around(config, command.settings, topology, program)
    return {
        "name": name,
        "description": (
            f"{command.settings.get('model_name', 'a model')} at "
            f"{config.seq_len} on {topology.target} through MaxText, from its command "
            "(sweeper import)"
        ),
        "target": topology.target,
        "fidelity": "compile",
        "program": "maxtext",
        "model": recipe.trial["model"],
        "trial": {k: v for k, v in recipe.trial.items() if k != "model"},
        "search": {**SEARCH, "warm_start": [start]},
        "knobs": knobs,
        "maxtext": {"recipe": recipe.model_dump(mode="json", exclude_defaults=True)},
    }


def _topology(chosen: str | None) -> Topology:
    if chosen is None:
        raise SpaceError(
            "the command does not say its topology: give --target (e.g. tpu7x:4x4x4)",
            field="--target",
        )
    try:
        return Topology.parse(chosen)
    except ValueError as exc:
        raise SpaceError(str(exc), field="--target") from None


def recipe_of(command: Command) -> MaxTextRecipe:
    """The command's recipe record: its settings and flags as written, and the trial they
    read as (the model of record: a preset, or MaxText's config's shape)."""
    model, unmodeled = model_of(command.settings)
    trial = from_maxtext(command.settings, command.libtpu_init_args)
    trial.pop("compile_target", None)
    trial.pop("backend", None)
    trial["model"] = {**model, **{k: v for k, v in trial.get("model", {}).items() if k != "preset"}}
    try:
        config = load_config(trial)
    except ConfigError as exc:
        raise SpaceError(
            f"the command's settings make no valid trial: {exc}", field="COMMAND"
        ) from None
    recorded = config.model_dump(mode="json", exclude_defaults=True)
    if "preset" in model:  # the preset says the shape: kept as the command said it
        recorded["model"] = trial["model"]
    return MaxTextRecipe(
        command=command.text,
        settings=command.settings,
        libtpu_init_args=command.libtpu_init_args,
        trial=recorded,
        changes=command.changes,
        unmodeled=unmodeled,
    )


def knobs_around(
    config: TrialConfig,
    settings: dict[str, str],
    topology: Topology,
    program: MaxTextProgram,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The guide's levers around the command's values, each holding it and only values that
    make a valid trial, and trial 0's point (every active knob at the command's value)."""
    knobs: dict[str, dict[str, Any]] = {}
    start: dict[str, Any] = {}
    base = config.model_dump(mode="json")

    def valid(key: str, value: Any, when: dict[str, Any]) -> bool:
        return _makes_a_trial(base, {**when, key: value}, program, topology)

    def vary(
        key: str, at: Any, values: list[Any], when: dict[str, Any] | None = None, one: bool = False
    ) -> None:
        when = when or {}
        ordered = [at, *(v for v in dict.fromkeys(values) if v != at and valid(key, v, when))]
        if len(ordered) < 2 and not one:
            return
        knobs[key] = {"values": ordered} | ({"when": when} if when else {})
        if all(start.get(k, _get(base, k)) == v for k, v in when.items()):
            start[key] = at  # active at the command's values: trial 0 holds its value

    batch = config.per_device_batch
    doubled = [int(b) if float(b).is_integer() else b for b in (batch / 2, batch * 2) if b >= 1]
    vary("per_device_batch", int(batch) if float(batch).is_integer() else batch, doubled)
    if config.remat.policy == "custom":
        for tensor, place in config.remat.custom.items():
            vary(f"remat.custom.{tensor}", place, ["device", "offload", "remat"])
    else:
        vary("remat.policy", config.remat.policy, ["full", "save_dot_except_mlp", "minimal"])
    precision = config.precision
    vary("precision.mode", precision.mode, ["bf16", "fp8"])
    fp8 = {"precision.mode": "fp8"}
    # MaxText's qwix fp8 scales per axis, its only granularity: an fp8 trial is set so
    vary("precision.granularity", "per_axis", [], fp8, one=True)
    vary("precision.scaling", precision.scaling, ["dynamic", "fixed"], fp8)
    kernels = config.kernels
    if kernels.attention == "splash":
        for layout in ("q_layout", "k_layout"):
            vary(f"kernels.{layout}", getattr(kernels, layout), ["head_dim_minor", "seq_minor"])
        for block in ("block_q", "block_kv"):
            size = getattr(kernels, block)
            if f"sa_{block}" in settings and size:
                vary(f"kernels.{block}", size, [size // 2, size * 2])
    vmem = config.xla.scoped_vmem_kib
    if vmem is not None:  # the libtpu default (unset) is no value a knob can hold
        vary("xla.scoped_vmem_kib", vmem, [49152, 65536, 98304])
    mesh = config.mesh
    if topology.chips > 1:
        vary("mesh.tensor", mesh.tensor, [1, 2])
        if config.model.is_moe:
            vary("mesh.expert", mesh.expert, [1, 2, 4])
    return knobs, start


def _makes_a_trial(
    base: dict[str, Any], values: dict[str, Any], program: MaxTextProgram, topology: Topology
) -> bool:
    trial = copy.deepcopy(base)
    for dotted, value in values.items():
        set_path(trial, dotted, value)
    try:
        shardable(load_config(trial), program, topology)
    except ConfigError:
        return False
    return True


def shardable(config: TrialConfig, program: MaxTextProgram, topology: Topology) -> None:
    """The trial's checks on the topology (batch, sequence, kernels) and its mesh, as MaxText
    makes it of the program's settings (a space's static_check, on the command's recipe), one
    MaxText can shard the model over; raises ConfigError."""
    check_static(config, topology.devices)
    check_maxtext_mesh(config, program, {}, topology.devices, topology.slices)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def load_text(spec: str) -> str:
    """A command given as a file (a script) or as text."""
    path = Path(spec)
    if len(spec) < 4096 and "\n" not in spec and path.is_file():
        return path.read_text()
    return spec
