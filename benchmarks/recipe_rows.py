"""Every published Ironwood recipe (tests/data/tpu_recipes, kept verbatim: issue 62) predicted
before its published figure is compared with it.

    python -m benchmarks.recipe_rows freeze   # benchmarks/data/recipe_predictions.csv

`freeze` imports each kept command as `sweeper import` does and judges its trial 0 (the
recipe as published) by the analytic estimate for its topology: verdict, est. tokens/s per
chip, step time, memory per device, MFU. The file is committed before any published figure
of these rows enters the repository; the compile fidelity of each row (MaxText's
train_compile) and the comparison with the published table come after, in later commits.
Fidelity: estimate, TPU7x (never a measurement).
"""

from __future__ import annotations

import csv
import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "tests" / "data" / "tpu_recipes"
PREDICTIONS = REPO / "benchmarks" / "data" / "recipe_predictions.csv"
MODEL_FILES = ("trainer/estimate", "trainer/compile/step_model.py", "trainer/trial/hardware.py")
FIELDS = ("path", "model", "target", "chips", "per_device_batch", "seq", "quantization",
          "status", "why", "est_tokens_per_sec_per_chip", "est_step_time_s",
          "est_hbm_per_device_gib", "est_mfu", "bound")  # fmt: skip


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def predict(path: str) -> dict[str, Any]:
    """A kept command's trial 0 judged by the estimate; or why it cannot be imported."""
    from sweeper.search.screen import judge
    from sweeper.space.command import load_text, read_command, space_of
    from sweeper.space.errors import SpaceError
    from sweeper.space.load import load_space
    from sweeper.space.points import first_point

    row: dict[str, Any] = {"path": path}
    try:
        text, _ = load_text(str(RECIPES / path))
        command = read_command(text)
        space = load_space(space_of(command, "row", None))
    except SpaceError as exc:
        return {**row, "status": "refused", "why": " ".join(str(exc).split())[:300]}
    settings = command.settings
    row.update(model=settings.get("model_name", ""), target=str(space.target),
               chips=space.target.tpu.chips, per_device_batch=settings.get("per_device_batch_size", ""),
               seq=settings.get("max_target_length", ""), quantization=settings.get("quantization", ""))  # fmt: skip
    judged = judge(space, first_point(space))
    row.update(status=judged["verdict"], why=judged.get("why", ""),
               **{k: judged.get(k, "") for k in FIELDS if k.startswith("est_") or k == "bound"})  # fmt: skip
    return row


def freeze() -> Path:
    commands = yaml.safe_load((RECIPES / "index.yaml").read_text())["commands"]
    rows = [predict(c["path"]) for c in commands]
    model_commit = _git("log", "-1", "--format=%h %cI", "--", *MODEL_FILES)
    with PREDICTIONS.open("w", newline="") as f:
        f.write(f"# Every kept Ironwood recipe's trial 0 by the estimate (fidelity estimate, TPU7x), "
                f"frozen {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} at "
                f"commit {_git('rev-parse', '--short', 'HEAD')}; the estimate's model last changed "
                f"at {model_commit}. python -m benchmarks.recipe_rows freeze.\n")  # fmt: skip
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
            )
    return PREDICTIONS


if __name__ == "__main__":
    if sys.argv[1:] != ["freeze"]:
        raise SystemExit(__doc__)
    print(freeze())
