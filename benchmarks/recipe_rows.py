"""Every published Ironwood recipe (tests/data/tpu_recipes, kept verbatim: issue 62) predicted
before its published figure is compared with it.

    python -m benchmarks.recipe_rows freeze   # benchmarks/data/recipe_predictions.csv
    python -m benchmarks.recipe_rows compare  # the frozen predictions, the compiles: published
    python -m benchmarks.recipe_rows compile PATH  # one kept file's trial 0 through MaxText
    python -m benchmarks.recipe_rows compile-all SECONDS  # each recipe's in turn, resumed

`freeze` imports each kept command as `sweeper import` does and judges its trial 0 (the
recipe as published) by the analytic estimate for its topology: verdict, est. tokens/s per
chip, step time, memory per device, MFU. The file is committed before any published figure
of these rows enters the repository; the compile fidelity of each row (MaxText's
train_compile) comes after. `compare` reads the published table (tpu-recipes'
training/ironwood/README.md, kept verbatim in benchmarks/data/published/) and sets each
published row beside the frozen predictions of the kept files that run it, by family
(dense 8k; long context; MoE), split as calibration splits them: `fit` (the rows the
estimate's constants were fitted on: benchmarks/calibration.py FIT), `seen` (rows whose
figure was in the repository before the freeze: its PUBLISHED), `held out` (the rest).
Fidelity: estimate, TPU7x (never a measurement), against published runs. A second table
sets each compiled recipe (`compile`, below) beside its published row and its frozen
estimate: the compile's error and its memory, every row seen.

`compile PATH` imports one kept file and runs its trial 0 at compile fidelity (`sweeper
run SPACE --trials 1`: MaxText 0.2.5's train_compile for the recipe's topology, about 20
minutes on a 2-core host; needs `make maxtext`), then adds the compiler's memory and the
compile estimate to benchmarks/data/recipe_compiles.csv with the sweep's id. These came
after the published table entered the repository: a compile row is `seen`, its memory a
compiler's fact.
"""

from __future__ import annotations

import csv
import datetime
import functools
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
TABLE = (
    REPO / "benchmarks" / "data" / "published" / "tpu-recipes_c8cfe2f_training_ironwood_README.md"
)
# The table's model ids, where a kept file's model_name differs.
TABLE_MODEL = {
    "deepseek3-671b": "deepseek-v3",
    "deepseek3-671b-2dfsdp": "deepseek-v3-2dfsdp",  # the same model, 2D FSDP: no published row
    "gemma4-e2b": "gemma4-2b",
    "gemma4-e4b": "gemma4-4b",
}
RECIPES = REPO / "tests" / "data" / "tpu_recipes"
PREDICTIONS = REPO / "benchmarks" / "data" / "recipe_predictions.csv"
MODEL_FILES = ("trainer/estimate", "trainer/compile/step_model.py", "trainer/trial/hardware.py")
FIELDS = ("path", "model", "target", "chips", "per_device_batch", "seq", "quantization",
          "status", "why", "est_tokens_per_sec_per_chip", "est_step_time_s",
          "est_hbm_per_device_gib", "est_mfu", "bound")  # fmt: skip


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def imported(path: str, name: str = "row") -> tuple[Any, Any]:
    """A kept file (its path under tests/data/tpu_recipes) as `sweeper import` reads it: (the
    command, the space it makes, trial 0 the command). SpaceError where it cannot."""
    from sweeper.space.command import load_text, read_command, space_of
    from sweeper.space.load import load_space

    text, _ = load_text(str(RECIPES / path))
    command = read_command(text)
    return command, load_space(space_of(command, name, None))


