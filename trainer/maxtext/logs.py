"""What MaxText 0.2.5 prints, read back: a training step's line, a compile's memory analysis,
and why a run failed. JAX-free; checked against real MaxText output kept in tests/data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.trial.events import FailureClass, classify_text, memory_record

# metric_logger.py: "completed step: 3, seconds: 0.093, TFLOP/s/device: 0.000,
# Tokens/s/device: 689.611, total_weights: 512, loss: 4.955, lm_loss: 4.955, ..."
_STEP = re.compile(r"completed step: (?P<step>\d+), (?P<rest>.*)$")
_PAIR = re.compile(r"(?P<key>[A-Za-z_/]+): (?P<value>-?[\d.]+(?:e[-+]?\d+)?|nan|inf|-inf)")
# train_compile.py: "Memory analysis: CompiledMemoryStats(generated_code_size_in_bytes=..., ...)"
# (or, from other JAX versions, the same fields as "name: value" lines).
_MEMORY_FIELD = re.compile(
    r"(?<![a-z_])(?P<key>(?:host_)?[a-z_]+_size_in_bytes)[=:]\s*(?P<value>\d+)"
)
# Phases train_compile announces; what fails before the first is the configuration.
COMPILING = "Jitting and compiling train step..."
COMPILED = "Jitting and compilation complete!"
# MaxText's config refusals: pydantic's, and its own validation's ValueErrors.
_CONFIG_ERROR = re.compile(
    r"ValidationError|Extra inputs are not permitted|Input should be|ValueError: ", re.IGNORECASE
)
_NAMED_KEY = re.compile(r"^(?P<key>[a-z][a-z0-9_]*)\n  ", re.MULTILINE)
# pyconfig.py's refusal of a key it does not know.
_UNKNOWN_KEY = re.compile(r"ValueError: '(?P<key>\w+)' not in ")


@dataclass(frozen=True)
class StepLine:
    step: int
    seconds: float
    tflops_per_device: float
    tokens_per_device: float
    loss: float
    moe_lb_loss: float


def step_line(line: str) -> StepLine | None:
    """A step's figures from MaxText's `completed step` line; None for any other line."""
    match = _STEP.search(line)
    if not match:
        return None
    pairs = {m["key"]: float(m["value"]) for m in _PAIR.finditer(match["rest"])}
    if "seconds" not in pairs or "loss" not in pairs:
        return None
    return StepLine(
        step=int(match["step"]),
        seconds=pairs["seconds"],
        tflops_per_device=pairs.get("TFLOP/s/device", 0.0),
        tokens_per_device=pairs.get("Tokens/s/device", 0.0),
        loss=pairs["loss"],
        moe_lb_loss=pairs.get("moe_lb_loss", 0.0),
    )


def memory_analysis(text: str) -> dict[str, int] | None:
    """Per-device memory of a compiled step from train_compile's `Memory analysis` line, with
    `total_bytes` counted as the trainer counts it (aliased outputs once); None without one."""
    start = text.rfind("Memory analysis:")
    if start < 0:
        return None
    fields = {m["key"]: int(m["value"]) for m in _MEMORY_FIELD.finditer(text[start:])}
    if "argument_size_in_bytes" not in fields or "temp_size_in_bytes" not in fields:
        return None
    return memory_record(fields)


def failure(text: str, phase: str) -> tuple[FailureClass, str, str | None]:
    """How a MaxText process that exited badly failed: its class, the message (the last error
    it printed) and, for a setting MaxText refused, the setting's key where it names one.
    `phase`: "config" (nothing compiled yet), "compile" or "run"."""
    message = _last_error(text)
    failure_class = classify_text(message or text[-4000:], "compile" if phase != "run" else "run")
    if failure_class in (FailureClass.OOM_HBM, FailureClass.OOM_VMEM):
        return failure_class, message, None
    if phase == "run":
        return failure_class, message, None
    # MaxText's own checks assert while it sets the trial up or traces its step (a batch its
    # mesh cannot shard, a remat policy it does not know): a setting it cannot take. What
    # the compiler itself raises (XlaRuntimeError, JaxRuntimeError) is a compile error.
    if message.startswith("AssertionError"):
        return FailureClass.INVALID_CONFIG, message, None
    indivisible = _indivisible(message)
    if indivisible is not None:
        return FailureClass.INVALID_CONFIG, *indivisible
    if phase != "config":
        return failure_class, message, None
    unknown = _UNKNOWN_KEY.search(text)
    if unknown:
        key = unknown["key"]
        return FailureClass.INVALID_CONFIG, f"MaxText has no setting {key!r}", f"maxtext.{key}"
    if "validation error" in text:
        named = _NAMED_KEY.search(text[text.find("validation error") :])
        return FailureClass.INVALID_CONFIG, message, (f"maxtext.{named['key']}" if named else None)
    if _CONFIG_ERROR.search(message):  # refused while MaxText read its configuration
        return FailureClass.INVALID_CONFIG, message, None
    return failure_class, message, None


# JAX's refusal of a weight the mesh cannot shard evenly (jax._src.sharding.IndivisibleError).
_INDIVISIBLE = re.compile(
    r"IndivisibleError: .*?pytree key path (?P<path>\S+) was given the sharding .*?"
    r"spec=P\((?P<spec>.*?)\), memory_kind.*?array axis (?P<axis>\d+) is partitioned "
    r"(?P<ways>\d+) times, but the dimension size is (?P<size>\d+)",
    re.S,
)
_MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")


def _indivisible(message: str) -> tuple[str, str | None] | None:
    """JAX's IndivisibleError, said shortly (the weight, its axis, the mesh axes splitting it)
    with the engine's mesh field where one mesh axis splits it; None for any other error."""
    found = _INDIVISIBLE.search(message)
    if found is None:
        return None
    parts = re.findall(r"\([^)]*\)|'[^']*'|None", found["spec"])
    axis = int(found["axis"])
    names = re.findall(r"'(\w+)'", parts[axis]) if axis < len(parts) else []
    path = re.sub(r"\['(\w+)'\]", r".\1", found["path"]).removeprefix("state.")
    said = (
        f"the mesh cannot shard {path}: its axis {axis} ({found['size']}), split "
        f"{found['ways']} ways over {' x '.join(names) or 'the mesh'}, does not divide evenly "
        "(JAX's IndivisibleError); take mesh degrees that divide it"
    )
    field = f"mesh.{names[0]}" if len(names) == 1 and names[0] in _MESH_AXES else None
    return said, field


def _last_error(text: str) -> str:
    """The last exception line of a traceback (with pydantic's detail lines after it); a bare
    one (`AssertionError`, no message) with the failed statement and where it stands."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Exhausted)\b.*:", lines[i]):
            return "\n".join(lines[i : i + 6])[:3000]
        if re.fullmatch(r"[A-Za-z_.]*(Error|Exception)", lines[i].strip()):
            return f"{lines[i].strip()}{_failed_statement(lines[:i])}"
    return "\n".join(lines[-6:])[:3000]


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def _failed_statement(before: list[str]) -> str:
    """`: <statement> (<file>:<line>, in <function>)` for the traceback's last frame above a
    bare exception line (the package's path from its site-packages on), or nothing."""
    for j in range(len(before) - 1, -1, -1):
        frame = _FRAME.match(before[j])
        if frame:
            statement = before[j + 1].strip() if j + 1 < len(before) else ""
            where = frame["file"].split("site-packages/")[-1]
            return f": {statement} ({where}:{frame['line']}, in {frame['function']})"
    return ""
