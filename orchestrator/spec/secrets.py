"""Secret-looking environment values, masked wherever orch shows or records them (docs/security.md).

A variable is secret when its name looks it (upper-case, containing ``TOKEN``, ``KEY``, ``SECRET``,
``PASSWORD``, ``PASSWD`` or ``CREDENTIAL``: ``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``) or
matches one of the spec's ``secret_env`` patterns (fnmatch). :func:`redact` masks such variables in any
mapping of a value to be shown (a spec, a plan, an event), and every other occurrence of their values
in its strings (an ``-x NAME=value`` in a real command, an argument), as ``****``. The ranks still get the
real values: only what is shown, and what orch records outside its 0600 store, is masked.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import itertools
import operator
import re
import shlex
from collections.abc import Mapping
from typing import Any, Callable, Iterable

__all__ = ["MASK", "is_secret_name", "secret_values", "redact"]

MASK = "****"
_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
#: a value shorter than this is masked under its own name only, not searched for in other strings
_MIN_SEARCHED = 6


def is_secret_name(name: str, patterns: Iterable[str] = ()) -> bool:
    """Whether the variable ``name`` holds a secret (the module docstring's rule)."""
    if _ENV_NAME.fullmatch(name) and any(word in name for word in _WORDS):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


#: mappings of a variable to where its value is, not to the value: never masked
_PATHS_NOT_VALUES = frozenset({"env_from_file"})


def _secret_names(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """:func:`is_secret_name` under ``patterns``, answered once per name (a plan of 32,768 ranks repeats the
    same few dozen names in every rank's environment)."""
    seen: dict[str, bool] = {}

    def secret(name: str) -> bool:
        known = seen.get(name)
        if known is None:
            known = seen[name] = is_secret_name(name, patterns)
        return known
    return secret


#: values that hold nothing to look into (skipped without the checks below: a large plan has millions)
_LEAVES = frozenset({str, int, float, bool, type(None)})


def _is_mapping(obj: Any) -> bool:
    return type(obj) is dict or isinstance(obj, Mapping)  # dict first: the ABC's check is slower


#: a dataclass's field names to look into, per class
_FIELDS: dict[type, tuple[str, ...]] = {}


def _children(obj: Any) -> Iterable[Any]:
    if type(obj) in _LEAVES:
        return ()
    names = _FIELDS.get(type(obj))
    if names is not None:
        return [getattr(obj, name) for name in names]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj) if f.name not in _PATHS_NOT_VALUES)
        return [getattr(obj, name) for name in names]
    if _is_mapping(obj):
        return [v for k, v in obj.items() if k not in _PATHS_NOT_VALUES]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    return []


#: a dataclass that is not a mapping -> the names of its fields to look into (those :func:`_children` gives);
#: any other type -> None
_DATACLASS_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _dataclass_fields(kind: type) -> tuple[str, ...] | None:
    """The names of the fields to look into of a dataclass ``kind`` that is not a mapping (found once), else None."""
    if kind not in _DATACLASS_FIELDS:
        plain = dataclasses.is_dataclass(kind) and not issubclass(kind, Mapping)
        _DATACLASS_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind)
                                        if f.name not in _PATHS_NOT_VALUES) if plain else None
    return _DATACLASS_FIELDS[kind]


def _note_keys(mapping: Mapping, keys: Iterable[Any], secret: Callable[[str], bool], plain: set[str],
               found: set[tuple[str, str]]) -> None:
    """Add ``(name, value)`` of each secret variable among ``keys`` of ``mapping`` to ``found``, and each
    name that is not secret to ``plain``."""
    for k in keys:
        if not isinstance(k, str) or k in _PATHS_NOT_VALUES:
            continue
        if not secret(k):
            plain.add(k)
        elif isinstance(mapping[k], str) and mapping[k]:
            found.add((k, mapping[k]))


def _add_containers(values: Iterable[Any], out: dict[type, list]) -> None:
    """Add the ``values`` that are not leaves (:data:`_LEAVES`) to ``out``'s list of their type."""
    values = list(values)
    kinds = set(map(type, values))
    if len(kinds) == 1:  # (a column of one field of a group of dataclasses, the items of tuples...: in one step)
        kind = kinds.pop()
        if kind not in _LEAVES:
            out[kind].extend(values)
    elif not kinds <= _LEAVES:
        for c in values:
            if type(c) not in _LEAVES:
                out[type(c)].append(c)


