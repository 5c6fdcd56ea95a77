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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sweeper.space import shell
from sweeper.space.checks import check_maxtext_mesh
from sweeper.space.errors import SpaceError
from sweeper.space.maxtext_names import unknown_model, unknown_setting
from sweeper.space.points import set_path
from trainer.trial.checks import check_static
from trainer.trial.config import ConfigError, PrecisionConfig, TrialConfig, load_config
from trainer.trial.hardware import Topology
from trainer.trial.maxtext import (
    BASE_KEYS,
    CUSTOM_TENSORS,
    MODEL_NAMES,
    RENAMED,
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
    "output_dir": "no MaxText setting (0.2.5 refuses it: its config forbids unknown keys); an "
    "output folder, and the engine writes each trial in its own folder of the sweep",
}
# Grouped-matmul tiles MaxText 0.2.5 passes to no kernel when its tokamax path runs (v1).
TILE_PREFIXES = ("wi_tile_", "wo_tile_")
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
# A mesh axis of MaxText's that the engine's mesh folds into fsdp (trainer.trial.maxtext's
# _fold_mesh), so the estimate cannot tell it apart: benchmarks/data/floor_predictions.csv,
# ninth, and docs/calibration.md.
FSDP_TRANSPOSE = "ici_fsdp_transpose_parallelism"
# MaxText 0.2.5's model configs, the keys the engine reads of each (SHAPE_OF, UNMODELED and
# the MoE widths): the file says how to regenerate it from MaxText's configs/models/.
MODELS_FILE = Path(__file__).with_name("maxtext_0.2.5_models.yaml")
MODEL_KEYS = (
    *SHAPE_OF,
    *UNMODELED,
    "base_moe_mlp_dim",
    "shared_experts",
    "load_balance_loss_weight",
    "decoder_block",
)
# Activations as our model computes them (SwiGLU).
OUR_ACTIVATIONS = (["silu", "linear"],)
# An imported space's search: TPE over a few compile trials, one at a time, trial 0 first.
SEARCH = {"sampler": "tpe", "trials": 8, "concurrency": 1, "seed": 0, "trial_timeout_s": 7200}
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
    """The MaxText invocation in a shell command or script (the last one, if several), or in
    a Kubernetes manifest's containers (a JobSet, as tpu-recipes' k8s recipes are)."""
    manifest = _manifest(text)
    if manifest is not None:
        script, target = manifest
        found = _from_script(script, top=False)  # its lines are the manifest's block's
        found.target = found.target or target
    else:
        found = _from_script(text)
    found.text = text.strip()
    return found


def _from_script(text: str, top: bool = True) -> Command:
    try:
        script = shell.commands(text)
    except shell.ShellError as exc:
        raise SpaceError(
            f"the command does not read as a shell command: {exc.message}; close it",
            field="COMMAND",
            line=exc.line if top else None,  # else a line of a command inside the file's
        ) from None
    found: Command | None = None
    elsewhere: list[str] = []  # training programs other than MaxText's pre-training
    for command in script:
        words = command.words
        inner = _xpk_command(words)
        if inner is not None:
            try:
                found = _from_script(inner, top=False)  # xpk: the workload's own command
            except SpaceError as exc:
                if exc.field != "COMMAND" or "no MaxText" not in exc.message:
                    raise
                elsewhere.append(exc.message)
                continue
            found.target = found.target or _xpk_target(words)
            continue
        at = _maxtext_at(words)
        if at is not None:
            found = _invocation(words, at, command.env)
            continue
        other = _other_trainer(words)
        if other:
            elsewhere.append(other)
    if found is None:
        if elsewhere:
            raise SpaceError(
                f"{elsewhere[-1]}; sweeper import reads MaxText's pre-training commands "
                "(`python3 -m maxtext.trainers.pre_train.train CONFIG key=value ...`)",
                field="COMMAND",
            )
        raise SpaceError(
            "no MaxText training command found (`python3 -m MaxText.train CONFIG key=value ...`, "
            "`python3 -m maxtext.trainers.pre_train.train ...`, or an xpk workload's --command)",
            field="COMMAND",
        )
    return found


# MaxText's training entry points, as a module (`-m`) or a file, in its packaged layout
# (maxtext.trainers.pre_train.train), its older one (MaxText.train) or from a checkout (src.).
_MAXTEXT_MODULE = re.compile(r"(src\.)?(MaxText|maxtext)(\.[\w.]+)?\.train(_compile)?")
_MAXTEXT_FILE = re.compile(r"(^|/)(MaxText|maxtext)/([\w/]+/)?train(_compile)?\.py$")
_TRAINER = re.compile(r"([\w.]*?)\.?(train[\w]*)$")


