"""What the compile-fidelity tests share: a small model, one compile of a trial configuration
for TPU7x through the trainer, and readers of the compiled program's text."""

from __future__ import annotations

import json
import os
import re
import subprocess

from tests.helpers import REPO, run_trainer
from trainer.program.hlo import parse
from trainer.trial.config import load_config
from trainer.trial.flags import COMPILER_STACKS

TARGET = "tpu7x:2x2x1"  # 4 chips, 8 devices: the smallest default TPU7x topology


def _compile(tmp_path, config: dict, target: str = TARGET, timeout: float = 600):
    base = {"seq_len": 256, "per_device_batch": 1, "convergence": {"enabled": False}}
    code, events, err = run_trainer(
        {**base, **config, "compile_target": target}, tmp_path, timeout=timeout
    )
    by_kind = {e["event"]: e for e in events}
    return code, by_kind, err


# tokamax's TPU grouped-matmul kernels by their 0.0.12 HLO names; 0.0.17 names them
# pallas_tpu_ragged_dot_{gmm, gmm_transpose_rhs, tgmm}.
_TOKAMAX_NAMES = {
    "pallas_tpu_ragged_dot_gmm": "gmm_megablox",
    "pallas_tpu_ragged_dot_gmm_transpose_rhs": "gmm_megablox_transpose_rhs",
    "pallas_tpu_ragged_dot_tgmm": "tgmm_megablox",
}


def _kernel(call: dict) -> str:
    return _TOKAMAX_NAMES.get(call["name"], call["name"])


# head_dim 128 as in real models: smaller head dims are padded to 128 lanes on TPU.
SMALL = {
    "preset": "tiny-dense",
    "d_model": 256,
    "mlp_dim": 1024,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 128,
}


def _compiled_text(config: dict, target: str = TARGET) -> str:
    from trainer.compile.aot import topology_devices
    from trainer.program.build import build_program, compile_step

    compiled, _ = compile_step(build_program(load_config(config), topology_devices(target)))
    return compiled.as_text()


def _compiled_text_in(python: str, config: dict, target: str) -> str:
    """The compiled program's text, compiled in a child run by `python` (this interpreter, or
    another with its own JAX and libtpu), with this repository on its path."""
    code = (
        "import json, sys\n"
        "from trainer.compile.aot import topology_devices\n"
        "from trainer.trial.config import load_config\n"
        "from trainer.run.train import build_program, compile_step\n"
        "program = build_program(load_config(json.loads(sys.argv[1])), topology_devices(sys.argv[2]))\n"
        "sys.stdout.write(compile_step(program)[0].as_text())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "TPU_ACCELERATOR_TYPE": "tpu7x-8", "TPU_WORKER_HOSTNAMES": "localhost",
           "LIBTPU_INIT_ARGS": " ".join(COMPILER_STACKS)}  # fmt: skip
    proc = subprocess.run([python, "-c", code, json.dumps(config), target],
                          capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def most_live_at_once(hlo: str, shape: str, op: str) -> int:
    """How many values of `shape` made by ops named `op` the entry computation holds at once,
    in its schedule order (each from its definition to its last use)."""
    computations, entry, _ = parse(hlo)
    body = computations[entry]
    spans = []
    for i, instr in enumerate(body):
        if instr.type.startswith(shape + "{") and op in instr.attrs:
            uses = [j for j in range(i + 1, len(body)) if instr.name in body[j].operands]
            spans.append((i, max(uses, default=i)))
    return max((sum(a <= i <= b for a, b in spans) for i, _ in spans), default=0)


def _forward_stacks(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array the forward layer loop hands the backward: what a remat
    policy saves, stacked over layers."""
    for line in hlo.splitlines():
        if " while(" in line and 'jvp(Transformer)/while"' in line:
            head = line.split(" while(")[0]
            return [(t, tuple(int(d) for d in dims.split(",")))
                    for t, dims in re.findall(r"\b(bf16|f32)\[([0-9,]+)\]", head)]  # fmt: skip
    raise AssertionError("no forward layer loop in the program")


SMALL_MOE = {**SMALL, "num_experts": 4, "experts_per_token": 2, "mlp_dim": 512}
