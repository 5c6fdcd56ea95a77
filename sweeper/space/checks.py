"""Checks of a space beyond its schema: every knob value and warm-start point makes a valid
trial configuration (and, for MaxText, settings MaxText can take), LIBTPU flags libtpu
knows, a sampler that can serve the space, a point that can run; then the one validation
path every sweep and `sweeper validate` take (`check_space`)."""

from __future__ import annotations

from difflib import get_close_matches
from typing import Any

import yaml
from pydantic import ValidationError

from sweeper.space.errors import SpaceError
from sweeper.space.file import line_of
from sweeper.space.inert import pin_inert
from sweeper.space.points import (
    KEY_SEPARATOR,
    active,
    assemble,
    condition_words,
    count_points,
    counted,
    in_words,
    join_key,
    listed,
    maxtext_knobs,
    point_words,
    points,
)
from sweeper.space.schema import Knob, Space
from trainer.trial.checks import check_static
from trainer.trial.config import MESH_AXES, ConfigError, MeshConfig, TrialConfig, load_config
from trainer.trial.events import SUMMARY_NUMBERS
from trainer.trial.hardware import Backend
from trainer.trial.maxtext import KNOB_PREFIX, MaxTextProgram, program_settings, to_maxtext
from trainer.trial.maxtext_sharding import check_shardable, maxtext_degrees
from trainer.trial.schema import first_error


def check_objective(space: Space, root: yaml.Node | None, file: str) -> None:
    """Each objective names a number a trial's summary carries."""
    for which, objective in (("primary", space.objective.primary),
                             ("secondary", space.objective.secondary)):  # fmt: skip
        if objective is not None and objective.metric not in SUMMARY_NUMBERS:
            near = get_close_matches(objective.metric, SUMMARY_NUMBERS, n=3)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise SpaceError(
                f"unknown metric {objective.metric!r}: {hint}a trial reports "
                "tokens_per_sec_per_chip, mfu, step_time_median_s, est_tokens_per_sec_per_chip, "
                "hbm_per_device_gib and the other numbers in docs/reference.md (trainer events)",
                file=file,
                line=line_of(root, ("objective", which, "metric")),
                field=f"objective.{which}.metric",
            )


def check_knobs(space: Space, root: yaml.Node | None, file: str) -> None:
    """Each knob value, with its conditions met, must make a valid trial configuration."""
    check_objective(space, root, file)
    try:
        load_config(space.base_trial())
    except ConfigError as exc:
        # Name the key where it sits in the space: model.* under `model`, the rest under `trial`.
        loc = (
            tuple(exc.field.split(KEY_SEPARATOR))
            if exc.field.startswith("model")
            else ("trial", *exc.field.split(KEY_SEPARATOR))
        )
        raise SpaceError(
            exc.message, file=file, line=line_of(root, loc), field=join_key(*loc)
        ) from None
    order = list(space.knobs)
    for key, knob in space.knobs.items():
        for parent in knob.when:
            if parent not in space.knobs or order.index(parent) > order.index(key):
                raise SpaceError(
                    f"condition on {parent!r}, which is not a knob listed before this one",
                    file=file,
                    line=line_of(root, ("knobs", key, "when")),
                    field=f"knobs.{key}.when",
                )
        values = knob.extremes()
        for value in values:
            point = knob.condition_point()
            point[key] = int(value) if knob.kind == "int" else value
            try:
                load_config(assemble(space, point))
            except ConfigError as exc:
                raise SpaceError(
                    f"value {in_words(value)} makes an invalid trial: {exc}",
                    file=file,
                    line=line_of(root, ("knobs", key)),
                    field=f"knobs.{key}",
                ) from None
    if space.program == "maxtext":
        _check_maxtext(space, root, file)
    check_warm_start(space, file, root)


# What a MaxText trial handles itself though MaxText has no setting for it: its data is
# MaxText's synthetic data, its devices the slice's, its warm-up steps skipped by the driver.
_MAXTEXT_HANDLED = frozenset({"data.source", "num_devices", "cpu_cores", "measure.skip_steps"})