def _maxtext_at(words: list[str]) -> int | None:
    """Where a MaxText training invocation starts in a command's words (at `-m` or its file)."""
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            return i if _MAXTEXT_MODULE.fullmatch(words[i + 1]) else None
        if _MAXTEXT_FILE.search(word):
            return i
    return None


def _other_trainer(words: list[str]) -> str:
    """A training program that is not MaxText's pre-training (MaxDiffusion, MaxText's RL), named."""
    for i, word in enumerate(words[:-1]):
        if word == "-m" and _TRAINER.search(words[i + 1]):
            module = words[i + 1]
            program = "MaxDiffusion" if "maxdiffusion" in module.lower() else "another program"
            if re.match(r"(src\.)?(MaxText|maxtext)\.", module):
                program = "MaxText, not its pre-training"
            return f"the command runs {module} ({program})"
    return ""


def _invocation(words: list[str], i: int, env: dict[str, str]) -> Command:
    module = words[i + 1] if words[i] == "-m" else words[i]
    rest = words[i + 2 if words[i] == "-m" else i + 1 :]
    if rest and not _SETTING.match(rest[0]) and not rest[0].startswith("--"):
        rest = rest[1:]  # its config file (base.yml, as a path or as a $(...) that prints one)
    settings: dict[str, str] = {}
    for word in rest:
        match = _SETTING.match(word)
        if match:
            settings[match.group(1)] = match.group(2)
        elif word.startswith("--"):
            continue  # an absl flag of the process (e.g. --tokamax_cross_compile)
        else:
            raise SpaceError(
                f"{word!r} after MaxText's config file is not a key=value setting; remove it, "
                "or write it as key=value",
                field="COMMAND",
            )
    changes = [
        f"{name}={value} not carried over: the engine sets each trial's environment"
        for name, value in env.items()
        if name not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")
    ]
    return Command(
        settings=settings,
        libtpu_init_args=env.get("LIBTPU_INIT_ARGS", "").split(),
        xla_flags=env.get("XLA_FLAGS", "").split(),
        module=module,
        changes=changes,
    )


def _xpk_command(words: list[str]) -> str | None:
    """An xpk workload's own command (`--command "..."` or `--command=...`), if it is one."""
    for i, word in enumerate(words):
        if word == "--command" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--command="):
            return word.removeprefix("--command=")
    return None


def _xpk_target(words: list[str]) -> str | None:
    """An xpk workload's topology (`--tpu-type=tpu7x-4x4x4` or `tpu7x-128`, `--num-slices`)."""
    kind, slices = None, 1
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if not value and i + 1 < len(words):
            value = words[i + 1]
        if name in ("--tpu-type", "--device-type"):
            kind = value
        elif name == "--num-slices" and value.isdigit():
            slices = int(value)
    if kind is None:
        return None
    return _slice_target(kind, slices)


def _slice_target(kind: str, slices: int) -> str | None:
    """tpu7x-4x4x4 or tpu7x-128 (a device count), over `slices` slices, as our target."""
    prefix, _, shape = kind.rpartition("-")
    if not prefix or not re.fullmatch(r"\d+(x\d+)*", shape):
        return None
    try:
        base = slice_target(prefix, int(shape)) if "x" not in shape else f"{prefix}:{shape}"
    except ValueError:
        return None  # no TPU of that name, or no slice of that many devices: --target says it
    return base + (f"x{slices}" if slices > 1 else "")


