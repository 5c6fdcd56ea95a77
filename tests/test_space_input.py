"""Input a user (or an attacker) can give: every bad space ends in a message naming the file
and field, exit code 2, never a traceback; a property-based test throws 1000+ at the CLI."""

from __future__ import annotations

import os
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from sweeper.cli.app import app
from sweeper.space.checks import check_feasible, check_warm_start
from sweeper.space.errors import SpaceError
from sweeper.space.load import load_space
from tests.helpers import unfolded
from tests.test_space import GOOD

ALIAS_BOMB = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _error(tmp_path, text: str | bytes, **overrides) -> SpaceError:
    path = tmp_path / "space.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(SpaceError) as info:
        load_space(path, overrides)
    assert str(path) in str(info.value)
    return info.value


def test_warm_start_values_are_checked_one_by_one(tmp_path):
    text = GOOD + "search:\n  warm_start:\n    - {mesh.tensor: 4, remat.policy: full}\n"
    err = _error(tmp_path, text)
    assert err.field == "search.warm_start.0.mesh.tensor" and "not a value of knob" in err.message
    inactive = (
        GOOD + "search:\n  warm_start:\n    - {remat.policy: full, remat.custom.context: device}\n"
    )
    assert "only sampled when" in _error(tmp_path, inactive).message
    # Against pinning: fp8 exists in the space, but a CPU sweep pins it away.
    fp8 = (
        GOOD
        + "  precision.mode: {values: [bf16, fp8]}\nsearch:\n  warm_start:\n    - {precision.mode: fp8}\n"
    )
    space = load_space(_write(tmp_path, fp8))
    from sweeper.space.inert import pin_inert

    pinned, _ = pin_inert(space, "cpu")
    with pytest.raises(SpaceError, match="once inert values are pinned away"):
        check_warm_start(pinned, why=" once inert values are pinned away")


def _write(tmp_path, text):
    path = tmp_path / "other.yaml"
    path.write_text(text)
    return path


def test_yaml_alias_bombs_duplicates_and_bytes_are_refused_fast(tmp_path):
    start = time.monotonic()
    assert "alias" in _error(tmp_path, ALIAS_BOMB).message
    assert time.monotonic() - start < 5  # refused before anything expands it
    duplicate = GOOD.replace("trial: {", "trial: {seq_len: 32, ")
    assert "duplicate key 'seq_len'" in _error(tmp_path, duplicate).message
    err = _error(tmp_path, GOOD.encode() + b"\n# caf\xe9\n")
    assert "not UTF-8" in err.message and err.line == 10
    assert "at most" in _error(tmp_path, "a: 1\n" * 300_000).message


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"search.trials": 1e29}, "search.trials"),
        ({"devices": 1e8}, "devices"),
        ({"search.trial_timeout_s": 1e12}, "search.trial_timeout_s"),
        ({"knobs.per_device_batch.high": float("inf")}, "knobs.per_device_batch.high"),
    ],
)
def test_numbers_have_sane_bounds(tmp_path, override, field):
    err = _error(tmp_path, GOOD, **override)
    # A value from the command line is named as given there, not as a line of the file.
    assert err.field == field and err.line is None and "as given: --set" in err.message


def test_a_space_with_no_valid_point_is_refused(tmp_path):
    text = GOOD.replace("mesh.tensor: {values: [1, 2]}", "mesh.fsdp: {values: [3, 5]}")
    path = _write(tmp_path, text)
    with pytest.raises(SpaceError, match="every point of this space makes an invalid trial"):
        check_feasible(load_space(path))
    check_feasible(load_space("smoke"))  # a good space has valid points
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "every point" in result.output


