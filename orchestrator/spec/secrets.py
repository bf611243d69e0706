"""Secret-looking environment values, masked wherever orch shows or records them (docs/security.md).

A variable is secret when its name looks it (upper-case, containing ``TOKEN``, ``KEY``, ``SECRET``,
``PASSWORD``, ``PASSWD`` or ``CREDENTIAL``: ``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``) or
matches one of the spec's ``secret_env`` patterns (fnmatch). :func:`redact` masks such variables in any
mapping of a value to be shown (a spec, a plan, an event), and every other occurrence of their values
in its strings (an ``-x NAME=value`` in a real command, an argument), as ``****``. The ranks still get the
real values: only what is shown, and what orch records outside its 0600 store, is masked.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, Iterable, Mapping

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


def _children(obj: Any) -> Iterable[Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in _PATHS_NOT_VALUES]
    if isinstance(obj, Mapping):
        return [v for k, v in obj.items() if k not in _PATHS_NOT_VALUES]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    return []


def secret_values(obj: Any, patterns: Iterable[str] = ()) -> set[str]:
    """The values of every secret variable in ``obj``'s mappings (dataclasses, dicts, lists, nested)."""
    patterns = tuple(patterns)
    found: set[str] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            found.update(v for k, v in item.items() if isinstance(k, str) and isinstance(v, str) and v
                         and is_secret_name(k, patterns))
        stack.extend(_children(item))
    return found


def redact(obj: Any, patterns: Iterable[str] = (), values: Iterable[str] = ()) -> Any:
    """``obj`` with every secret variable's value masked, and those values (plus ``values``) masked in all
    its strings. Dataclasses are copied with :func:`dataclasses.replace`, mappings become dicts, lists and
    tuples keep their type; ``obj`` itself is not changed."""
    patterns = tuple(patterns)
    hidden = sorted({v for v in (*secret_values(obj, patterns), *values) if len(v) >= _MIN_SEARCHED},
                    key=len, reverse=True)
    search = re.compile("|".join(re.escape(v) for v in hidden)) if hidden else None

    def text(s: str) -> str:
        return search.sub(MASK, s) if search is not None else s

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return text(item)
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return dataclasses.replace(item, **{f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item)
                                                if f.init and f.name not in _PATHS_NOT_VALUES})
        if isinstance(item, Mapping):
            return {k: (v if k in _PATHS_NOT_VALUES else
                        MASK if isinstance(k, str) and isinstance(v, str) and v and is_secret_name(k, patterns)
                        else walk(v)) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item) if not hasattr(item, "_fields") else type(item)(*map(walk, item))
        return item

    return walk(obj)