def _manifest(text: str) -> tuple[str, str | None] | None:
    """A Kubernetes manifest's training script (its containers' `bash -c` script, or their
    command and args) and its TPU topology (the node selector's accelerator and topology, one
    slice per replica); None when the text is no manifest."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except yaml.YAMLError:
        return None
    documents = [d for d in documents if "apiVersion" in d and "kind" in d]
    if not documents:
        return None
    scripts: list[str] = []
    kind = shape = None
    slices = 1
    for node in _walk(documents):
        if "containers" in node and isinstance(node["containers"], list):
            for container in node["containers"]:
                if isinstance(container, dict):
                    scripts.append(_container_script(container))
        kind = node.get("cloud.google.com/gke-tpu-accelerator", kind)  # a node selector
        for key in ("cloud.google.com/gke-tpu-topology", "cloud.google.com/gke-tpu-slice-topology"):
            shape = node.get(key, shape)  # a node selector, or the pod's annotation
        if isinstance(node.get("replicas"), int) and "template" in node:
            slices = max(slices, node["replicas"])
    if not any(scripts):
        raise SpaceError(
            "the manifest's containers run no command (no `command:` or `args:`)", field="COMMAND"
        )
    target = f"{kind}:{shape}" + (f"x{slices}" if slices > 1 else "") if kind and shape else None
    found = [s for s in scripts if _maxtext_in(s)]
    if len({_settings_of(s) for s in found}) > 1:
        raise SpaceError(
            f"the manifest's containers run {len(found)} different MaxText commands; import "
            "one of them (as a command)",
            field="COMMAND",
        )
    return (found or scripts)[0], target


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping in a YAML document, outermost first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _container_script(container: dict[str, Any]) -> str:
    words = [str(w) for key in ("command", "args") for w in container.get(key) or []]
    if len(words) >= 3 and words[0].rsplit("/", 1)[-1] in ("bash", "sh") and words[1] == "-c":
        return words[2]
    return shlex.join(words)


def _maxtext_in(script: str) -> bool:
    try:
        return any(_maxtext_at(c.words) is not None for c in shell.commands(script))
    except shell.ShellError:
        return False


def _settings_of(script: str) -> str:
    try:
        command = _from_script(script)
    except SpaceError as exc:
        return str(exc)
    return repr((command.settings, command.libtpu_init_args))


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
            raise SpaceError(f"{key}={value} is {unknown_setting(key)}", field=key)
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
    command.changes += _inert(settings)
    if command.xla_flags:
        command.changes.append(
            f"XLA_FLAGS ({' '.join(command.xla_flags)}) read as compiler flags, with "
            "LIBTPU_INIT_ARGS (libtpu reads both)"
        )
        command.libtpu_init_args = [*command.libtpu_init_args, *command.xla_flags]


def _inert(settings: dict[str, str]) -> list[str]:
    """Settings the command gives that MaxText 0.2.5 reads nothing of, given its others: kept
    as written (trial 0 is the command), and said."""
    said = []
    policy = settings.get("remat_policy", "full")  # base.yml's default
    placed = [k for k in CUSTOM_TENSORS if k in settings]
    if placed and policy != "custom":
        said.append(
            f"{', '.join(f'{k}={settings[k]}' for k in placed)} kept as written; "
            f"{'it does' if len(placed) == 1 else 'they do'} nothing: MaxText reads a tensor's "
            f"placement only with remat_policy=custom (this command's: {policy})"
        )
    tiles = [k for k in settings if k.startswith(TILE_PREFIXES)]
    tokamax = _true(settings.get("use_tokamax_gmm", "false"))
    if tiles and tokamax and not _true(settings.get("use_gmm_v2", "false")):
        said.append(
            f"{len(tiles)} grouped-matmul tiles ({tiles[0]}, ...) kept as written; they do "
            "nothing: MaxText 0.2.5's tokamax grouped matmul (use_tokamax_gmm, use_gmm_v2 false) "
            "takes no tiles"
        )
    return said


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
    if "model_name" not in settings:
        raise SpaceError(
            "the command names no model: MaxText's default is its base.yml's own shape, which "
            "the importer does not read; add model_name=NAME (one of MaxText 0.2.5's "
            f"{len(models)} models, e.g. llama3.1-8b)",
            field="model_name",
        )
    if name not in models:
        raise SpaceError(f"model_name={name}: {unknown_model(name, models)}", field="model_name")
    config = {**models[name], **settings}

    def number(key: str, parse: type[int] | type[float] = int, default: Any = None) -> Any:
        try:
            return parse(config[key]) if key in config else default
        except (TypeError, ValueError):
            what = "a whole number" if parse is int else "a number"
            raise SpaceError(
                f"{key}={config[key]} is not {what}; write it as one", field=key
            ) from None

    shape: dict[str, Any] = {}
    for theirs, ours in SHAPE_OF.items():
        if theirs in config:
            shape[ours] = number(theirs)
    if number("num_experts", default=1) > 1:
        dense_mlp = shape.get("mlp_dim", 0)
        shape["mlp_dim"] = number("base_moe_mlp_dim", default=dense_mlp)
        if number("shared_experts", default=0):
            shape["shared_experts"] = number("shared_experts")
            # MaxText sizes a shared expert by moe_mlp_dim, but gemma4's by mlp_dim
            # (maxtext_utils.get_shared_expert_mlp_dim)
            if config.get("decoder_block") == "gemma4" and dense_mlp != shape["mlp_dim"]:
                shape["shared_mlp_dim"] = dense_mlp
        if "load_balance_loss_weight" in config:
            shape["load_balance_loss_weight"] = number("load_balance_loss_weight", float)
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
        "trial": {
            k: v
            for k, v in recipe.trial.items()
            if k != "model" and not (k == "precision" and "precision.mode" in knobs)
        },
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
    transpose = command.settings.get(FSDP_TRANSPOSE, "1").strip()
    if transpose != "1":
        unmodeled.append(
            f"{FSDP_TRANSPOSE}={transpose}: read as fsdp, where MaxText shards weights and "
            "gradients otherwise (deepseek-v3 on 128 chips needs 42 GiB more with 2)"
        )
    try:
        trial = from_maxtext(command.settings, command.libtpu_init_args)
    except ConfigError as exc:
        raise SpaceError(exc.message, field=exc.field) from None
    trial.pop("compile_target", None)
    trial.pop("backend", None)
    trial["model"] = {**model, **{k: v for k, v in trial.get("model", {}).items() if k != "preset"}}
    try:
        config = load_config(trial)
    except ConfigError as exc:
        setting = RENAMED.get(exc.field)  # the command's own name for it, where it has one
        raise SpaceError(
            f"the command's settings make no valid trial: {exc}",
            field=setting if setting in command.settings else "COMMAND",
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
    # A point whose precision the mode knob sets carries none of the command's fp8 settings
    # (bf16 reads none): they are knobs active with fp8 (space_of leaves them out of `trial`).
    unset = {**base, "precision": {"mode": config.precision.mode}}

    def valid(key: str, value: Any, when: dict[str, Any]) -> bool:
        tree = unset if key == "precision.mode" or "precision.mode" in when else base
        return _makes_a_trial(tree, {**when, key: value}, program, topology)

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
            # the layer's input stays on device placed `remat` (the checkpoint's input): a
            # trial there would compile `device` again (trainer.estimate.analytic._placed)
            places = (
                ["device", "offload"]
                if tensor == "decoder_layer_input"
                else ["device", "offload", "remat"]
            )
            vary(f"remat.custom.{tensor}", place, places)
    else:
        vary("remat.policy", config.remat.policy, ["full", "save_dot_except_mlp", "minimal"])
    precision = config.precision
    vary("precision.mode", precision.mode, ["bf16", "fp8"])
    fp8 = {"precision.mode": "fp8"} if "precision.mode" in knobs else {}
    if fp8 or precision.mode == "fp8":
        # MaxText's qwix fp8 scales per axis, its only granularity: an fp8 trial is set so
        vary("precision.granularity", "per_axis", [], fp8, one=bool(fp8))
        vary("precision.scaling", precision.scaling, ["dynamic", "fixed"], fp8, one=bool(fp8))
        defaults = PrecisionConfig(mode="fp8").model_dump(mode="json")
        for name, value in precision.model_dump(mode="json").items():
            if fp8 and name not in ("mode", "granularity", "scaling") and value != defaults[name]:
                vary(f"precision.{name}", value, [], fp8, one=True)  # the command's, kept
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


def load_text(spec: str) -> tuple[str, Path | None]:
    """A command given as a file (a script, a manifest) or as text: its text, and the file.
    A word that can only be a file's name and names none is refused, as is an empty one."""
    if not spec.strip():
        raise SpaceError(
            "the command is empty: give a MaxText command, or a file holding one", field="COMMAND"
        )
    one_word = len(spec) < 4096 and not any(c.isspace() for c in spec)
    path = Path(spec)
    if one_word and path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpaceError(f"{spec}: cannot read it as text ({exc})", field="COMMAND") from None
        if not text.strip():
            raise SpaceError(
                f"{spec} is empty: it should hold a MaxText command (a run_recipe.sh, an xpk "
                "workload command, a Kubernetes manifest)",
                field="COMMAND",
            )
        return text, path
    if one_word and path.exists():
        raise SpaceError(
            f"{spec} is not a file: give the file holding the command", field="COMMAND"
        )
    if one_word and "=" not in spec:
        raise SpaceError(
            f"no such file: {spec} (give a MaxText command, quoted, or a file holding one)",
            field="COMMAND",
        )
    return spec, None


def where(exc: SpaceError, text: str, source: Path | None) -> str:
    """An import error as a person reads it: the file and line (the first line that sets the
    setting it names, or where the shell could not read on), the setting, what and the fix."""
    field = exc.field if exc.field not in (None, "COMMAND") else None
    line = exc.line
    if field and not field.startswith("--"):
        pattern = re.compile(rf"(?<![\w.-]){re.escape(field)}=")
        line = next((n for n, ln in enumerate(text.splitlines(), 1) if pattern.search(ln)), line)
    said = f"{field}: {exc.message}" if field else exc.message
    if source is None or (field or "").startswith("--"):
        return said
    return f"{source}{f':{line}' if line else ''}: {said}"
