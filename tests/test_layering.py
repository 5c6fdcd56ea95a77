"""The layout holds: the engine stays light (no JAX, only the trainer's JAX-free folders),
each trainer folder imports only the folders `trainer.LAYERS` names, each engine folder only
those `sweeper.LAYERS` names, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import sweeper
from tests.helpers import REPO
from trainer import JAX_FREE, LAYERS

HEAVY = ("jax", "jaxlib", "flax", "optax", "qwix", "tokamax")
PACKAGES = ("trainer", "sweeper")


def _loaded_after(imports: str) -> list[str]:
    code = (
        f"import importlib, json, pkgutil, sys\n{imports}\n"
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {(*HEAVY, 'trainer')!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


def _jax_free(module: str) -> bool:
    return module == "trainer" or _folder(module) in JAX_FREE


def _modules(package: str) -> dict[str, Path]:
    root = REPO / package
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = {m: p for package in PACKAGES for m, p in _modules(package).items()}


def _imports(path: Path) -> set[str]:
    """Project modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES}


def _folder(module: str) -> str:
    """The folder of its package a module is in ("top" for trainer/cli.py and its like)."""
    parts = module.split(".")
    package = len(parts) == 2 and MODULES[module].name == "__init__.py"
    return parts[1] if len(parts) > 2 or package else "top"


def test_every_sweeper_module_imports_without_jax():
    loaded = _loaded_after(
        "import sweeper\n"
        "for m in pkgutil.walk_packages(sweeper.__path__, 'sweeper.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)"
    )
    assert [m for m in loaded if not m.startswith("trainer")] == []
    assert "trainer.trial.events" in loaded  # the protocol is shared, not copied
    assert all(_jax_free(m) for m in loaded), [m for m in loaded if not _jax_free(m)]


def test_a_dense_bf16_trial_builds_its_program_without_tokamax_or_qwix():
    """tokamax takes 1.8 s to import and qwix 0.4 s: a trial whose program runs neither (XLA
    attention and experts, bf16) traces its step without them, where each trial paid both."""
    loaded = _loaded_after(
        "import os\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import jax\n"
        "from trainer.program.build import build_program\n"
        "from trainer.trial.config import load_config\n"
        "config = load_config({'model': {'preset': 'tiny-moe'}, 'seq_len': 32, 'steps': 1,\n"
        "                      'kernels': {'attention': 'xla', 'moe_gmm': 'ragged_dot'}})\n"
        "program = build_program(config, jax.devices()[:1])\n"
        "program.step_fn.trace(program.abstract_state, *[jax.ShapeDtypeStruct((1, 32), 'int32')] * 3)"
    )
    assert "trainer.model.moe" in loaded and "trainer.program.build" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("tokamax", "qwix")] == []


def test_a_trials_actor_starts_without_mlflow():
    """Each trial's Tune actor imports its trainable: 3.2 s with MLflow's 0.8-1.1 s behind a
    constant, where the driver records to MLflow and the actor never does."""
    code = "import sys, sweeper.execute.trainable; print('mlflow' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.stdout.split() == ["False"], proc.stderr[-2000:]


def test_the_trainers_jax_free_folders_are_so():
    free = [m for m in MODULES if m.startswith("trainer.") and _jax_free(m)]
    assert {_folder(m) for m in free} == set(JAX_FREE)
    loaded = _loaded_after("\n".join(f"import {m}" for m in free))
    assert [m for m in loaded if not m.startswith("trainer")] == []
    assert all(_jax_free(m) for m in loaded), [m for m in loaded if not _jax_free(m)]


def test_each_trainer_folder_imports_only_the_folders_below_it():
    folders = {_folder(m) for m in MODULES if m.startswith("trainer.")} - {"top"}
    assert folders == set(LAYERS), "every folder of trainer/ has its place in trainer.LAYERS"
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("trainer.") or _folder(module) == "top":
            continue
        allowed = LAYERS[_folder(module)] | {_folder(module)}
        wrong += [
            f"{module} -> {target}"
            for target in _imports(path)
            if target.startswith("trainer.") and _folder(target) not in allowed
        ]
    assert wrong == []


def test_each_engine_folder_imports_only_the_folders_below_it():
    folders = {_folder(m) for m in MODULES if m.startswith("sweeper.")} - {"top"}
    assert folders == set(sweeper.LAYERS), "every folder of sweeper/ has its place in LAYERS"
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("sweeper.") or _folder(module) == "top":
            continue
        allowed = sweeper.LAYERS[_folder(module)] | {_folder(module)}
        wrong += [
            f"{module} -> {target}"
            for target in _imports(path)
            if target.startswith("sweeper.") and _folder(target) not in allowed | {"top"}
        ]
    assert wrong == []


def test_the_engine_has_no_flat_heap_of_modules():
    """Beside its folders, the engine's top holds only its API, its entry point and the
    reference generator: a new module belongs in the folder of its system."""
    top = sorted(p.name for p in (REPO / "sweeper").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "reference.py"]


def test_the_engine_imports_only_the_trainers_jax_free_folders():
    wrong = [
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if module.startswith("sweeper")
        for target in _imports(path)
        if target.startswith("trainer") and not _jax_free(target)
    ]
    assert wrong == []


def test_no_modules_import_each_other_in_a_circle():
    graph = {m: _imports(p) - {m} for m, p in MODULES.items()}
    # A package's __init__ that only describes it imports nothing; a module's parent package is
    # imported with it, so edges into packages are not circles of their own.
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_docs_reference_is_generated_from_the_schemas():
    """Every config and space field says what it means, and docs/reference.md says the same."""
    from sweeper.reference import REFERENCE, main, render

    text = render()
    schemas = text.split("## Trainer events")[0]  # config and space; events are partly described
    for line in schemas.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), f"field without a description: {line}"
    assert main(["--check"]) == 0, f"{REFERENCE} drifted: run python -m sweeper.reference"
    assert "`kernels.gmm_tk`" in text and "`search.trial_timeout_s`" in text
