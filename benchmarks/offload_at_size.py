"""Host offload at a real size: the published llama3.1-70b 8k recipe on tpu7x:4x4x4 with
its saved tensors kept on device, or offloaded to pinned host memory.

    python -m benchmarks.offload_at_size [--only NAME] [--maxtext-python PATH]

Each row is the recipe (trial 0 of search_spaces/llama31_70b_8k_tpu7x.yaml, with the loss
in 8 vocabulary tiles so that it fits, and the Splash layouts of the current published
recipe) compiled by libtpu on this host (fidelity compile; no TPU): device memory per
device (arguments + temp) and the host memory the compiler plans (`host_temp_size_in_bytes`).
With `--maxtext-python` (a MaxText 0.2.5 environment, benchmarks/maxtext_parity.py says how
to build one), each case is also compiled by MaxText's own train_compile with the same
placements (its loss untiled, as published), the outside reference for what offload should
save. One compile takes 3-15 minutes on a 2-core host.
"""

from __future__ import annotations

import argparse
import copy

from rich.console import Console
from rich.table import Table

from benchmarks.compile_real_models import compile_trial
from benchmarks.maxtext_parity import maxtext_compile
from sweeper.space.load import load_space
from sweeper.space.points import assemble
from trainer.trial.hardware import GIB

SAVED = ("decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "qkv_proj")
# The current published recipe's Splash layouts (sa_q_layout, sa_k_layout: SEQ_MINOR): with
# them the saved queries and keys are read back in the layout the forward pass wrote.
RECIPE_LAYOUTS = {"q_layout": "seq_minor", "k_layout": "seq_minor"}
HEAD_DIM_MINOR = {"q_layout": "head_dim_minor", "k_layout": "head_dim_minor"}
# name: (placements, kernels)
CASES = {
    "recipe: all six on device": ({}, {}),
    "decoder_layer_input offloaded": ({"decoder_layer_input": "offload"}, {}),
    "decoder_layer_input offloaded, Splash layouts head_dim_minor": (
        {"decoder_layer_input": "offload"},
        HEAD_DIM_MINOR,
    ),
    "q/k/v projections offloaded": (
        dict.fromkeys(("query_proj", "key_proj", "value_proj", "qkv_proj"), "offload"),
        {},
    ),
    "all six offloaded": (dict.fromkeys(SAVED, "offload"), {}),
}


def recipe() -> tuple[dict, str]:
    space = load_space("spaces/llama31_70b_8k_tpu7x.yaml")
    config = {**assemble(space, space.search.warm_start[0]), "vocab_tiling": 8}
    config["kernels"] = {**config["kernels"], **RECIPE_LAYOUTS}
    return config, space.target


def with_placements(config: dict, placements: dict[str, str], kernels: dict | None = None) -> dict:
    config = copy.deepcopy(config)
    config["remat"]["custom"].update(placements)
    config["kernels"].update(kernels or {})
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="one case name")
    parser.add_argument("--maxtext-python", help="the Python of a MaxText 0.2.5 environment")
    args = parser.parse_args()
    base, target = recipe()
    table = Table(title=f"llama3.1-70b 8k on {target}: where the saved tensors live (compile)")
    for column in ("case", "device GiB (args + temp)", "temp GiB", "host temp GiB", "status"):
        table.add_column(column)
    for name, (placements, kernels) in CASES.items():
        if args.only and args.only != name:
            continue
        events, wall = compile_trial(with_placements(base, placements, kernels), target)
        memory = (events.get("compiled") or {}).get("memory_per_device") or {}
        failure = events.get("failure")
        device = memory.get("argument_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0)
        row = (
            name,
            f"{device / GIB:.2f}" if memory else "-",
            f"{memory.get('temp_size_in_bytes', 0) / GIB:.2f}" if memory else "-",
            f"{memory.get('host_temp_size_in_bytes', 0) / GIB:.2f}" if memory else "-",
            failure["failure_class"] if failure else f"ok ({wall:.0f} s)",
        )
        table.add_row(*row)
        Console().print(" | ".join(row))  # each row as it lands: one compile is minutes
        if args.maxtext_python:
            theirs = maxtext_compile(
                args.maxtext_python, with_placements(base, placements, kernels)
            )
            row = (
                f"MaxText: {name}",
                f"{(theirs['argument'] + theirs['temp']) / GIB:.2f}",
                f"{theirs['temp'] / GIB:.2f}",
                f"{theirs['host_temp'] / GIB:.2f}",
                f"ok ({theirs['compile_s']:.0f} s)",
            )
            table.add_row(*row)
            Console().print(" | ".join(row))
    Console().print(table)


if __name__ == "__main__":
    main()