def _check_maxtext(space: Space, root: yaml.Node | None, file: str) -> None:
    """A MaxText space: every setting of its trials, and every value of every knob, is one
    MaxText can take; what it cannot is refused by name before any trial runs."""
    platform = space.default_backend
    recipe = space.maxtext_program().recipe
    # what the recipe's own configuration cannot map, its settings carry as written
    # (`over_recipe`): MaxText runs the recipe's model by its name, not our shape of it
    own = to_maxtext(recipe.config(), platform).unmapped if recipe is not None else []
    for u in to_maxtext(load_config(space.base_trial()), platform).unmapped:
        if u.field not in _MAXTEXT_HANDLED and u not in own:
            raise SpaceError(
                f"{u.field} = {u.value!r}: MaxText has no setting for it ({u.why}); remove "
                "it, or run the space with program: sweeper-trainer",
                file=file,
                line=line_of(root, ("trial", *u.field.split(KEY_SEPARATOR))),
                field=f"trial.{u.field}",
            )
    for key, knob in space.knobs.items():
        if key.startswith(KNOB_PREFIX):
            continue
        for value in knob.extremes():
            point = {**knob.condition_point(), key: int(value) if knob.kind == "int" else value}
            config = load_config(assemble(space, point))
            for u in to_maxtext(config, platform).unmapped:
                if u in own:
                    continue
                if u.field == key or _under(u.field, key) or _under(key, u.field):
                    raise SpaceError(
                        f"value {value!r}: MaxText has no setting for {u.field} = {u.value!r} "
                        f"({u.why}); remove the value, or run the space with program: "
                        "sweeper-trainer",
                        file=file,
                        line=line_of(root, ("knobs", key)),
                        field=f"knobs.{key}",
                    )


def _under(key: str, parent: str) -> bool:
    """Whether dotted `key` lies under `parent` (`remat.custom.context` under `remat`)."""
    return key.startswith(parent + KEY_SEPARATOR)


def _admits(knob: Knob, value: Any) -> bool:
    """Whether the knob can take `value` (True is not 1 here: YAML keeps them apart)."""
    if knob.values is not None:
        return any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in knob.values
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    low, high = knob.bounds
    return low <= value <= high and (knob.kind != "int" or float(value).is_integer())


def check_warm_start(
    space: Space, file: str | None = None, root: yaml.Node | None = None, why: str = ""
) -> None:
    """Every warm-start point: known keys, each value one its knob can take (`why` says
    what shaped the knob, e.g. pinning), conditions met, and a valid trial configuration."""
    for i, point in enumerate(space.search.warm_start):
        line = line_of(root, ("search", "warm_start", i))
        unknown = sorted(set(point) - set(space.knobs))
        if unknown:
            raise SpaceError(
                f"{listed(unknown)} {'is not a knob' if len(unknown) == 1 else 'are not knobs'} "
                "of this space",
                file=file,
                line=line,
                field=f"search.warm_start.{i}",
            )
        for key, value in point.items():
            knob = space.knobs[key]
            if not active(knob, point):
                raise SpaceError(
                    f"{key} is only sampled when {condition_words(knob.when)}; drop it from this "
                    "point or meet the condition",
                    file=file,
                    line=line,
                    field=f"search.warm_start.{i}.{key}",
                )
            if not _admits(knob, value):
                allowed = (
                    in_words(knob.values)
                    if knob.values is not None
                    else f"[{knob.low}, {knob.high}]"
                )
                raise SpaceError(
                    f"{in_words(value)} is not a value of knob {key} ({allowed}){why}",
                    file=file,
                    line=line,
                    field=f"search.warm_start.{i}.{key}",
                )
        try:
            load_config(assemble(space, point))
        except ConfigError as exc:
            raise SpaceError(
                f"makes an invalid trial: {exc}",
                file=file,
                line=line,
                field=f"search.warm_start.{i}",
            ) from None


def check_feasible(space: Space, num_devices: int | None = None, limit: int = 256) -> None:
    """Refuse a space none of whose points makes a trial that could run (static checks)."""
    checked = points(space, limit)
    first: tuple[dict[str, Any], Exception] | None = None
    for point in checked:
        try:
            static_check(space, point, num_devices)
            return
        except (ConfigError, SpaceError) as error:
            first = first or (point, error)
    if first:
        point, exc = first
        scope = "every point" if len(checked) < limit else f"each of the first {limit} points"
        raise SpaceError(
            f"{scope} of this space makes an invalid trial on {num_devices or space.num_devices} "
            f"devices; e.g. {point_words(point) or 'the base trial'}: {exc}",
            field="knobs",
        )


