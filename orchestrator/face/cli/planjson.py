"""``orch plan --output json`` of a large plan: ``json.dumps(plan, default=str)``, the same text, made faster.

A plan of 4,096 nodes x 8 slots is 32,768 ranks, each with its argv and an environment of a few dozen
variables: about 30 MiB of JSON, most of it the same few hundred ``"NAME": "value"`` pairs and argvs over
and over. :func:`iterencode_plan` encodes each distinct pair and argv once (with json's own string encoder, so each
is exactly what :func:`json.dumps` writes) and joins them per rank; everything else is encoded by json's
encoder itself. A rank of any other shape (other keys, a value that is not a string) is encoded by :func:`json.dumps`
whole, so the output is ``json.dumps(plan, default=str)`` whatever the plan holds.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

__all__ = ["dumps_plan", "iterencode_plan"]

#: a rank's keys, in ``RankPlan.to_dict``'s order: the ranks :func:`_rank` encodes from its caches
_RANK_KEYS = ("global_rank", "local_rank", "slot", "argv", "env")


#: ``json.dumps(value, default=str)`` is ``_dumps(value)``, without making an encoder each call (~10 us)
_dumps = json.JSONEncoder(default=str).encode


#: a str's JSON: what json.dumps writes for it (ensure_ascii); C, not through json.dumps's Python frames
_ascii = json.encoder.encode_basestring_ascii


class _Pairs(dict):
    """``{(name, value): '"name": "value"'}`` of the string pairs met so far; a lookup of any other pair
    raises TypeError (and stores nothing)."""

    def __missing__(self, pair: tuple[Any, Any]) -> str:
        name, value = pair
        if type(name) is not str or type(value) is not str:
            raise TypeError("not a pair of strings")
        text = self[pair] = f"{_ascii(name)}: {_ascii(value)}"
        return text


class _Argvs(dict):
    """``{argv: its JSON}`` of the argvs (tuples of strings) met so far; a lookup of any other tuple raises
    TypeError (and stores nothing)."""

    def __missing__(self, argv: tuple[Any, ...]) -> str:
        if not all(type(word) is str for word in argv):
            raise TypeError("not a tuple of strings")
        text = self[argv] = "[" + ", ".join(map(_ascii, argv)) + "]"
        return text


class _Caches:
    """The encodings of the ``"NAME": "value"`` pairs and argvs met so far."""

    def __init__(self) -> None:
        self.pairs = _Pairs()
        self.argvs = _Argvs()


def _rank(rank: Any, caches: _Caches) -> str:
    """One rank's JSON, as :func:`json.dumps` writes it."""
    if type(rank) is not dict or tuple(rank) != _RANK_KEYS:
        return _dumps(rank)
    global_rank, local_rank, slot, argv, env = rank.values()
    if not (type(global_rank) is int and type(local_rank) is int and type(slot) is int and type(argv) is list
            and type(env) is dict):  # (bool is not int here: json writes true)
        return _dumps(rank)
    try:
        encoded_argv = caches.argvs[tuple(argv)]
        encoded_env = ", ".join(map(caches.pairs.__getitem__, env.items()))
    except TypeError:  # (a value that is not a string, or one that cannot be hashed)
        return _dumps(rank)
    return (f'{{"global_rank": {global_rank}, "local_rank": {local_rank}, "slot": {slot}, "argv": {encoded_argv}, '
            f'"env": {{{encoded_env}}}}}')


def _around(mapping: dict, key: str) -> tuple[str, str]:
    """``mapping``'s JSON, as :func:`json.dumps` writes it, before and after the value of ``key``."""
    items = list(mapping.items())
    at = list(mapping).index(key)
    before, after = _dumps(dict(items[:at]))[1:-1], _dumps(dict(items[at + 1:]))[1:-1]
    return "{" + (before + ", " if before else "") + json.dumps(key) + ": ", (", " + after if after else "") + "}"


def _node(node: Any, caches: _Caches) -> str:
    if type(node) is not dict or type(node.get("ranks")) is not list:
        return _dumps(node)
    head, tail = _around(node, "ranks")
    return head + "[" + ", ".join([_rank(r, caches) for r in node["ranks"]]) + "]" + tail


def iterencode_plan(whole: dict) -> Iterator[str]:
    """``json.dumps(whole, default=str)`` in pieces (one a node; on one line), for a plan's dict
    (``JobPlan.to_dict()``, with any keys added) whose ``nodes`` hold many ranks of the same few variables
    (module docstring). Written piece by piece, 30 MiB are not copied whole again and again.

    Raises:
        TypeError, ValueError: as :func:`json.dumps` would.
    """
    if type(whole) is not dict or type(whole.get("nodes")) is not list:
        yield _dumps(whole)
        return
    caches = _Caches()
    head, tail = _around(whole, "nodes")
    yield head + "["
    for i, node in enumerate(whole["nodes"]):
        yield (", " if i else "") + _node(node, caches)
    yield "]" + tail


def dumps_plan(whole: dict) -> str:
    """``json.dumps(whole, default=str)``: the same text, made as :func:`iterencode_plan` makes it."""
    return "".join(iterencode_plan(whole))
