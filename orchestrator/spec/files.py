"""Reading the files users write: YAML (line numbers for every error, duplicate keys refused) and
DeepSpeed JSON configs. Every failure is one :class:`~orchestrator.errors.SpecError` (or the
subclass the caller names) that names the file and what was expected.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import OrchError, SpecError

__all__ = ["read_yaml", "line_of", "read_deepspeed_config", "read_capped", "MAX_INPUT_BYTES", "MAX_DEPTH",
           "MAX_YAML_VALUES"]

#: the largest spec, config or hostfile read (a hostfile of 100,000 hosts is about 3 MiB)
MAX_INPUT_BYTES = 8 << 20
#: the deepest nesting of mappings and lists in a YAML or JSON file (DeepSpeed's configs use 4)
MAX_DEPTH = 64
#: the most values a YAML file may stand for once its aliases are expanded (a spec has hundreds)
MAX_YAML_VALUES = 100_000


def read_capped(path: str | Path, what: str, error: type[OrchError]) -> str:
    """The UTF-8 text of a file users name (spec, config, hostfile), refusing what no such file is.

    Raises:
        ``error``: the path is missing, a directory or not a regular file (a pipe or device would be
        read forever), larger than :data:`MAX_INPUT_BYTES`, unreadable, or not UTF-8; each message names
        the file and what was expected, and quotes nothing of it.
    """
    name = os.fsdecode(path)
    label = what[0].upper() + what[1:]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{label} {name} does not exist.", path=name) from None
    except OSError as err:
        raise error(f"Cannot read {what} {name}: {err.strerror}.", path=name) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{label} {name} is a directory; expected a file.", path=name)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{label} {name} is not a regular file (a pipe, socket or device); expected a file.",
                        path=name)
        if st.st_size > MAX_INPUT_BYTES:
            raise error(f"{label} {name} is {st.st_size / (1 << 20):.1f} MiB; orch reads {what}s of at most "
                        f"{MAX_INPUT_BYTES >> 20} MiB.", path=name)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_INPUT_BYTES + 1)  # /proc files say size 0
    except OSError as err:
        raise error(f"Cannot read {what} {name}: {err.strerror}.", path=name) from None
    finally:
        os.close(fd)
    if len(data) > MAX_INPUT_BYTES:
        raise error(f"{label} {name} is larger than {MAX_INPUT_BYTES >> 20} MiB, the most orch reads.", path=name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{label} {name} is not UTF-8 text (bad byte at offset {err.start}); expected a text file.",
                    path=name) from None


def _check_yaml_shape(text: str, name: str, what: str, error: type[SpecError]) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` (read as a stream of events: nothing recursive yet)."""
    depth = 0
    for event in yaml.parse(text, Loader=_UniqueKeyLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise error(f"{what[0].upper() + what[1:]} {name} nests mappings and lists more than {MAX_DEPTH} "
                            f"levels deep (at line {event.start_mark.line + 1}); no spec or config needs that.",
                            path=name)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_yaml_size(tree: yaml.Node | None, name: str, what: str, error: type[SpecError]) -> None:
    """Refuse a node graph that stands for more than :data:`MAX_YAML_VALUES` values once aliases are expanded
    (a "billion laughs" alias bomb), or that refers to itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise error(f"{what[0].upper() + what[1:]} {name} has an alias that refers to the value it is in (line "
                        f"{node.start_mark.line + 1}); expected a tree.", path=name)
        open_.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        open_.discard(key)
        if total > MAX_YAML_VALUES:
            raise error(f"{what[0].upper() + what[1:]} {name} stands for more than {MAX_YAML_VALUES:,} values once "
                        f"its aliases (*name) are expanded (from line {node.start_mark.line + 1}): an alias bomb? "
                        "Write the values out, or use fewer aliases.", path=name)
        sizes[key] = total
        return total

    if tree is not None:
        size(tree)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error
    (plain YAML loaders silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def read_yaml(p: Path, what: str, error: type[SpecError] = SpecError) -> tuple[Any, Any]:
    """Read a YAML file for error messages with lines: ``(node tree, data)``; an empty file is ``{}``.

    Duplicate keys are refused (:class:`_UniqueKeyLoader`).

    Raises:
        ``error`` (a SpecError): the file is missing, unreadable, or not YAML (line and column named).
    """
    text = read_capped(p, what, error)
    try:
        _check_yaml_shape(text, str(p), what, error)
        tree = yaml.compose(text, Loader=_UniqueKeyLoader)
        _check_yaml_size(tree, str(p), what, error)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise error(f"{what[0].upper() + what[1:]} {p} has a number too long to read ({str(err).split(';')[0]}); "
                    "no setting needs one.", path=str(p)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise error(f"{what[0].upper() + what[1:]} {p} is not valid YAML{where}: {problem}.", path=str(p)) from err
    return tree, ({} if data is None else _joined(data, p, what, error))


def _joined(value: Any, p: Path, what: str, error: type[SpecError], at: str = "") -> Any:
    """``value`` with each ``"\\ud83d\\ude00"`` pair of escapes made the one character it stands for, as JSON
    does (YAML, which reads JSON files too, leaves two halves that no file name or command can hold).

    Raises:
        ``error``: a half without its other half (not text at all), naming where.
    """
    if isinstance(value, str):
        if not any("\ud800" <= c <= "\udfff" for c in value):
            return value
        try:
            return value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise error(f"{what[0].upper() + what[1:]} {p}: the value of {at or 'the document'} has a lone UTF-16 "
                        "surrogate escape (\\ud800-\\udfff without its pair): it is not text.", path=str(p)) from None
    if isinstance(value, dict):
        return {_joined(k, p, what, error, at): _joined(v, p, what, error, f"{at}.{k}" if at else str(k))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_joined(v, p, what, error, f"{at}[{i}]") for i, v in enumerate(value)]
    return value


def line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the YAML node at ``loc`` (or of its closest parent)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def read_deepspeed_config(cfg: str | Mapping[str, Any] | None) -> dict:
    """A job spec's ``deepspeed_config`` (a JSON file's path, a mapping, or None) as a dict ({} for None).

    Raises:
        SpecError: the file is missing, unreadable, not JSON (line and column named), or
            not a JSON object.
    """
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    text = read_capped(cfg, "DeepSpeed config", SpecError)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"DeepSpeed config {cfg} is not valid JSON: {err.msg} at line {err.lineno}, "
                        f"column {err.colno}") from err
    except RecursionError:
        raise SpecError(f"DeepSpeed config {cfg} nests objects and arrays more than {MAX_DEPTH} levels deep; no "
                        "config needs that.") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise SpecError(f"DeepSpeed config {cfg} has a number too long to read ({str(err).split(';')[0]}); no "
                        "setting needs one.") from None
    if json_depth(value) > MAX_DEPTH:
        raise SpecError(f"DeepSpeed config {cfg} nests objects and arrays more than {MAX_DEPTH} levels deep; no "
                        "config needs that.")
    if not isinstance(value, dict):
        raise SpecError(f"DeepSpeed config {cfg} must be a JSON object; got {type(value).__name__}")
    return value


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (0 for a scalar), found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
