"""Reading the files users write: YAML (line numbers for every error, duplicate keys refused) and
DeepSpeed JSON configs. Every failure is one :class:`~orchestrator.errors.SpecError` (or the
subclass the caller names) that names the file and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import SpecError

__all__ = ["read_yaml", "line_of", "read_deepspeed_config"]


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
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise error(f"{what[0].upper() + what[1:]} {p} does not exist.", path=str(p)) from err
    except OSError as err:
        raise error(f"Cannot read {what} {p}: {err.strerror}.", path=str(p)) from err
    except UnicodeDecodeError as err:
        raise error(f"{what[0].upper() + what[1:]} {p} is not UTF-8 text (bad byte at offset {err.start}); "
                    "expected a YAML file.", path=str(p)) from err
    try:
        tree = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise error(f"{what[0].upper() + what[1:]} {p} is not valid YAML{where}: {problem}.", path=str(p)) from err
    return tree, ({} if data is None else data)


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
    try:
        text = Path(cfg).read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read DeepSpeed config {cfg}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise SpecError(f"DeepSpeed config {cfg} is not UTF-8 text (bad byte at offset {err.start}); expected "
                        "a JSON file") from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"DeepSpeed config {cfg} is not valid JSON: {err.msg} at line {err.lineno}, "
                        f"column {err.colno}") from err
    if not isinstance(value, dict):
        raise SpecError(f"DeepSpeed config {cfg} must be a JSON object; got {type(value).__name__}")
    return value