def recipe_trial(path: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """A kept file's trial 0 as a MaxText trial of its imported space runs it: the trial's
    config (compiled for the file's target, as our trainer's config reads it), its maxtext.*
    knobs, and the space's MaxText program."""
    from sweeper.space.points import assemble, maxtext_knobs

    space = imported(path)[1]
    point = space.search.warm_start[0]
    config = {**assemble(space, point), "compile_target": str(space.target)}
    return config, maxtext_knobs(point), space.maxtext_program()


def predict(path: str) -> dict[str, Any]:
    """A kept command's trial 0 judged by the estimate; or why it cannot be imported."""
    from sweeper.search.screen import judge
    from sweeper.space.errors import SpaceError
    from sweeper.space.points import first_point

    row: dict[str, Any] = {"path": path}
    try:
        command, space = imported(path)
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


def published() -> dict[tuple[str, int, int, str], dict[str, Any]]:
    """The published table's rows by (model, chips, sequence, precision)."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or not cells[1].isdigit():
            continue
        model, chips, gbs, seq, precision, step, _tflops, tokens = cells
        figure = None if tokens == "N/A" else float(tokens.replace(",", ""))
        rows[(model, int(chips), int(seq), "fp8" if "fp8" in precision else "bf16")] = {
            "step_s": float(step), "tokens_per_sec_per_chip": figure, "gbs": int(gbs)}  # fmt: skip
    return rows


def table_key(row: dict[str, str]) -> tuple[str, int, int, str]:
    """A frozen prediction's published row: (model, chips, sequence, precision)."""
    precision = "fp8" if row["quantization"] == "fp8_full" else "bf16"
    return (
        TABLE_MODEL.get(row["model"], row["model"]),
        int(row["chips"]),
        int(row["seq"]),
        precision,
    )


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...]) -> Any:
    """A compact table of published rows (`benchmarks.tables.compact`), its columns unwrapped."""
    from benchmarks.tables import compact

    out = compact(title)
    for column in columns:
        out.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    return out


def _row_cells(key: tuple[str, int, int, str]) -> tuple[str, str]:
    """A published row's name without its chips, and its chips."""
    return f"{key[0]} {key[2] // 1024}k {key[3]}", str(key[1])


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def family(row: dict[str, str]) -> str:
    """dense 8k, long context (over 8k tokens), MoE; from the kept file's own model."""
    from sweeper.space.checks import static_check
    from sweeper.space.command import load_text, read_command, space_of
    from sweeper.space.load import load_space
    from sweeper.space.points import first_point

    space = load_space(
        space_of(read_command(load_text(str(RECIPES / row["path"]))[0]), "row", None)
    )
    if static_check(space, first_point(space), space.target.tpu.devices).model.num_experts:
        return "MoE"
    return "long context" if int(row["seq"]) > 8192 else "dense 8k"


def split(key: tuple[str, int, int, str]) -> str:
    from benchmarks.calibration import FIT, PUBLISHED

    model, chips, seq, precision = key
    name = f"{model} {seq // 1024}k {precision} {chips} chips"
    if name in FIT:
        return "fit"
    return "seen" if name in PUBLISHED else "held out"


def _families(rows: list[dict[str, str]]) -> dict[str, str]:
    """Each kept file's family, read once a file."""
    return {row["path"]: family(row) for row in rows}


def _published_rows(
    rows: list[dict[str, str]], table: dict[tuple[str, int, int, str], dict[str, Any]]
) -> dict[tuple[str, int, int, str], list[dict[str, str]]]:
    """The kept files' rows by the published row (with a figure) each runs."""
    out: dict[tuple[str, int, int, str], list[dict[str, str]]] = {}
    for row in rows:
        key = table_key(row)
        if key in table and table[key]["tokens_per_sec_per_chip"] is not None:
            out.setdefault(key, []).append(row)
    return out


def _fits(statuses: set[str]) -> str:
    """The files' verdicts on a row: yes, or the others (`over HBM`)."""
    if statuses == {"fits"}:
        return "yes"
    return ",".join(
        sorted(s.replace("_hbm", " HBM").replace("_", " ") for s in statuses - {"fits"})
    )


def _section(table: Any, family_name: str, last: list[str]) -> None:
    """A family's rows begun by its name (the table stays 80 columns wide without a column
    for it)."""
    if last and last[0] == family_name:
        return
    if last:
        table.add_section()
    table.add_row(f"[bold]{family_name}[/bold]", end_section=False)
    last[:] = [family_name]


def _medians(errors: dict[tuple[str, str], list[float]]) -> str:
    """Median |error| (rows) by family, a line a family."""
    lines: dict[str, list[str]] = {}
    for (name, where), es in sorted(errors.items()):
        lines.setdefault(name, []).append(
            f"{where} {statistics.median(abs(e) for e in es):.1%} ({len(es)})"
        )
    return "\n".join(
        f"median |error|, {name}: " + ", ".join(parts) for name, parts in lines.items()
    )


