"""The engine stays light: importing any sweeper module loads no JAX, and reaches into the
trainer only through its JAX-free modules (config, events, estimate and the fact tables)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO
from trainer import JAX_FREE_MODULES

HEAVY = ("jax", "jaxlib", "flax", "optax", "qwix", "tokamax")


def _loaded_after(imports: str) -> list[str]:
    code = (
        f"import importlib, json, pkgutil, sys\n{imports}\n"
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {(*HEAVY, 'trainer')!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_sweeper_module_imports_without_jax():
    loaded = _loaded_after(
        "import sweeper\n"
        "for m in pkgutil.iter_modules(sweeper.__path__): importlib.import_module('sweeper.' + m.name)"
    )
    assert [m for m in loaded if not m.startswith("trainer")] == []
    assert "trainer.events" in loaded  # the protocol is shared, not copied
    assert set(loaded) <= {"trainer", *JAX_FREE_MODULES}, set(loaded) - set(JAX_FREE_MODULES)


def test_the_trainers_jax_free_modules_are_so():
    imports = "\n".join(f"import {m}" for m in JAX_FREE_MODULES)
    loaded = _loaded_after(imports)
    assert [m for m in loaded if not m.startswith("trainer")] == []
    assert set(loaded) == {"trainer", *JAX_FREE_MODULES}


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