MESH_KNOB = "mesh" + KEY_SEPARATOR  # the mesh degree knobs: mesh.<axis>
# Walking the space's mesh combinations stops past this many steps (the check is then left
# to the trials, as before it).
MAX_MESH_WALK = 100_000


def _mesh_knobs(space: Space) -> list[str]:
    return [k for k in space.knobs
            if k.startswith(MESH_KNOB) and k.removeprefix(MESH_KNOB) in MESH_AXES]  # fmt: skip


def mesh_combinations(space: Space) -> list[dict[str, Any]] | None:
    """Every combination of the mesh degree knobs' values a point of the space can hold, with
    their conditions met whatever else the point holds; None where a mesh knob is a continuous
    range or there are too many to walk."""
    degrees = _mesh_knobs(space)
    if any(space.knobs[k].candidates() is None for k in degrees):
        return None
    parents = {p for knob in space.knobs.values() for p in knob.when}
    keys = [k for k in space.knobs if k in degrees or k in parents]
    found: dict[tuple[tuple[str, Any], ...], None] = {}
    steps = 0

    def values(key: str) -> list[Any]:
        knob = space.knobs[key]
        named = [v for other in space.knobs.values() for c in [other.when.get(key)]
                 if c is not None for v in (c if isinstance(c, list) else [c])]  # fmt: skip
        # A continuous parent: the values its conditions name, and one they do not.
        return knob.candidates() or [*named, object()]

    def walk(i: int, point: dict[str, Any]) -> None:
        nonlocal steps
        steps += 1
        if steps > MAX_MESH_WALK:
            raise OverflowError
        if i == len(keys):
            found[tuple((k, point[k]) for k in degrees if k in point)] = None
            return
        if not space.knobs[keys[i]].met_by(point):
            walk(i + 1, point)
            return
        for value in values(keys[i]):
            walk(i + 1, {**point, keys[i]: value})

    try:
        walk(0, {})
    except OverflowError:
        return None
    return [dict(c) for c in found]


def check_mesh_degrees(space: Space, num_devices: int | None = None) -> None:
    """Refuse a mesh degree no point of the space can run with on its devices (`num_devices`,
    else the target's): a value of a `mesh.*` knob that fails to make a mesh of them in every
    combination with the other mesh knobs the space can reach. Left to the sweep where the
    devices are not known before it starts (target local without `devices`)."""
    if num_devices is None and space.target.is_local and space.devices is None:
        return
    devices = num_devices or space.num_devices
    combinations = mesh_combinations(space)
    if not combinations:
        return
    base = space.base_trial().get("mesh", {})
    for key in _mesh_knobs(space):
        for value in space.knobs[key].candidates() or []:
            holding = [c for c in combinations if key in c and c[key] == value]
            failures = [(c, why) for c in holding
                        for why in [_mesh_fault(base, c, devices)] if why]  # fmt: skip
            if not holding or len(failures) < len(holding):
                continue
            combination, why = failures[0]
            others = " ".join(f"{k.removeprefix(MESH_KNOB)}={v}"
                              for k, v in combination.items() if k != key)  # fmt: skip
            each = (
                f"it fails in each of the {len(holding)} combinations with the other mesh "
                "knobs the space holds; "
                if len(holding) > 1
                else ""
            )
            raise SpaceError(
                f"value {in_words(value)} can never run on the {devices} devices of target "
                f"{space.target}: {each}{f'with {others}, ' if others else ''}{why}; remove it "
                "from the values",
                field=f"knobs.{key}",
            )


def _mesh_fault(base: dict[str, Any], combination: dict[str, Any], devices: int) -> str:
    """Why the base trial's mesh with `combination`'s degrees makes no mesh of `devices` (empty
    when it does)."""
    mesh = {**base, **{k.removeprefix(MESH_KNOB): v for k, v in combination.items()}}
    try:
        MeshConfig.model_validate(mesh).resolve(devices)
    except ConfigError as exc:
        return exc.message
    except ValidationError as exc:
        return first_error(exc)[1]
    return ""


