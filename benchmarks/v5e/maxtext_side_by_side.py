"""Our trainer and MaxText 0.2.5 on the lent v5e, side by side: trial 0 of v5e_dense (the same
model, batch, remat, sequence, Splash blocks and bf16), each run as the engine runs it (`python
-m trainer`, and `python -m trainer --maxtext`, which drives MaxText's own train and reads its
log lines), one after the other in one call. MaxText runs in `MAXTEXT_PYTHON` (a Python with
maxtext==0.2.5 and benchmarks/v5e/maxtext_shim first on its path).

    python -m benchmarks.v5e.maxtext_side_by_side OUT_DIR   # OUT_DIR/side_by_side.json, a table
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.v5e.tune_trials import trial0

KEEP = ("tokens_per_sec_per_chip", "tokens_per_sec_per_chip_low", "tokens_per_sec_per_chip_high",
        "tflops_per_sec_per_chip", "mfu", "step_time_median_s", "hbm_per_device_gib",
        "final_loss", "hardware", "program")  # fmt: skip


def run(folder: Path, name: str, config: dict[str, Any], args: list[str]) -> dict[str, Any]:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path), *args],
                          capture_output=True, text=True)  # fmt: skip
    (folder / f"{name}.log").write_text(done.stdout + "\n" + done.stderr)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = next((e for e in events if e["event"] == "summary"), {})
    failure = next((e for e in events if e["event"] == "failure"), {})
    return {"program": name, **{k: summary.get(k) for k in KEEP if k in summary},
            "failure": failure.get("message", "")[:500], "code": done.returncode,
            "wall_s": time.perf_counter() - start}  # fmt: skip


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = trial0("off")
    maxtext = {"program": {"python": os.environ["MAXTEXT_PYTHON"]}, "knobs": {},
               "target": "local"}  # fmt: skip
    rows = [run(folder, "sweeper-trainer", config, []),
            run(folder, "maxtext", config, ["--maxtext", json.dumps(maxtext)])]  # fmt: skip
    (folder / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