def _secret_pairs(obj: Any, patterns: tuple[str, ...]) -> set[tuple[str, str]]:
    """``(name, value)`` of every secret variable in ``obj``'s mappings (dataclasses, dicts, lists, nested).

    Walked a level at a time, each level's objects grouped by type: a plan of 32,768 ranks is 32,768 rank
    dataclasses, their 32,768 argv tuples and 32,768 environments of the same few dozen names, and a group is
    looked into by C-level iteration (the names of all its dicts against those seen not to be secret, the types
    of all its values against :data:`_LEAVES`) unless that finds something to look at one by one. Any type but
    dicts, lists, tuples and dataclasses that are not mappings is looked into one by one (:func:`_children`)."""
    found: set[tuple[str, str]] = set()
    secret = _secret_names(patterns)
    plain: set[str] = set()  # names seen not to be secret: a dict's other keys are found by a set difference
    leaves, chain = _LEAVES, itertools.chain.from_iterable
    level: dict[type, list] = collections.defaultdict(list)
    _add_containers([obj], level)
    while level:
        groups, level = level, collections.defaultdict(list)
        for kind, items in groups.items():
            if kind is tuple or kind is list:
                if not leaves.issuperset(map(type, chain(items))):  # (else: argvs, slots: nothing to look into)
                    for t in items:
                        if not leaves.issuperset(map(type, t)):
                            _add_containers(t, level)
            elif kind is dict:
                if not plain.issuperset(chain(items)):
                    for d in items:
                        if not plain.issuperset(d):
                            _note_keys(d, d.keys() - plain, secret, plain, found)
                if not leaves.issuperset(map(type, chain(map(dict.values, items)))):
                    for d in items:
                        _add_containers((v for k, v in d.items() if k not in _PATHS_NOT_VALUES), level)
            elif _dataclass_fields(kind) is not None:
                for name in _dataclass_fields(kind):
                    _add_containers(map(operator.attrgetter(name), items), level)
            else:
                for item in items:
                    if _is_mapping(item):
                        _note_keys(item, item.keys(), secret, plain, found)
                    _add_containers(_children(item), level)
    return found


def secret_values(obj: Any, patterns: Iterable[str] = ()) -> set[str]:
    """The values of every secret variable in ``obj``'s mappings (dataclasses, dicts, lists, nested)."""
    return {v for _, v in _secret_pairs(obj, tuple(patterns))}


def redact(obj: Any, patterns: Iterable[str] = (), values: Iterable[str] = ()) -> Any:
    """``obj`` with every secret variable's value masked, and those values (plus ``values``) masked in all
    its strings. Dataclasses are copied with :func:`dataclasses.replace`, mappings become dicts, lists and
    tuples keep their type; ``obj`` itself is not changed. With nothing to mask (no secret variable, no
    ``values``), ``obj`` itself is returned: a plan of 32,768 ranks is not copied to change nothing."""
    patterns = tuple(patterns)
    pairs = _secret_pairs(obj, patterns)
    values = [v for v in values if v]
    if not pairs and not values:
        return obj  # (walk() would only copy: it masks the values of the pairs and the strings holding them)
    hidden = sorted({v for v in (*(v for _, v in pairs), *values) if len(v) >= _MIN_SEARCHED}, key=len, reverse=True)
    # NAME=value (as a shell or -x would write it), whatever the value's length
    named = [rf"(?<![A-Za-z0-9_]){re.escape(k)}=(?:{re.escape(shlex.quote(v))}|{re.escape(v)})(?![^\s;'\"])"
             for k, v in sorted(pairs, key=lambda kv: -len(kv[1]))]
    by_name = re.compile("|".join(named)) if named else None
    search = re.compile("|".join(re.escape(v) for v in hidden)) if hidden else None
    secret = _secret_names(patterns)

    def text(s: str) -> str:
        if by_name is not None:
            s = by_name.sub(lambda m: m.group(0).split("=", 1)[0] + "=" + MASK, s)
        return search.sub(MASK, s) if search is not None else s

    def walk(item: Any) -> Any:
        if type(item) in _LEAVES and type(item) is not str:
            return item
        if isinstance(item, str):
            return text(item) if by_name is not None or search is not None else item
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return dataclasses.replace(item, **{f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item)
                                                if f.init and f.name not in _PATHS_NOT_VALUES})
        if _is_mapping(item):
            return {k: (v if k in _PATHS_NOT_VALUES else
                        MASK if isinstance(k, str) and isinstance(v, str) and v and secret(k)
                        else walk(v)) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item) if not hasattr(item, "_fields") else type(item)(*map(walk, item))
        return item

    return walk(obj)
