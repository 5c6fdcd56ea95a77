"""What to say of a name MaxText 0.2.5 does not know (a setting, a model), with the fix: the
name it likely means, or which MaxText has it, from MaxText's own history
(maxtext_history.yaml: the settings its main dropped before 0.2.5, and the models its
repository has had that 0.2.5 has not, each with where and when)."""

from __future__ import annotations

import difflib
import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from trainer.trial.maxtext import BASE_KEYS

HISTORY_FILE = Path(__file__).with_name("maxtext_history.yaml")


@functools.cache
def history() -> dict[str, dict[str, dict[str, str]]]:
    """The history file: {"settings": {key: where}, "models": {name: where}}."""
    return dict(yaml.safe_load(HISTORY_FILE.read_text()))


def unknown_setting(key: str) -> str:
    """What to say of a key MaxText 0.2.5 does not know, with the fix."""
    said = "not a MaxText 0.2.5 setting (its configs/base.yml keys)"
    dropped = history()["settings"].get(key)
    if dropped:
        return (
            f"{said}: MaxText dropped it in {dropped['commit']} ({dropped['date']}, "
            f"'{dropped['subject']}'), so only a MaxText from before then reads it; remove it"
        )
    near = difflib.get_close_matches(key, sorted(BASE_KEYS), n=1, cutoff=0.8)
    if near:
        return f"{said}: did you mean {near[0]}?"
    return f"{said}; remove it, or correct its name"


def unknown_model(name: str, models: dict[str, Any]) -> str:
    """What to say of a model MaxText 0.2.5 lacks, with the fix."""
    said = f"MaxText 0.2.5 has no such model ({len(models)} models: its configs/models/)"
    elsewhere = history()["models"].get(name)
    if elsewhere:
        said += f"; {_where(name, elsewhere)}"
    near = difflib.get_close_matches(name, sorted(models), n=3, cutoff=0.6)
    if near:
        return f"{said}; did you mean {' or '.join(near)}?"
    return (
        f"{said}; name the one whose architecture it has, and set its shape with base_emb_dim, "
        "base_num_decoder_layers, ..."
    )


def _where(name: str, at: dict[str, str]) -> str:
    path = f"configs/models/{name}.yml"
    if "until" in at:
        return f"MaxText's main had {path} until {at['until']} ({at['date']}): a MaxText from before then has it"
    return (
        f"only MaxText's unreleased {at['ref']} has {path} (commit {at['commit']}, {at['date']}): "
        "no MaxText release up to 0.2.5 has it"
    )


# -- regenerating the history file from a clone of AI-Hypercomputer/maxtext -------------------

_BASE_YML = (
    "MaxText/configs/base.yml",
    "src/MaxText/configs/base.yml",
    "src/maxtext/configs/base.yml",
)
_MODELS = re.compile(r"(?:^|/)configs/models/([^/]+)\.yml$")


def distill_history(git_dir: Path, models: set[str]) -> dict[str, Any]:
    """The history file's content from a clone of MaxText's repository (every ref fetched):
    base.yml keys its main dropped and 0.2.5 lacks, each with the commit that dropped it; model
    configs (not its GPU ones) any ref has had that 0.2.5 (`models`) lacks, each with where."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True, check=True
        ).stdout

    settings: dict[str, dict[str, str]] = {}
    log = git("log", "main", "--no-renames", "--format=#C %h %cs %s", "-p", "--", *_BASE_YML)
    for commit in log.split("\n#C ")[::-1]:  # oldest first: the last removal wins
        head, _, diff = commit.removeprefix("#C ").partition("\n")
        sha, date, subject = [*head.split(" ", 2), "", ""][:3]
        minus = set(re.findall(r"^-([a-z_][a-z0-9_]*):", diff, re.M))
        plus = set(re.findall(r"^\+([a-z_][a-z0-9_]*):", diff, re.M))
        for key in minus - plus - BASE_KEYS:
            settings[key] = {"commit": sha, "date": date, "subject": subject}
        for key in plus:
            settings.pop(key, None)
    found: dict[str, dict[str, str]] = {}
    listing = git("log", "main", "--no-renames", "--format=#C %h %cs", "--name-status", "--",
                  "*configs/models/*.yml")  # fmt: skip
    for commit in listing.split("\n#C ")[::-1]:
        head, _, names = commit.removeprefix("#C ").partition("\n")
        sha, date = head.split(" ")[:2]
        for status, path in (ln.split("\t", 1) for ln in names.splitlines() if "\t" in ln):
            match = _MODELS.search(path)
            if not match or "/gpu/" in path or match.group(1) in models:
                continue
            if status == "D":
                found[match.group(1)] = {"until": sha, "date": date}
            else:
                found.pop(match.group(1), None)
    every = git("log", "--all", "--diff-filter=A", "--no-renames", "--format=#C %H %cs",
                "--name-only", "--", "*configs/models/*.yml")  # fmt: skip
    for commit in every.split("\n#C ")[::-1]:
        head, _, paths = commit.removeprefix("#C ").partition("\n")
        sha, date = head.split(" ")[:2]
        for path in paths.split():
            match = _MODELS.search(path)
            name = match.group(1) if match else ""
            if not match or "/gpu/" in path or name in models or name in found:
                continue
            refs = git("for-each-ref", "--contains", sha, "--format=%(refname)", "refs/heads",
                       "refs/pull").split()  # fmt: skip
            heads = sorted(r.removeprefix("refs/heads/") for r in refs if r.startswith("refs/h"))
            pulls = sorted(int(r.split("/")[2]) for r in refs if r.startswith("refs/pull/"))
            ref = f"branch {heads[0]}" if heads else f"pull request #{pulls[0]}" if pulls else ""
            if ref:
                found[name] = {"ref": ref, "commit": sha[:9], "date": date}
    return {"settings": dict(sorted(settings.items())), "models": dict(sorted(found.items()))}
