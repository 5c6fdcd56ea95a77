"""Reading a space file defensively: size, encoding, duplicate keys and alias expansion bounded.

A space is a few hundred lines written by a person; anything far beyond that is a mistake
or an attack (a YAML alias bomb is 745 bytes), and each is refused with the file named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20
# Nodes after expanding aliases: a real space has hundreds; a bomb has billions.
MAX_EXPANDED_NODES = 100_000
# Values one knob may list: discrete knobs are enumerated (counting, grid search, checks);
# beyond this they are ranges.
MAX_CANDIDATES = 10_000


class SpaceFileError(ValueError):
    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message, self.line = message, line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (YAML would let the last one win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise SpaceFileError(
                    f"a mapping key must be a plain value, not {type(key).__name__}",
                    key_node.start_mark.line + 1,
                ) from None
            if key in seen:
                raise SpaceFileError(
                    f"duplicate key {key!r} (first on line {seen[key]}); YAML would silently "
                    "keep the last one: remove one of them",
                    key_node.start_mark.line + 1,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root: yaml.Node) -> None:
    """Count nodes as a loader's consumers would see them, aliases expanded; stop early."""
    count, stack, seen, aliased = 0, [root], set(), False
    while stack:
        node = stack.pop()
        count += 1
        aliased = aliased or id(node) in seen  # a node met twice: an alias expanded
        seen.add(id(node))
        if count > MAX_EXPANDED_NODES:
            why = (
                "once YAML aliases are expanded (an alias bomb?); write the space out without "
                "nested aliases"
                if aliased
                else "in the file: far more than a space needs (a knob takes at most "
                f"{MAX_CANDIDATES:,} values); give a range (low, high, step) instead of a list"
            )
            raise SpaceFileError(
                f"more than {MAX_EXPANDED_NODES:,} values {why}", node.start_mark.line + 1
            )
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _load(text: str) -> tuple[Any, yaml.Node | None]:
    try:
        root = yaml.compose(text, Loader=_StrictLoader)
        if root is not None:
            _check_expansion(root)
        return yaml.load(text, Loader=_StrictLoader), root
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SpaceFileError(
            f"not valid YAML: {getattr(exc, 'problem', None) or exc}",
            mark.line + 1 if mark else None,
        ) from None
    except RecursionError:
        raise SpaceFileError("nested too deeply to be a space") from None


def parse_value(text: str) -> Any:
    """One `--set key=VALUE` value, read as YAML under the same bounds as a file."""
    if len(text) > 65536:
        raise SpaceFileError(f"a value of {len(text):,} characters; at most 65,536")
    return _load(text)[0]


def read_space_file(path: Path) -> tuple[dict[str, Any], yaml.Node]:
    """The mapping in a space file and its node tree (for line numbers)."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SpaceFileError(f"{size:,} bytes; a space file is at most {MAX_BYTES:,} bytes")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpaceFileError(
            f"not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}); save it as UTF-8",
            line,
        ) from None
    data, root = _load(text)
    if not isinstance(data, dict) or root is None:
        raise SpaceFileError("the top level must be a mapping", 1)
    return data, root


def line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The line (1-based) of the node at `loc` in a space file's tree, or of its nearest
    parent that is there; None without a tree (a space given as a dict)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == str(part)), None)
            if match is None:
                key = next((k for k, _ in node.value if k.value == str(part)), None)
                return (key.start_mark.line + 1) if key else line
            node = match
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
        else:
            break
        line = node.start_mark.line + 1
    return line
