"""Splash blocks tuned per kernel at compile fidelity (`kernels.tune: compile`, issue 51):
each kernel compiled alone for TPU7x with candidate blocks under the trial's scoped VMEM
limit, the compiler's refusals dropped, the rest priced by the step model; the trial's
program runs the choice, and a second trial with the same kernels reads it back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.compile_helpers import _compile
from trainer.compile.tiles import TILES_DIR, splash_candidates

pytestmark = pytest.mark.tpu_compile

MODEL = {"preset": "tiny-dense", "d_model": 256, "num_layers": 1, "num_heads": 8,
         "num_kv_heads": 8, "head_dim": 128}  # fmt: skip
# 512-row blocks at 2k under a 16 MiB scoped VMEM limit, where 2048-row blocks overflow.
TRIAL = {
    "model": MODEL,
    "seq_len": 2048,
    "kernels": {"attention": "splash", "tune": "compile"},
    "xla": {"scoped_vmem_kib": 16384, "judge": False},
}


def _splash_blocks(events: dict) -> dict[str, tuple[int, ...]]:
    """The query and key blocks each Splash call of the compiled trial program carries."""
    calls = events["compiled"]["program_cost"]["kernel_calls"]
    out = {}
    for call in calls:
        if call["name"].startswith("splash_") and call["blocks"]:
            kernel = "splash forward" if "_fwd" in call["name"] else "splash backward"
            out[kernel] = (call["blocks"][0][-2], call["blocks"][1][-2])
    return out


def test_candidates_hold_the_trials_blocks_and_divide_the_sequence():
    listed = splash_candidates(2048, (256, 256, 256))
    assert listed[0] == (256, 256, 256)
    assert set(listed[1:]) == {(q, kv, kv) for q in (512, 1024, 2048) for kv in (512, 1024, 2048)}


@pytest.mark.slow  # 3 min; Splash tuned and run: the context-parallel test
def test_the_tuner_chooses_blocks_that_fit_the_vmem_limit_and_the_program_runs_them(tmp_path):
    cache = {"enabled": False, "cache_dir": str(tmp_path / "cache")}
    code, events, err = _compile(tmp_path, {**TRIAL, "convergence": cache}, timeout=1200)
    assert code == 0, err[-3000:]
    effect = events["compiled"]["effects"]["kernels.tune"]
    (saved,) = (tmp_path / "cache" / TILES_DIR).glob("*.json")
    tuning = {k["kernel"]: k for k in json.loads(saved.read_text())["kernels"]}
    for tuned in tuning.values():
        refused = [t for t in tuned["tried"] if t["failure"]]
        priced = [t for t in tuned["tried"] if t["seconds"] is not None]
        assert refused and priced, tuned  # 2048-row blocks overflow 16 MiB; smaller compile
        assert all(2048 in t["blocks"] and "vmem" in t["failure"] for t in refused), refused
        assert len(refused) + len(priced) == len(splash_candidates(2048, (512, 512, 512)))
        best = min(t["seconds"] for t in priced)
        assert next(t for t in priced if t["blocks"] == tuned["chosen"])["seconds"] == best
    # The forward's 512-row blocks cost more grid steps than larger ones that fit: changed.
    assert tuning["splash forward"]["chosen"] != tuning["splash forward"]["given"]
    # The trial's program carries the chosen blocks (it would carry 512 if the choice were
    # ignored), and the tuner said so: active, with what it tried.
    chosen = {k: tuple(t["chosen"][:2]) for k, t in tuning.items()}
    assert _splash_blocks(events) == chosen
    assert effect["status"] == "active" and "refused by the compiler" in effect["reason"]
    # Its priced choice makes the whole step no slower than the blocks it was given.
    given = {**TRIAL, "kernels": {"attention": "splash"}, "convergence": cache}
    (tmp_path / "given").mkdir()
    code, untuned, err = _compile(tmp_path / "given", given)
    assert code == 0, err[-3000:]
    assert events["summary"]["est_step_time_s"] <= untuned["summary"]["est_step_time_s"]
    # A second trial with the same kernels reads the tuning back instead of compiling it.
    (tmp_path / "again").mkdir()
    code, again, err = _compile(tmp_path / "again", {**TRIAL, "convergence": cache})
    assert code == 0, err[-3000:]
    assert "read from the cache" in again["compiled"]["effects"]["kernels.tune"]["reason"]
    assert _splash_blocks(again) == chosen


@pytest.mark.parametrize("method", ["compile", "time"])
def test_a_run_on_cpu_tunes_nothing_and_says_why(tmp_path, method):
    """On CPU neither tuner acts (the compile tuner is compile fidelity's; timing needs the
    TPU): inert, with why, and the trial runs its tiles as set."""
    from tests.helpers import run_trainer

    config = {**TRIAL, "steps": 2, "backend": "cpu", "num_devices": 1,
              "convergence": {"enabled": False}, "per_device_batch": 1}  # fmt: skip
    config["kernels"] = {**config["kernels"], "tune": method}
    config.pop("xla")
    code, events, err = run_trainer(config, tmp_path, timeout=600)
    assert code == 0, err[-3000:]
    accepted = next(e for e in events if e["event"] == "accepted")
    effect = accepted["effects"]["kernels.tune"]
    assert effect["status"] == "inert", effect
    assert ("TPU target" if method == "compile" else "interprets") in effect["reason"]
    compiled = next(e for e in events if e["event"] == "compiled")
    assert compiled.get("kernel_tuning") is None
    assert "kernels.tune" not in compiled.get("effects", {})


# A 1-layer MoE whose experts run tokamax's kernels (attention in XLA: only the grouped
# matmuls are tuned), under an 8 MiB scoped VMEM limit where some 1024-row tiles overflow it.
MOE = {"preset": "tiny-moe", "d_model": 512, "mlp_dim": 1024, "num_layers": 1, "num_heads": 8,
       "num_kv_heads": 8, "head_dim": 128, "num_experts": 8, "experts_per_token": 2}  # fmt: skip
TUNED_SWEEP = {
    "name": "tuned_gmm",
    "target": "tpu7x:2x2x1",
    "fidelity": "compile",
    "model": MOE,
    "trial": {
        "seq_len": 2048,
        "kernels": {"attention": "xla", "moe_gmm": "tokamax"},
        "xla": {"scoped_vmem_kib": 8192, "judge": False},
    },
    "search": {"sampler": "grid", "trials": 2, "concurrency": 1, "seed": 0},
    "knobs": {"kernels.tune": {"values": ["off", "compile"]}},
}


def _gmm_tiles(trial_dir) -> dict[str, set[tuple[int, ...]]]:
    """The tiles each tokamax kernel of the trial's compiled program carries (from its log)."""
    lines = (trial_dir / "trainer.log").read_text().splitlines()
    events = [json.loads(x) for x in lines if x.startswith("{")]
    compiled = next(e for e in events if e.get("event") == "compiled")
    out: dict[str, set[tuple[int, ...]]] = {}
    for call in compiled["program_cost"]["kernel_calls"]:
        for kernel, name in (("drhs", "_tgmm"), ("dlhs", "_gmm_transpose_rhs"), ("fwd", "_gmm")):
            if call["name"].endswith(name):
                out.setdefault(kernel, set()).add(tuple(call["tiling"]))
                break
    return out