def compare() -> Any:
    """The frozen estimate against every published row, by family and split."""
    table = published()
    rows = [r for r in _read(PREDICTIONS) if r["status"] != "refused"]
    families = _families(rows)
    joined = _published_rows(rows, table)
    out = _table("Published Ironwood rows against the estimate frozen before (fidelity "
                 "estimate, TPU7x; tokens/s/chip; files: kept files that run the row)",
                 ("row", "chips", "split", "files", "published", "estimate", "error", "fits"),
                 ("row", "split", "fits"))  # fmt: skip
    errors: dict[tuple[str, str], list[float]] = {}
    last: list[str] = []
    for key, files in sorted(joined.items(), key=lambda kv: (families[kv[1][0]["path"]], kv[0])):
        family_name = families[files[0]["path"]]
        _section(out, family_name, last)
        figure = table[key]["tokens_per_sec_per_chip"]
        est = statistics.median({round(float(r["est_tokens_per_sec_per_chip"]), 1) for r in files})
        error = est / figure - 1
        where = split(key)
        errors.setdefault((family_name, where), []).append(error)
        out.add_row(*_row_cells(key), where, str(len(files)), f"{figure:,.0f}",
                    f"{est:,.0f}", f"{error:+.1%}", _fits({r["status"] for r in files}))  # fmt: skip
    missing = [(key, row) for key, row in table.items()
               if key not in joined and row["tokens_per_sec_per_chip"] is not None]  # fmt: skip
    if missing:  # a published run no kept file imports (refused by name)
        _section(out, "not imported", last)
        for key, row in missing:
            out.add_row(*_row_cells(key), "", "0", f"{row['tokens_per_sec_per_chip']:,.0f}",
                        "-", "", "refused")  # fmt: skip
    out.caption = _medians(errors)
    return out


def compare_today() -> Any:
    """Today's estimate of each published row (every kept file predicted again) beside the
    frozen one: what the model's mends since the freeze changed, all of it seen (the table
    was in the repository before them)."""
    table = published()
    frozen = [r for r in _read(PREDICTIONS) if r["status"] != "refused"]
    families = _families(frozen)
    now = {r["path"]: predict(r["path"]) for r in frozen}
    joined = _published_rows(frozen, table)
    out = _table("The estimate today against the one frozen (fidelity estimate, TPU7x; "
                 "tokens/s/chip; seen: the table was in before today's model)",
                 ("row", "chips", "published", "frozen", "today", "error", "fits"),
                 ("row", "fits"))  # fmt: skip
    errors: dict[tuple[str, str], list[float]] = {}
    last: list[str] = []
    for key, files in sorted(joined.items(), key=lambda kv: (families[kv[1][0]["path"]], kv[0])):
        family_name = families[files[0]["path"]]
        _section(out, family_name, last)
        figure = table[key]["tokens_per_sec_per_chip"]
        was = statistics.median(float(r["est_tokens_per_sec_per_chip"]) for r in files)
        today = [now[r["path"]] for r in files]
        est = statistics.median(float(r["est_tokens_per_sec_per_chip"]) for r in today)
        errors.setdefault((family_name, "frozen"), []).append(was / figure - 1)
        errors.setdefault((family_name, "today"), []).append(est / figure - 1)
        out.add_row(*_row_cells(key), f"{figure:,.0f}", f"{was:,.0f}", f"{est:,.0f}",
                    f"{est / figure - 1:+.1%}", _fits({r["status"] for r in today}))  # fmt: skip
    out.caption = _medians(errors)
    return out


@functools.cache
def _ours() -> list[tuple[str, float, float]]:
    """Our trainer's compile of each recipe it expresses (benchmarks.calibration's recorded
    rows, at its fitted MXU efficiencies): its row name, published figure and figure."""
    from benchmarks.calibration import estimate_rows, fit, predict

    rows = estimate_rows(False, recorded=True)
    fitted = fit(rows)
    return [(name, row["published_tokens"], predict(row, fitted))
            for name, row in rows.items() if "MaxText" not in name]  # fmt: skip


def _ours_for(ours: list[tuple[str, float, float]], key: tuple, figure: float | None) -> str:
    """Our trainer's error against a published row's figure: calibration's row of the same
    model, length, precision and chips whose figure is within 1% of the table's (the fp8 files
    on 64 chips run the re-tuned recipe)."""
    model, chips, seq, precision = key
    for name, published, predicted in ours:
        words = name.split()
        if (words[:3] == [model, f"{seq // 1024}k", precision] and f" {chips} chips" in name
                and figure and abs(published / figure - 1) < 0.01):  # fmt: skip
            return f"{predicted / figure - 1:+.1%}"
    return "-"


