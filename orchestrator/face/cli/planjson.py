"""``orch plan --output json`` of a large plan: ``json.dumps(plan, default=str)``, the same text, written a few
hundred nodes at a time.

A plan of 4,096 nodes x 8 slots is 32,768 ranks, each with its argv and an environment of a few dozen
variables: about 30 MiB of JSON, nearly all of it the same from rank to rank. :func:`iterencode_plan` writes
the nodes as a table: a column (one field of every node, of every rank, of every rank's environment...) whose
values are all one string, integer, ``null`` or boolean is written once; a column of strings, integers or
floats that differ is written with what json's C encoder calls for them (``encode_basestring_ascii``,
``int.__repr__``, ``float.__repr__``), a column at a time; each row is then one ``"".join`` of the constant
runs (joined once) and its varying cells. Anything else (a value of another type, a column of mixed types,
dicts whose keys differ from row to row, a key that is not a string, nesting deeper than :data:`_DEPTH`) is
handed to json's C encoder (the one :func:`json.dumps` uses, with its settings: ``default=str``, circular
references checked), value by value. The text is ``json.dumps(plan, default=str)`` whatever the plan holds
(tests/test_plan_json.py); for 4,096 x 8 it takes about 0.6x of the time of the C encoder node by node.
"""

from __future__ import annotations

import itertools
import json
from operator import itemgetter
from typing import Any, Callable, Iterator

__all__ = ["dumps_plan", "iterencode_plan"]


#: ``json.dumps(value, default=str)`` is ``_dumps(value)``, without making an encoder each call (~10 us)
_dumps = json.JSONEncoder(default=str).encode
#: nodes written as one table (their text is held at once: ~7 KiB a node of 8 ranks)
_CHUNK = 256
#: containers nested deeper than this are written by the C encoder (a plan's: 4 levels; a cycle ends here)
_DEPTH = 6
#: lists (tuples) of up to this many items, all of one length and not of dicts, are written a position at a time
_BY_POSITION = 16
_ascii = getattr(json.encoder, "c_encode_basestring_ascii", None) or json.encoder.encode_basestring_ascii
_INF = float("inf")
_CONSTANTS = {None: "null", True: "true", False: "false"}
#: a column of one of these types -> the function that writes one of its values as json's C encoder does
_LEAVES: dict[type, Callable[[Any], str]] = {str: _ascii, int: int.__repr__, bool: _CONSTANTS.__getitem__,
                                             type(None): _CONSTANTS.__getitem__}


def _around(mapping: dict, key: str) -> tuple[str, str]:
    """``mapping``'s JSON, as :func:`json.dumps` writes it, before and after the value of ``key``."""
    items = list(mapping.items())
    at = list(mapping).index(key)
    before, after = _dumps(dict(items[:at]))[1:-1], _dumps(dict(items[at + 1:]))[1:-1]
    return "{" + (before + ", " if before else "") + json.dumps(key) + ": ", (", " + after if after else "") + "}"


def _node_encoder(*outer: Any) -> Callable[[Any], str]:
    """``value -> json.dumps(value, default=str)`` for the values inside the containers ``outer``: json's C
    encoder where there is one, with ``outer`` already among the containers being written, so a node that
    holds one of them is refused as :func:`json.dumps` of the whole would refuse it (ValueError: circular
    reference); json's Python encoder (:func:`json.dumps` itself) where there is no C encoder."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _dumps
    markers = {id(o): o for o in outer}
    encode = make(markers, str, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, True)
    return lambda value: "".join(encode(value, 0))


def _float(value: float) -> str:
    """``value`` as json's C encoder writes a float (``allow_nan``: NaN, Infinity, -Infinity)."""
    if value != value:
        return "NaN"
    return float.__repr__(value) if value not in (_INF, -_INF) else "Infinity" if value > 0 else "-Infinity"