@pytest.mark.slow  # 3-4 min; tuned tiles run: the megablox test
def test_a_sweep_tunes_the_grouped_matmul_tiles_and_records_every_candidate(tmp_path):
    from mlflow.tracking import MlflowClient

    from sweeper.answer.export import export_trial
    from sweeper.record.manifest import find_sweep
    from sweeper.space.load import load_space
    from sweeper.sweep.run import run_sweep

    result = run_sweep(load_space(TUNED_SWEEP), results_dir=tmp_path)
    frame = result.trials.set_index("knob:kernels.tune")
    assert list(frame["status"]) == ["ok", "ok"], frame["failure_message"]
    # The tuned trial's folder holds every candidate: refused ones with the compiler's words
    # (VMEM), priced ones with the step model's time, the cheapest chosen.
    (record,) = (tmp_path / "ray").glob("*/trial_*/tuning.json")
    tuning = json.loads(record.read_text())
    kernels = {k["kernel"]: k for k in tuning["kernels"]}
    assert set(kernels) == {f"{w} {p}" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")}
    refused = [t for k in kernels.values() for t in k["tried"] if t["failure"]]
    assert refused and all("vmem" in t["failure"] for t in refused), refused
    for tuned in kernels.values():
        priced = [t for t in tuned["tried"] if t["seconds"] is not None]
        best = min(t["seconds"] for t in priced)
        assert next(t for t in priced if t["blocks"] == tuned["chosen"])["seconds"] == best
    assert any(k["chosen"] != k["given"] for k in kernels.values()), "the given were best: no test"

    def by_pass(field: str) -> dict[str, set[tuple[int, ...]]]:  # each pass, both weights
        out: dict[str, set[tuple[int, ...]]] = {}
        for name, k in kernels.items():
            out.setdefault(name.split()[1], set()).add(tuple(k[field]))
        return out

    # The trial's compiled program runs the chosen tiles (the untuned one MaxText's defaults).
    tuned_dir = record.parent
    assert _gmm_tiles(tuned_dir) == by_pass("chosen")
    (other,) = [d for d in (tmp_path / "ray").glob("*/trial_*") if d != tuned_dir]
    assert _gmm_tiles(other) == by_pass("given") != by_pass("chosen")
    metric = "est_tokens_per_sec_per_chip"
    assert frame.loc["compile", metric] > frame.loc["off", metric]
    # summary.csv, the MLflow run (params and the record as an artifact), export and report.
    settings = json.loads(frame.loc["compile", "tuned"])
    assert settings == tuning["settings"]
    assert settings["tokamax_tiles.wi_fwd"] == "x".join(map(str, kernels["wi fwd"]["chosen"]))
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(frame.loc["compile", "mlflow_run_id"])
    assert run.data.params["tuned.tokamax_tiles.wi_drhs"] == settings["tokamax_tiles.wi_drhs"]
    saved = client.download_artifacts(run.info.run_id, "tuning.json", str(tmp_path))
    assert json.loads(Path(saved).read_text())["kernels"] == tuning["kernels"]
    found = find_sweep(result.sweep_id, tmp_path)
    exported = json.loads(
        export_trial(found, result.trials, frame.loc["compile", "trial_id"], "trial")
    )
    tiles = exported["kernels"]["tokamax_tiles"]
    assert (
        tiles["wi_fwd"] == settings["tokamax_tiles.wi_fwd"] and exported["kernels"]["tune"] == "off"
    )
    report = (result.sweep_dir / "report.html").read_text()
    assert "Kernel tiles the tuner chose" in report and settings["tokamax_tiles.wo_drhs"] in report


def test_tiles_says_what_each_scoped_vmem_limit_unlocks(tmp_path, monkeypatch):
    """`sweeper tiles`: trial 0's kernels tuned under each of the space's VMEM limits; the
    limit reaches the compiler (4 MiB refuses blocks 64 MiB admits)."""
    import yaml
    from typer.testing import CliRunner

    from sweeper.cli import app
    from sweeper.cli.app import console

    space = {"name": "tiles", "target": "tpu7x:2x2x1", "fidelity": "compile",
             "model": MODEL, "trial": {"seq_len": 1024, "kernels": {"attention": "splash"},
                                       "xla": {"judge": False}},
             "knobs": {"xla.scoped_vmem_kib": {"values": [65536, 4096]}}}  # fmt: skip
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(console, "width", 200)  # one line a row, whatever the terminal
    result = CliRunner().invoke(app, ["tiles", str(path)])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "4 MiB" in result.output and "64 MiB" in result.output
    for kernel in ("splash forward", "splash backward"):
        small, large = re.findall(r"\((\d+)/4 refused\)", rows[kernel])
        assert int(small) > int(large), rows[kernel]  # columns in limit order: 4, then 64 MiB

    # Beside the best, trial 0's own tiles and their price: never below the best's.
    def totals(row: str) -> list[float | None]:
        cells = row.split("│")[2:-1]
        return [float(c.split()[0].replace(",", "")) if "µs" in c else None for c in cells]

    best, own = totals(rows["all, one call each"]), totals(rows["trial 0's own tiles"])
    assert best[1] is not None and own[1] is not None and own[1] >= best[1], (best, own)
    # A target without TPUs: said, exit 2, nothing run.
    local = CliRunner().invoke(app, ["tiles", str(path), "--target", "local"])
    assert local.exit_code == 2 and "TPU target" in local.output


def test_timing_drops_what_does_not_compile_and_runs_the_fastest(tmp_path):
    """`kernels.tune: time`'s path (tune-jax on the trial's device), exercised on this CPU
    with Splash interpreted: every candidate compiled or refused with the compiler's words,
    the rest timed, the fastest chosen, a second call read back. Interpreted times say
    nothing of a TPU's: a trial on CPU never runs this (next test), only this test does."""
    import jax

    from trainer.compile.tiles.timing import timed_tiles
    from trainer.trial.config import load_config

    model = {**MODEL, "num_heads": 1, "num_kv_heads": 1}
    # 384-row blocks do not divide 1024: the kernel refuses them; 512 and 1024 compile.
    blocks = dict.fromkeys(("block_q", "block_kv", "block_kv_compute"), 384)
    config = load_config({"model": model, "seq_len": 1024,
                          "kernels": {"attention": "splash", "tune": "time", **blocks}})  # fmt: skip
    degrees = dict.fromkeys(("data", "fsdp", "expert", "tensor", "context"), 1)
    device = jax.devices("cpu")[0]
    tuning, untuned = timed_tiles(config, 1, degrees, device, tmp_path, interpret=True)
    assert not untuned and not tuning.cached
    forward = next(k for k in tuning.kernels if k.kernel == "splash forward")
    (refused,) = [t for t in forward.tried if t.failure]
    assert refused.blocks == (384, 384, 384) and "384" in refused.failure
    timed = {t.blocks: t.seconds for t in forward.tried if t.seconds is not None}
    assert set(timed) == {(q, kv, kv) for q in (512, 1024) for kv in (512, 1024)}
    assert forward.chosen == min(timed, key=timed.__getitem__)
    again, _ = timed_tiles(config, 1, degrees, device, tmp_path, interpret=True)
    assert again.cached and again.settings() == tuning.settings()


def test_megablox_tiling_is_tuned_once_for_every_pass_and_the_program_runs_it(tmp_path):
    """Megablox takes one (tm, tk, tn) for both weights and every pass: the tuner prices each
    candidate over all its calls, tm dividing the routed rows, and the trial runs the choice."""
    model = {**MOE, "d_model": 512, "mlp_dim": 512}
    trial = {"model": model, "seq_len": 2048,
             "kernels": {"attention": "xla", "moe_gmm": "megablox", "tune": "compile"},
             "xla": {"judge": False},
             "convergence": {"enabled": False, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    code, events, err = _compile(tmp_path, trial, timeout=1200)
    assert code == 0, err[-3000:]
    (tuned,) = events["compiled"]["kernel_tuning"]["kernels"]
    priced = {tuple(t["blocks"]): t["seconds"] for t in tuned["tried"] if t["seconds"]}
    rows = 2048 * 2  # a device's tokens by top 2
    assert all(rows % tm == 0 for tm, _, _ in priced) and len(set(priced.values())) > 1
    assert tuple(tuned["chosen"]) == min(priced, key=priced.__getitem__) != tuple(tuned["given"])
    tm = tuned["chosen"][0]
    calls = [c for c in events["compiled"]["program_cost"]["kernel_calls"]
             if c["name"] in ("gmm", "tgmm")]  # fmt: skip
    assert calls and all(c["blocks"][0][0] == tm for c in calls), calls


def test_splash_under_context_parallelism_is_tuned_on_one_devices_chunk(tmp_path):
    """With context 2 each device's Splash kernel runs its 1024 queries against all 2048 keys:
    the tuner compiles that kernel alone (query blocks divide the chunk, key blocks the
    sequence), prices it with the trial's context, and the trial's program runs its choice."""
    trial = {**TRIAL, "mesh": {"context": 2},
             "convergence": {"enabled": False, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    code, events, err = _compile(tmp_path, trial, timeout=1200)
    assert code == 0, err[-3000:]
    # Each compile the tuner begins is said (a sweep's progress shows "compile k of n").
    told = events["tuning"]  # the last one
    assert told["kernel"].startswith("splash") and 1 <= told["done"] <= told["total"], told
    tuning = {k["kernel"]: k for k in events["compiled"]["kernel_tuning"]["kernels"]}
    for tuned in tuning.values():
        tried = {tuple(t["blocks"]) for t in tuned["tried"]}
        assert tried == {(q, kv, kv) for q in (512, 1024) for kv in (512, 1024, 2048)}, tried
        priced = [t for t in tuned["tried"] if t["seconds"] is not None]
        assert len({t["seconds"] for t in priced}) > 1, priced
    assert events["compiled"]["effects"]["kernels.tune"]["status"] == "active"
    chosen = {k: tuple(t["chosen"][:2]) for k, t in tuning.items()}
    assert _splash_blocks(events) == chosen  # the given 512s if the choice were ignored
    # The kernel the tuner compiled alone is the trial's: the same calls, output and grid.
    from trainer.compile.aot import topology_devices
    from trainer.compile.tiles.families import families
    from trainer.trial.checks import global_batch_size
    from trainer.trial.config import load_config

    config = load_config({**trial, "compile_target": "tpu7x:2x2x1"})
    batch, degrees = global_batch_size(config, 8), config.mesh.resolve(8)
    (splash,), _ = families(config, batch, degrees, topology_devices("tpu7x:2x2x1")[0])
    pick = {k: tuple(t["chosen"]) for k, t in tuning.items()}
    alone = splash.calls(splash.trial(config, pick), {"xla_tpu_scoped_vmem_limit_kib": 16384})

    def kernel(call: dict) -> str:
        return json.dumps([call["name"], call["out"], call["grid"], call["blocks"]])

    ran = events["compiled"]["program_cost"]["kernel_calls"]
    assert {kernel(c) for c in alone} == {kernel(c) for c in ran if c["name"].startswith("splash")}


def test_a_priced_tie_goes_to_the_trials_own_tiles_else_the_largest():
    """At 128k under context 8 Splash's price does not depend on its query block (its work
    hides the streaming the block sets): of equal prices the trial's own stays, else the
    largest blocks (fewer grid steps and passes over the keys), not the first listed."""
    from types import SimpleNamespace

    from trainer.compile.tiles.record import Tried
    from trainer.compile.tiles.search import chosen

    family = SimpleNamespace(given={"fwd": (2048, 2048, 512)},
                             knobs={"fwd": ("block_q", "block_kv", "block_kv_compute")})  # fmt: skip
    tried = [Tried((2048, 2048, 512), 97.66), Tried((512, 4096, 4096), 94.35),
             Tried((1024, 4096, 4096), 94.35), Tried((2048, 4096, 4096), 94.35),
             Tried((4096, 4096, 4096), failure="vmem")]  # fmt: skip
    assert chosen(family, "fwd", tried).chosen == (2048, 4096, 4096)
    tied = [*tried[1:], Tried((2048, 2048, 512), 94.35)]
    assert chosen(family, "fwd", tied).chosen == (2048, 2048, 512)


def test_a_chips_timed_tiles_are_set_beside_the_step_models_prices(tmp_path):
    """benchmarks.kernel_times --records: each candidate tune-jax timed on a chip beside the
    price the compile tuner gave it, the refusals of either named, Spearman per kernel."""
    import json

    from benchmarks.kernel_times import records_table

    def record(name, times, chosen):
        tried = [
            {"blocks": list(b), "seconds": s, "failure": "" if s else "VMEM"} for b, s in times
        ]
        kernel = {"kernel": "splash forward", "knobs": [], "given": [1, 1, 1], "chosen": chosen,
                  "tried": tried}  # fmt: skip
        (tmp_path / name).write_text(json.dumps({"rows": [{"tuning": {"kernels": [kernel]}}]}))
        return tmp_path / name

    timed = record("t.json", [((1, 1, 1), 3e-3), ((2, 2, 2), 1e-3), ((4, 4, 4), 2e-3), ((8, 8, 8), 4e-3)],
                   [2, 2, 2])  # fmt: skip
    priced = record("p.json", [((1, 1, 1), 1.5e-3), ((2, 2, 2), 0.5e-3), ((4, 4, 4), 1e-3), ((8, 8, 8), None)],
                    [2, 2, 2])  # fmt: skip
    table = records_table(timed, priced)
    summary = json.loads(table.caption)["splash forward"]
    assert summary["spearman"] == 1.0 and summary["candidates"] == 3  # the refused one left out
    assert summary["median_abs_error"] == 0.5  # priced at half the time each
    assert list(table.columns[5].cells)[3] == "price"  # 8x8x8: the price's compile refused it