def compare_compiles() -> Any:
    """Each compiled recipe (MaxText's train_compile of its trial 0) against its published
    row and the estimate frozen before: every compile came after the table (seen)."""
    table = published()
    predicted = {r["path"]: r for r in _read(PREDICTIONS)}
    compiled = _read(COMPILES)
    families = _families([predicted[r["path"]] for r in compiled])
    out = _table("Compiled recipes against the published row (fidelity compile, TPU7x; "
                 "tokens/s/chip; error: the compile's; GiB: a device's, of 94.75; seen: "
                 "compiled after the table)",
                 ("row", "chips", "published", "compile", "error", "ours", "GiB", "fits"),
                 ("row", "fits"))  # fmt: skip
    ours = _ours()
    # a published row's error: the median over the files that run it, as compare's (its
    # -gcs and -lustre files compile one program), so each row counts once
    errors: dict[tuple[str, str], dict[tuple, list[float]]] = {}
    last: list[str] = []
    for row in sorted(
        compiled, key=lambda r: (families[r["path"]], table_key(predicted[r["path"]]))
    ):
        guess = predicted[row["path"]]
        key = table_key(guess)
        _section(out, families[row["path"]], last)
        figure = (table.get(key) or {}).get("tokens_per_sec_per_chip")
        ok = row["status"] == "ok"
        error = float(row["est_tokens_per_sec_per_chip"]) / figure - 1 if ok and figure else None
        if error is not None and figure:
            errors.setdefault((families[row["path"]], "compile"), {}).setdefault(key, []).append(
                error)  # fmt: skip
            errors.setdefault((families[row["path"]], "estimate"), {}).setdefault(key, []).append(
                float(guess["est_tokens_per_sec_per_chip"]) / figure - 1)  # fmt: skip
        out.add_row(*_row_cells(key), f"{figure:,.0f}" if figure else "-",
                    f"{float(row['est_tokens_per_sec_per_chip']):,.0f}" if ok else "-",
                    f"{error:+.1%}" if error is not None else "",
                    _ours_for(ours, key, figure),
                    row["hbm_per_device_gib"] or "-",
                    "yes" if ok else row["status"].split(": ")[-1].replace("_", " "))  # fmt: skip
    by_row = {k: [statistics.median(e) for e in v.values()] for k, v in errors.items()}
    out.caption = _medians(by_row) + (
        "\n(over published rows, the same by either fidelity, the estimate the one frozen "
        "before; ours: the "
        "error of our trainer's compile of the recipe, where benchmarks.calibration has it "
        "at the table's figure)"
    )
    return out


COMPILES = REPO / "benchmarks" / "data" / "recipe_compiles.csv"
COMPILE_FIELDS = ("path", "sweep_id", "status", "hbm_per_device_gib", "usable_hbm_gib",
                  "est_tokens_per_sec_per_chip", "est_step_time_s", "est_mfu", "compile_s",
                  "published_tokens_per_sec_per_chip", "error", "maxtext_tflops_per_device")  # fmt: skip


def recipe_paths() -> list[str]:
    """One kept file a recipe: its xpk run_recipe.sh where it has one, else its k8s manifest."""
    commands = yaml.safe_load((RECIPES / "index.yaml").read_text())["commands"]
    by_recipe: dict[str, str] = {}
    for path in (c["path"] for c in commands):
        recipe = "/".join(path.split("/")[:4])
        if recipe not in by_recipe or path.endswith("run_recipe.sh"):
            by_recipe[recipe] = path
    return sorted(by_recipe.values())


def compile_rows(budget_s: float) -> None:
    """Every recipe's trial 0 compiled in turn, those in COMPILES (or refused by the importer)
    skipped, none started past `budget_s`: each call goes on where the last one stopped."""
    import time

    start = time.monotonic()
    done = {r["path"] for r in _read(COMPILES)} if COMPILES.exists() else set()
    refused = {r["path"] for r in _read(PREDICTIONS) if r["status"] == "refused"}
    for path in recipe_paths():
        if path in done or path in refused:
            continue
        if time.monotonic() - start > budget_s:
            print(f"budget spent: {path} and after left for the next call", flush=True)
            return
        try:
            print(compile_row(path), flush=True)
        except subprocess.CalledProcessError as exc:  # a refusal the engine said: the next row
            print(f"{path}: {exc}", flush=True)


def compile_row(path: str, results: Path = REPO / "results" / "recipe_rows") -> dict[str, Any]:
    """One kept file's trial 0 compiled through MaxText by the engine, as a user would."""
    return record(path, compile_sweep(path, results))