def static_check(
    space: Space, point: dict[str, Any], num_devices: int | None = None
) -> TrialConfig:
    """The trial config of a point, with every JAX-free check; raises ConfigError."""
    config = load_config(assemble(space, point))
    devices = num_devices or space.num_devices
    check_static(config, devices, space.default_backend)
    if space.program == "maxtext":
        slices = space.target.topology.slices if space.target.topology is not None else 1
        check_maxtext_mesh(config, space.maxtext_program(), maxtext_knobs(point), devices, slices)
    return config


def check_maxtext_mesh(
    config: TrialConfig,
    program: MaxTextProgram,
    knobs: dict[str, Any],
    devices: int,
    slices: int = 1,
) -> None:
    """The mesh MaxText makes of a trial's settings (its knobs mapped, over an imported recipe's
    own), one it can shard the model over on `devices` in `slices`; raises ConfigError."""
    args = program_settings(config, program, knobs).args
    check_shardable(config, maxtext_degrees(args, devices, slices))


def check_flags(space: Space) -> None:
    """An unknown LIBTPU flag would abort every trial that carries it: refuse it before the
    sweep. The flags are the base trial's and each value of an `xla.` knob (load_space has
    checked that each makes a valid trial)."""
    if space.target.is_local:
        return
    from trainer.trial.config import XlaFlagsConfig
    from trainer.trial.flags import unknown_flag

    base = space.base_trial().get("xla", {})
    candidates = [("trial.xla", base)] + [
        (f"knobs.{key}", {**base, key.removeprefix("xla."): value})
        for key, knob in space.knobs.items()
        if key.startswith("xla.")
        for value in knob.extremes()
    ]
    for field, xla in candidates:
        flags = XlaFlagsConfig.model_validate(xla).libtpu_init_args()
        rejected = unknown_flag(tuple(flags))
        if rejected:
            raise SpaceError(f"{rejected}; libtpu would abort every trial with it", field=field)


def check_sampler(space: Space) -> None:
    """Raise ValueError naming the fix when the chosen sampler cannot serve this space."""
    sampler = space.search.sampler
    if sampler == "grid":
        conditional = [k for k, knob in space.knobs.items() if knob.when]
        continuous = [k for k, knob in space.knobs.items() if knob.candidates() is None]
        if conditional or continuous:
            raise ValueError(
                "search.sampler: grid needs unconditional discrete knobs; "
                + "; ".join(
                    f"{what}: {', '.join(keys)}"
                    for what, keys in (("conditional", conditional), ("continuous", continuous))
                    if keys
                )
                + ". Use tpe or random."
            )
    needs = {"gp": ("torch", "pip install torch"), "cmaes": ("cmaes", "pip install cmaes")}
    if sampler in needs:
        module, fix = needs[sampler]
        try:
            __import__(module)
        except ImportError:
            raise ValueError(
                f"search.sampler: {sampler} needs the {module!r} package ({fix}), or use tpe"
            ) from None
    if sampler == "nsga2" and space.objective.secondary is None:
        raise ValueError(
            "search.sampler: nsga2 is multi-objective; add objective.secondary or use tpe"
        )


def cap_grid(space: Space) -> tuple[Space, list[str]]:
    """A grid sweep runs each point once: more trials than points would repeat them."""
    points = count_points(space)
    if space.search.sampler != "grid" or points is None or space.search.trials <= points:
        return space, []
    search = space.search.model_copy(update={"trials": points})
    note = (
        f"search.trials {space.search.trials:,} capped at {points:,}: the grid has "
        f"{counted(points, 'point')}"
    )
    return space.model_copy(update={"search": search}), [note]


def check_space(
    space: Space, backend: Backend | None = None, num_devices: int | None = None
) -> tuple[Space, list[str]]:
    """The one validation path of a space, for `sweeper validate` and for every sweep: LIBTPU
    flags, values inert on `backend` pinned away (with a note each), then warm-start points,
    feasibility on `num_devices` and the sampler, on the space as it will be sampled.
    Raises SpaceError naming the field."""
    check_flags(space)
    pinned, notes = pin_inert(space, backend)
    if notes:  # load_space checked the warm start against the space as written
        on = f" on {backend}" if backend else ""
        check_warm_start(pinned, why=f" once values inert{on} are pinned away")
    check_mesh_degrees(pinned, num_devices)
    check_feasible(pinned, num_devices)
    try:
        check_sampler(pinned)
    except ValueError as exc:
        message = str(exc).removeprefix("search.sampler: ")
        raise SpaceError(message, field="search.sampler") from None
    return pinned, notes