def test_a_mesh_degree_that_never_divides_the_devices_is_refused_by_value(tmp_path):
    """`validate` said `ok: 6 points` for mesh.tensor [1, 3] on 8 devices; the run then spent
    2 of its 3 trials on invalid_config. A degree is refused, naming its value, when every
    combination with the other mesh knobs the space can reach (their conditions met) fails."""
    from sweeper.space.checks import check_space, static_check

    shown = CliRunner().invoke(
        app, ["validate", "smoke", "--set", "knobs.mesh.tensor.values=[1,3]"]
    )
    out = unfolded(shown.output)
    assert shown.exit_code == 2, out
    assert "smoke.yaml: knobs.mesh.tensor: value 3 can never run on the 8 devices" in out, out
    assert "8 devices are not divisible" in out and "<space>" not in out
    # tensor 4 is asked only with data 4: 4 x 4 never divides 8, though tensor 4 with data 1
    # would (a check blind to the condition would pass it).
    conditional = """\
        name: t
        devices: 8
        model: {preset: tiny-dense}
        trial: {seq_len: 64, steps: 4, backend: cpu}
        knobs:
          mesh.data: {values: [1, 4]}
          mesh.tensor: {values: [1, 4], when: {mesh.data: 4}}
        """
    with pytest.raises(
        SpaceError, match=r"mesh.tensor: value 4 can never run on the 8 dev.*data=4"
    ):
        check_space(load_space(_write(tmp_path, conditional)))
    # A degree that fits with some of the others is kept: data 8 runs with tensor 1.
    fits = conditional.replace("[1, 4], when: {mesh.data: 4}", "[1, 2]").replace(
        "mesh.data: {values: [1, 4]}", "mesh.data: {values: [1, 8]}"
    )
    space = load_space(_write(tmp_path, fits))
    check_space(space)
    static_check(space, {"mesh.data": 8, "mesh.tensor": 1})
    # In a sweep, against the devices its trials get.
    with pytest.raises(SpaceError, match="value 8 can never run on the 4 devices"):
        check_space(load_space(_write(tmp_path, fits)), num_devices=4)