def compile_sweep(path: str, results: Path, changes: dict[str, Any] | None = None) -> Path:
    """`sweeper import` of a kept file, then `sweeper run` of its space for one trial (trial 0
    with `changes` made, measured once; MaxText's train_compile for the recipe's topology):
    the sweep's folder."""
    results.mkdir(parents=True, exist_ok=True)
    space = results / (path.replace("/", "_").removesuffix(".sh").removesuffix(".yaml") + ".yaml")
    sweeper = [sys.executable, "-m", "sweeper"]
    subprocess.run(
        [*sweeper, "import", str(RECIPES / path), "-o", str(space)], check=True, cwd=REPO
    )
    doc = yaml.safe_load(space.read_text())
    start = doc["search"]["warm_start"][0]
    doc["search"].update(warm_start=[{**start, **(changes or {})}], trials=1, remeasure=0)
    space.write_text(yaml.safe_dump(doc, sort_keys=False))
    subprocess.run([*sweeper, "run", str(space), "--results-dir", str(results)], check=True,
                   cwd=REPO)  # fmt: skip
    return max(results.glob("*/*/summary.csv"), key=lambda p: p.stat().st_mtime).parent


def append_row(path: Path, header: str, fields: tuple[str, ...], row: dict[str, Any]) -> None:
    """A row added to a results CSV, the file begun with its `# header` line and field names."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        if new:
            f.write(f"# {header}\n")
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow(row)


def record(path: str, sweep_dir: Path) -> dict[str, Any]:
    """A compile sweep's trial 0 added to benchmarks/data/recipe_compiles.csv."""
    with (sweep_dir / "summary.csv").open() as f:
        trial = next(csv.DictReader(f))
    row = next(r for r in _read(PREDICTIONS) if r["path"] == path)
    key = table_key(row)
    figure = published().get(key, {}).get("tokens_per_sec_per_chip")

    def number(name: str, digits: int, scale: float = 1.0) -> float | str:
        return round(float(trial[name]) / scale, digits) if trial.get(name) else ""

    est = number("est_tokens_per_sec_per_chip", 1)
    status = (
        trial["status"]
        if trial["status"] == "ok"
        else f"{trial['status']}: {trial['failure_class']}"
    )
    out = {"path": path, "sweep_id": sweep_dir.name, "status": status,
           "hbm_per_device_gib": number("hbm_per_device_gib", 2),
           "usable_hbm_gib": number("usable_hbm_per_device", 2, 2**30),
           "est_tokens_per_sec_per_chip": est, "est_step_time_s": number("est_step_time_s", 3),
           "est_mfu": number("est_mfu", 4), "compile_s": number("compile_s", 0),
           "published_tokens_per_sec_per_chip": figure or "",
           "error": f"{est / figure - 1:+.4f}" if figure and est != "" else "",
           "maxtext_tflops_per_device": number("maxtext_tflops_per_device", 1)}  # fmt: skip
    append_row(COMPILES, "Kept Ironwood recipes' trial 0 compiled through MaxText 0.2.5's "
               "train_compile (libtpu 0.0.52) on a 2-core CPU host by python -m "
               "benchmarks.recipe_rows compile; fidelity compile, TPU7x. Compiled after the "
               "published table entered the repository: seen, not held out. "
               "maxtext_tflops_per_device: MaxText's own count of a step's training TFLOPs "
               "per device (maxtext_utils.calculate_tflops_training_per_device).",
               COMPILE_FIELDS, out)  # fmt: skip
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"] and len(sys.argv) == 3:
        try:
            print(compile_row(sys.argv[2]))
        except subprocess.CalledProcessError as exc:  # the engine said why, above
            print(f"error: `sweeper {exc.cmd[3]}` ended {exc.returncode} (its message above);\n"
                  "  PATH is a kept file's path under tests/data/tpu_recipes "
                  "(training/ironwood/...)", file=sys.stderr)  # fmt: skip
            raise SystemExit(2) from None
    elif sys.argv[1:2] == ["compile-all"] and len(sys.argv) == 3:
        compile_rows(float(sys.argv[2]))
    elif sys.argv[1:2] == ["record"] and len(sys.argv) == 4:  # a compile sweep run by hand
        print(record(sys.argv[2], Path(sys.argv[3])))
    elif sys.argv[1:] == ["freeze"]:
        print(freeze())
    elif sys.argv[1:] == ["compare"]:
        from rich.console import Console

        console = Console()
        console.print(compare())
        console.print(compare_compiles())
        console.print(compare_today())
    else:
        raise SystemExit(__doc__)
