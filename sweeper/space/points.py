"""Points of a space: a sampled point (knob name -> value), the trial configuration it makes,
which knobs it activates, every point of a space (or the first N), and the keys a point
carries in a Ray Tune trial's config besides its knobs."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import yaml

from sweeper.space.errors import SpaceError
from sweeper.space.schema import Knob, Space
from trainer.trial.maxtext import KNOB_PREFIX as MAXTEXT_PREFIX

# Knob names and every dotted key of a space: parts joined by this separator.
KEY_SEPARATOR = "."
# Config keys of a Tune trial that steer it and are not knobs.
CONTROL_PREFIX = "sweeper."
OPTUNA_NUMBER_KEY = "sweeper.optuna_trial"  # the Optuna trial that drew the point
# A point measured before in this study: its stored result, reused instead of run again.
REUSE_KEY = "sweeper.reuse"
# A trial that measures again the point of an ended trial of this sweep (its Tune id).
REMEASURE_KEY = "sweeper.remeasure_of"
# That trial traces its last steps with the profiler: the best point's re-measurement.
PROFILE_KEY = "sweeper.profile"


def knob_point(config: dict[str, Any]) -> dict[str, Any]:
    """The sampled knob values of a Tune trial config (without the engine's control keys)."""
    return {k: v for k, v in config.items() if not k.startswith(CONTROL_PREFIX)}


def first_point(space: Space) -> dict[str, Any]:
    """Trial 0's knob values: the space's first warm start, else none (its trial alone)."""
    return dict(space.search.warm_start[0]) if space.search.warm_start else {}


def join_key(*parts: str) -> str:
    """Parts of a key joined as a space writes them (`knobs`, `mesh.tensor` -> `knobs.mesh.tensor`)."""
    return KEY_SEPARATOR.join(parts)


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(KEY_SEPARATOR)
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpaceError(
                f"{join_key(*parts)} crosses a non-mapping value", field=f"knobs.{dotted}"
            )
    node[parts[-1]] = value


def assemble(space: Space, point: dict[str, Any]) -> dict[str, Any]:
    """Trial configuration dict for a sampled point (knob path -> value); `maxtext.*` knobs
    are MaxText's settings, not the trial configuration's (`maxtext_knobs`)."""
    trial = space.base_trial()
    for key, value in point.items():
        if not key.startswith(MAXTEXT_PREFIX):
            set_path(trial, key, value)
    return trial


def maxtext_knobs(point: dict[str, Any]) -> dict[str, Any]:
    """A point's MaxText settings (`maxtext.<key>` knobs)."""
    return {k: v for k, v in point.items() if k.startswith(MAXTEXT_PREFIX)}


def counted(count: int, noun: str) -> str:
    """A count and its noun, as a sentence has them: `1 trial`, `1,259,712 points`."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def in_words(value: Any) -> str:
    """A value as a space file writes it (YAML's flow style: `fp8`, `[full, minimal]`,
    `{mesh.tensor: 2}`), not as Python's repr (`'fp8'`, `['full', 'minimal']`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False)
    return text.strip().removesuffix("\n...")


def listed(values: Iterable[Any]) -> str:
    """Values one after another: `full, minimal`."""
    return ", ".join(in_words(v) for v in values)


def point_words(point: dict[str, Any]) -> str:
    """A point as its knobs and values: `mesh.tensor=3 remat.policy=full`."""
    return " ".join(f"{k}={in_words(v)}" for k, v in point.items())


def condition_words(when: dict[str, Any]) -> str:
    """A knob's condition said: `precision.mode is fp8`, `precision.mode is fp8 or int8`."""
    return " and ".join(
        f"{k} is {' or '.join(in_words(x) for x in v) if isinstance(v, list) else in_words(v)}"
        for k, v in when.items()
    )


def active(knob: Knob, point: dict[str, Any]) -> bool:
    return knob.met_by(point)


def points(space: Space, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` points in order (ranges contribute their ends and middle)."""
    keys, found = list(space.knobs), list[dict[str, Any]]()

    def walk(i: int, point: dict[str, Any]) -> None:
        if len(found) >= limit:
            return
        if i == len(keys):
            found.append(dict(point))
            return
        knob = space.knobs[keys[i]]
        if not active(knob, point):
            walk(i + 1, point)
            return
        values = knob.candidates()
        if values is None:
            low, high = knob.bounds
            mid = (low + high) / 2
            values = [low, int(mid) if knob.kind == "int" else mid, high]
        for value in values:
            walk(i + 1, {**point, keys[i]: int(value) if knob.kind == "int" else value})

    walk(0, {})
    return found


def sample_points(space: Space, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct points drawn at random from the whole space, never enumerated (a space
    of millions): each knob's value drawn in turn where the knob is active. Fewer where the
    space holds fewer."""
    rng = random.Random(seed)
    keys, found = list(space.knobs), dict[str, dict[str, Any]]()
    for _ in range(n * 20):
        if len(found) >= n:
            break
        point: dict[str, Any] = {}
        for key in keys:
            knob = space.knobs[key]
            if not active(knob, point):
                continue
            values = knob.candidates()
            if values is None:
                low, high = knob.bounds
                value = (
                    rng.randint(int(low), int(high))
                    if knob.kind == "int"
                    else rng.uniform(low, high)
                )
            else:
                value = rng.choice(values)
            point[key] = int(value) if knob.kind == "int" else value
        found.setdefault(in_words(point), point)
    return list(found.values())


def count_points(space: Space) -> int | None:
    """Distinct points (conditional knobs counted only where active); None if continuous.
    Counted, not enumerated: the points below knob i depend only on the values of the knobs
    that later conditions name, so each such prefix is counted once (an imported recipe's
    space of 1.9 million points in milliseconds, where walking them took seconds)."""
    keys = list(space.knobs)
    # The knobs named by the conditions of knob i or a later one, for each i.
    named: list[tuple[str, ...]] = [()] * (len(keys) + 1)
    for i in reversed(range(len(keys))):
        named[i] = tuple(sorted({*named[i + 1], *space.knobs[keys[i]].when}))
    counts: dict[tuple[int, str], int] = {}

    def walk(i: int, point: dict[str, Any]) -> int:
        if i == len(keys):
            return 1
        memo = (i, repr([point.get(k) for k in named[i]]))
        if memo in counts:
            return counts[memo]
        knob = space.knobs[keys[i]]
        if not active(knob, point):
            count = walk(i + 1, point)
        elif (values := knob.candidates()) is None:
            raise OverflowError
        else:
            count = sum(walk(i + 1, {**point, keys[i]: v}) for v in values)
        counts[memo] = count
        return count

    try:
        return walk(0, {})
    except OverflowError:
        return None