def test_paths_never_fall_back_to_a_builtin_space(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_space("smoke").name == "smoke"
    assert load_space("spaces/smoke.yaml").name == "smoke"
    with pytest.raises(SpaceError, match="no such file"):
        load_space("mine/smoke.yaml")
    with pytest.raises(SpaceError, match="no built-in space named 'smok'"):
        load_space("smok")
    # Something there that is no space file is named for what it is.
    (tmp_path / "adir").mkdir()
    with pytest.raises(SpaceError, match="is a directory, not a space file"):
        load_space("./adir")
    os.mkfifo(tmp_path / "pipe.yaml")
    with pytest.raises(SpaceError, match="not a regular file"):
        load_space(tmp_path / "pipe.yaml")


def test_a_huge_list_is_not_called_an_alias_bomb(tmp_path):
    huge = (
        "name: x\nmodel: {preset: tiny-dense}\nknobs:\n  seed: {values: ["
        + ", ".join(map(str, range(120_000)))
        + "]}\n"
    )
    err = _error(tmp_path, huge)
    assert "alias" not in err.message and "give a range" in err.message
    assert "alias bomb" in _error(tmp_path, ALIAS_BOMB).message


def test_set_overrides_knob_definitions(tmp_path):
    space = load_space("smoke", {"knobs.mesh.tensor.values": [2]})
    assert space.knobs["mesh.tensor"].values == [2]
    space = load_space("smoke", {"knobs.per_device_batch": {"values": [1, 2]}})
    assert space.knobs["per_device_batch"].values == [1, 2]
    result = CliRunner().invoke(app, ["validate", "smoke", "--set", "knobs.mesh.tensor.values=[1]"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["validate", "smoke", "--set", "trial.steps=[1, {"])
    assert bad.exit_code == 2 and "--set trial.steps" in bad.output


# ------------------------------------------------------------------ property-based

BASE = yaml.safe_load(GOOD)
# Keys that exist at each level, so a mutation reaches deep into the schema.
PATHS = [
    ("name",),
    ("target",),
    ("devices",),
    ("fidelity",),
    ("model",),
    ("model", "preset"),
    ("trial",),
    ("trial", "seq_len"),
    ("trial", "steps"),
    ("trial", "backend"),
    ("search",),
    ("search", "trials"),
    ("search", "sampler"),
    ("search", "concurrency"),
    ("search", "warm_start"),
    ("objective",),
    ("constraints",),
    ("resources",),
    ("knobs",),
    ("knobs", "mesh.tensor"),
    ("knobs", "mesh.tensor", "values"),
    ("knobs", "remat.custom.context", "when"),
    ("knobs", "per_device_batch", "low"),
    ("knobs", "per_device_batch", "high"),
]
# Values that no field above accepts (each is checked to be wrong where it lands).
BAD_VALUES = st.sampled_from(
    [None, -7, 0, 1e29, -1e308, "", "tpu9x:0x0", "\x00", [], [[]], {}, {"?": 1}, True, 3.5]
)
JUNK_KEYS = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda k: k not in {"values", "low", "high", "step", "log", "type", "when"}
)


def _set(tree, path, value):
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node
    if isinstance(node, dict):
        node[path[-1]] = value


def _still_valid(data) -> bool:
    try:
        load_space(data)
    except (SpaceError, ValueError):
        return False
    return True


@st.composite
def malformed_spaces(draw):
    kind = draw(st.sampled_from(["value", "unknown_key", "text", "override"]))
    data = yaml.safe_load(GOOD)
    overrides: list[str] = []
    if kind == "value":
        _set(data, draw(st.sampled_from(PATHS)), draw(BAD_VALUES))
    elif kind == "unknown_key":
        path = draw(st.sampled_from([p for p in PATHS if len(p) < 3]))
        node = data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        target = node if isinstance(node, dict) else data
        target[draw(JUNK_KEYS)] = draw(BAD_VALUES)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if kind == "text":
        corruption = draw(
            st.sampled_from(
                [
                    "\n\t- : [",  # broken YAML
                    "\nname: again\n",  # duplicate key
                    "\n" + ALIAS_BOMB,
                    "\n]]]}}",
                    "\n&a x: *b\n",
                ]
            )
        )
        at = draw(st.integers(0, len(text)))
        text = text[:at] + corruption + text[at:]
    if kind == "override":
        key = draw(st.sampled_from(["search.trials", "trial.steps", "..", "devices", "knobs.x"]))
        value = draw(st.sampled_from(["-1", "1e29", "[", "{a: *b}", "abc", ""]))
        overrides = ["--set", f"{key}={value}"]
    return text, overrides, kind


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=malformed_spaces())
def test_malformed_spaces_exit_2_naming_file_and_field(tmp_path, case):
    text, overrides, kind = case
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    if kind in ("value", "unknown_key") and _still_valid(yaml.safe_load(text)):
        return  # a mutation that happens to be legal (e.g. an empty description)
    result = CliRunner().invoke(app, ["validate", str(path), *overrides])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    if kind == "override" and result.exit_code == 0:
        return  # e.g. --set trial.steps=abc is caught, but --set devices= may be legal-ish
    assert result.exit_code == 2, result.output
    assert str(path) in unfolded(result.output) or "--set" in result.output


@pytest.mark.parametrize("content", ["{", "", "[]", '{"pending": []}', "\xff\xfe"])
def test_a_damaged_journal_or_run_map_is_named_with_what_to_do(tmp_path, content):
    """A sweep's tracking journal or trial -> MLflow run map that is truncated, emptied or
    not its shape: an error naming the file and the way on (exit 2 from the CLI), never a
    traceback."""
    from sweeper.record.callback import TrackingCallback
    from sweeper.record.journal import TrackingJournal

    for name, load, fix in (
        ("tracking_journal.json", TrackingJournal, "move it aside"),
        ("mlflow_runs.json", lambda path: TrackingCallback(None, path), "move it aside"),
    ):
        path = tmp_path / name
        path.write_text(content, errors="surrogateescape")
        with pytest.raises(SpaceError) as info:
            load(path)
        assert str(path) in str(info.value) and "damaged" in info.value.message
        assert fix in info.value.message