def _column(values: list, encode: Callable[[Any], str], depth: int) -> list[str]:
    """The JSON text of each of ``values``, as ``encode`` (json's encoder) writes it: a column of a table."""
    first = values[0] if values else None
    if type(first) is str and values.count(first) == len(values):  # (the most common column: a shared string)
        return [_ascii(first)] * len(values)
    kinds = set(map(type, values))
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind in _LEAVES:
        if values.count(first) == len(values):  # (of one type: equal values are written alike)
            return [_LEAVES[kind](first)] * len(values)
        return list(map(_LEAVES[kind], values))
    if kind is float:
        return list(map(_float, values))
    if depth < _DEPTH and kind is dict:
        return _table(values, encode, depth + 1)
    if depth < _DEPTH and (kind is list or kind is tuple):
        return _lists(values, encode, depth + 1)
    return list(map(encode, values))


def _table(rows: list[dict], encode: Callable[[Any], str], depth: int) -> list[str]:
    """The JSON text of each dict of ``rows``: a template of their constant columns, formatted with the rest;
    each dict by ``encode`` unless all have the same string keys in the same order."""
    keys = list(rows[0])
    if list(map(list, rows)).count(keys) != len(rows) or set(map(type, keys)) - {str}:
        return list(map(encode, rows))
    if not keys:
        return ["{}"] * len(rows)
    cells = zip(*map(itemgetter(*keys), rows)) if len(keys) > 1 else [list(map(itemgetter(keys[0]), rows))]
    columns = [_column(values, encode, depth) for values in cells]
    return _format("{", "}", columns, [_ascii(key) + ": " for key in keys])


def _format(opening: str, closing: str, columns: list[list[str]], names: list[str] | None = None) -> list[str]:
    """Each row of ``columns`` (the texts of a table's cells, each after its name in ``names``: a dict's
    ``"key": ``, none for a list's), joined by ", " between ``opening`` and ``closing`` ("{" "}", "[" "]").
    The constant runs are joined once; a row is one ``"".join`` of them and its varying cells."""
    pieces: list[Any] = []  # constant strings and varying columns, alternating
    run = opening
    for i, texts in enumerate(columns):
        run += (", " if i else "") + (names[i] if names else "")
        if texts.count(texts[0]) == len(texts):
            run += texts[0]
        else:
            pieces += [itertools.repeat(run), texts]
            run = ""
    if not pieces:
        return [run + closing] * len(columns[0])
    return list(map("".join, zip(*pieces, itertools.repeat(run + closing))))


def _lists(rows: list[list | tuple], encode: Callable[[Any], str], depth: int) -> list[str]:
    """The JSON text of each list (or tuple: json writes it as a list) of ``rows``: position by position as
    columns (short lists of one length), else all their items as one column, joined per list."""
    size = len(rows[0])
    if 0 < size <= _BY_POSITION and type(rows[0][0]) is not dict and list(map(len, rows)).count(size) == len(rows):
        return _format("[", "]", [_column(list(map(itemgetter(i), rows)), encode, depth) for i in range(size)])
    items = list(itertools.chain.from_iterable(rows))
    texts = _column(items, encode, depth) if items else []
    out, at = [], 0
    for n in map(len, rows):
        out.append("[" + ", ".join(texts[at:at + n]) + "]")
        at += n
    return out


def iterencode_plan(whole: dict) -> Iterator[str]:
    """``json.dumps(whole, default=str)`` in pieces (one per :data:`_CHUNK` nodes; on one line), for a plan's
    dict (``JobPlan.to_dict()``, with any keys added). Written piece by piece, 30 MiB are not copied whole.

    Raises:
        TypeError, ValueError: as :func:`json.dumps` would.
    """
    if type(whole) is not dict or type(whole.get("nodes")) is not list:
        yield _dumps(whole)
        return
    nodes = whole["nodes"]
    head, tail = _around(whole, "nodes")
    encode = _node_encoder(whole, nodes)
    yield head + "["
    for at in range(0, len(nodes), _CHUNK):
        yield (", " if at else "") + ", ".join(_column(nodes[at:at + _CHUNK], encode, 0))
    yield "]" + tail


def dumps_plan(whole: dict) -> str:
    """``json.dumps(whole, default=str)``: the same text, made as :func:`iterencode_plan` makes it."""
    return "".join(iterencode_plan(whole))
