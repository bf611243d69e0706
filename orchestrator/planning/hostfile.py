"""DeepSpeed hostfiles and the ``include``/``exclude``/``num_nodes``/``num_gpus`` resource filter.

orch hands DeepSpeed's launchers the same resource pool ``deepspeed.launcher.runner`` would
build from the same inputs, so this module reproduces, rule for rule, the semantics of the
installed DeepSpeed (0.19.8) functions ``_parse_hostfile``, ``fetch_hostfile``,
``parse_node_config``, ``parse_node_config_list``, ``parse_resource_filter``,
``parse_inclusion_exclusion``, ``apply_num_nodes_and_gpus`` and the check in ``main()``
that forbids ``--num_nodes``/``--num_gpus`` together with ``--include``/``--exclude``.
The implementation is independent (linear time; thousands of hosts resolve in
milliseconds) and ``tests/test_hostfile_differential.py`` checks it against DeepSpeed's
own functions on thousands of generated inputs. Everywhere DeepSpeed raises, this module
raises a :class:`~orchestrator.errors.HostfileError` or
:class:`~orchestrator.errors.FilterError` whose message is one sentence naming the file
and line (or the filter token) and what was expected.

Hostfile format (``_parse_hostfile``)::

    # comment lines and blank lines are ignored
    worker-0 slots=8
    worker-1 slots=8

After stripping surrounding whitespace, a line that is empty or starts with ``#`` is
skipped; any other line must *start* with ``<host> slots=<n>``: a run of non-whitespace,
whitespace, the literal ``slots=`` and decimal digits. Each host may appear once and at
least one host is required.

Filter syntax (``parse_resource_filter``)::

    FILTER    = NODE_SPEC[@NODE_SPEC...]
    NODE_SPEC = NAME[:SLOT[,SLOT...]]

``include`` keeps only the named hosts (all of a host's slots when no slot list is given);
``exclude`` removes the named hosts or slots. Slots are local indices ``0..slots-1``. The
pool always follows hostfile order with each host's slots ascending.

DeepSpeed quirks reproduced here (same pool as DeepSpeed), each reported in
:attr:`ResourcePool.warnings` (or :attr:`Hostfile.warnings`) rather than silently:

1. Text after ``slots=<n>`` on a hostfile line is ignored (``w1 slots=8 max_slots=16``,
   ``w1 slots=8abc``); ``w1 slots=8 # comment`` is fine and gives no warning.
2. ``slots=`` accepts any Unicode decimal digits (``slots=٣`` is 3) and leading zeros.
3. Host names may contain any non-whitespace character, including invisible ones such as
   a UTF-8 byte-order mark (a hostfile saved "with BOM" names its first host
   ``'\\ufeffworker-0'``), and ``:`` or ``@`` (e.g. IPv6 addresses), which a filter
   cannot name because ``:`` and ``@`` are filter separators.
4. A host with ``slots=0`` is accepted. With no filter it stays in the pool with an empty
   slot list; ``num_nodes`` counts it; ``num_gpus`` gives it slots anyway; ``include``
   naming it and ``exclude`` (even without naming it) drop it.
5. ``num_gpus`` is not checked against the hostfile: every selected host gets slots
   ``0..num_gpus-1`` even if it has fewer (or zero) slots.
6. ``num_nodes`` larger than the number of hosts silently uses all hosts.
7. ``num_nodes=0`` / ``num_gpus=0`` do not limit anything, yet they still count as "set"
   for the rule that forbids them with ``include``/``exclude`` (DeepSpeed's check is
   ``>= 0``, its trimming ``> 0``). Values below ``-1`` are ignored entirely.
8. A host named both alone and with slots in one filter is merged into the slot list:
   ``include w1@w1:0`` uses only slot 0 of ``w1`` and ``exclude w1@w1:0`` removes only
   slot 0, not the whole host. Repeated hosts (``w1:0@w1:1``) merge their slots.
9. ``include`` order is ignored: ``include w2@w1`` and ``include w1:3,1`` assign ranks in
   hostfile order and ascending slot order.
10. Slots are parsed with Python's ``int()``, so ``w1: 1``, ``w1:+1``, ``w1:0_1`` (slot 1)
    and non-ASCII digits are accepted, and duplicates (``w1:0,0``) collapse.
11. A filter may leave an empty pool (``include`` of only zero-slot hosts); DeepSpeed
    does not complain here, so neither does :func:`resolve_pool` (it warns; planning
    refuses an empty pool).

Deliberate differences from DeepSpeed, none of which change a pool DeepSpeed would build:

* :func:`load_hostfile` raises on a missing, unreadable or directory path, where
  ``fetch_hostfile`` warns and falls back to the local GPUs.
* Hostfiles are read as UTF-8 (DeepSpeed uses the locale's encoding, UTF-8 on any sane
  cluster); invalid UTF-8 is a :class:`HostfileError`.
* :func:`parse_filter` rejects a ``NODE_SPEC`` with an empty name (``a@@b``, ``:0``),
  which DeepSpeed's parser returns as host ``''`` and its filter then always rejects.
* :func:`resolve_pool` refuses more than :data:`MAX_SLOTS_PER_HOST` slots on one host
  (from the hostfile or ``num_gpus``), where DeepSpeed would try to build a list of that
  many indices and run out of memory somewhere, machine-dependently.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import FilterError, HostfileError

__all__ = [
    "HOSTFILE_FORM",
    "FILTER_FORM",
    "MAX_SLOTS_PER_HOST",
    "Hostfile",
    "ResourcePool",
    "parse_hostfile",
    "load_hostfile",
    "parse_filter",
    "resolve_pool",
]

#: The form every non-comment hostfile line must have.
HOSTFILE_FORM = "<host> slots=<n>"
#: The form of an ``include``/``exclude`` filter.
FILTER_FORM = "NODE_SPEC[@NODE_SPEC...] with NODE_SPEC = NAME[:SLOT[,SLOT...]]"
#: Most slots one host may have in a pool (DeepSpeed has no limit but materialises them).
MAX_SLOTS_PER_HOST = 1 << 20

# A host line: the first whitespace-free run, whitespace, then "slots=" and digits.
# \S, \s and \d are the Unicode classes (the same ones str.split()/int() use).
_HOST_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>\d+)(?P<rest>.*)", re.DOTALL)

_EXAMPLE_LINE = "worker-0 slots=8"
_LIST_LIMIT = 6


def _names(items: Iterable[object], limit: int = _LIST_LIMIT) -> str:
    """Join names for a message, abbreviating long lists as ``a, b, c and 97 more``."""
    shown = [str(x) for x in items]
    if len(shown) > limit:
        return ", ".join(shown[:limit]) + f" and {len(shown) - limit} more"
    return ", ".join(shown)


def _clip(text: str, limit: int = 120) -> str:
    """``repr(text)``, shortened in the middle when very long."""
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    half = (limit - 5) // 2
    return f"{shown[:half]}[...]{shown[-half:]}"


def _int_list(values: Iterable[int]) -> str:
    return _names(values, limit=10)


def _index_range(slots: int) -> str:
    if slots == 1:
        return "index 0"
    return f"indices 0..{slots - 1}"


# --------------------------------------------------------------------------- hostfiles


class Hostfile(collections.OrderedDict):
    """Hosts and their slot counts in file order (an ``OrderedDict[str, int]``).

    It compares equal to the ``OrderedDict`` DeepSpeed's ``_parse_hostfile`` returns and
    carries, in addition, where it came from and what looked odd.

    Attributes:
        path: the hostfile's path, or ``"<hostfile>"`` for text given inline.
        lines: host -> 1-based line number it was defined on.
        warnings: human-readable notes about lines DeepSpeed accepts but probably should
            not (trailing text, non-ASCII digits, invisible characters in host names).
    """

    path: str
    lines: dict[str, int]
    warnings: tuple[str, ...]


def _diagnose_line(line: str) -> str:
    """Say, in a clause, why ``line`` is not ``<host> slots=<n>``."""
    fields = line.split()
    if fields[0].startswith("slots="):
        return f"it has no host name before {_clip(fields[0])}"
    if len(fields) == 1:
        return "it has a host name but no 'slots=<n>' field after it"
    second = fields[1]
    if second == "slots" and len(fields) > 2 and fields[2].startswith("="):
        return "'slots=<n>' must be written without spaces around '='"
    if second.startswith("slots="):
        value = second[len("slots="):]
        if value == "":
            return "nothing follows 'slots=' (write the number right after '=', no space)"
        if value[0] in "+-":
            return f"the slot count {_clip(value)} must be a non-negative whole number"
        return f"the slot count {_clip(value)} must start with a digit"
    if second.lower().startswith("slots"):
        return (f"its second field is {_clip(second)}; write 'slots=<n>' in lower case with "
                f"no spaces")
    if second.isdigit():
        return f"the slot count must be written as 'slots={second}'"
    return f"its second field is {_clip(second)}, not 'slots=<n>'"


def parse_hostfile(text: str, path: str = "<hostfile>") -> Hostfile:
    """Parse the text of a DeepSpeed hostfile.

    Rules (DeepSpeed ``runner._parse_hostfile``): the text is split into lines as a file
    opened in text mode would be (``\\n``, ``\\r\\n`` and ``\\r`` end a line); each line is
    stripped; empty lines and lines starting with ``#`` are skipped; every other line must
    start with ``<host> slots=<n>`` (anything after ``<n>`` is ignored); a host may appear
    only once; and at least one host is required. ``slots=0`` is accepted.

    Args:
        text: the hostfile's contents.
        path: the name to use in messages (the file's path, or ``"<hostfile>"``).

    Returns:
        A :class:`Hostfile`: an ``OrderedDict`` of host -> slot count in file order, equal
        to what DeepSpeed returns, with ``path``, ``lines`` and ``warnings`` attached.

    Raises:
        HostfileError: a line is not ``<host> slots=<n>`` (the message names the path,
            line number, the line's text and the expected form), a host is listed twice
            (naming both line numbers), the slot count has more digits than Python's
            ``int()`` converts, or the file has no host lines at all.
    """
    path = str(path)
    # Universal newlines, as open(..., "r") gives DeepSpeed's readlines(); other Unicode
    # line separators (\x85, \u2028, ...) stay inside a line, as they do there.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    hosts = Hostfile()
    lines: dict[str, int] = {}
    warnings: list[str] = []
    for line_no, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if m is None:
            raise HostfileError(
                f"Line {line_no} of hostfile {path} is {_clip(line)}, which is not of the form "
                f"'{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}'): {_diagnose_line(line)}.",
                path=path, line_no=line_no, line=line)
        host, digits, rest = m.group("host"), m.group("slots"), m.group("rest")
        try:
            slots = int(digits)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise HostfileError(
                f"Line {line_no} of hostfile {path} gives host {host!r} a slot count of "
                f"{len(digits)} digits, too long to be a number; expected '{HOSTFILE_FORM}' "
                f"with a plausible <n> (e.g. '{_EXAMPLE_LINE}').",
                path=path, line_no=line_no, line=line) from None
        if host in lines:
            raise HostfileError(
                f"Hostfile {path} lists host {host!r} twice, on line {lines[host]} and on "
                f"line {line_no} ({_clip(line)}); give each host one line '{HOSTFILE_FORM}' "
                f"with its total slot count.",
                path=path, line_no=line_no, line=line)
        hosts[host] = slots
        lines[host] = line_no
        where = f"Line {line_no} of hostfile {path} ({_clip(line)})"
        if rest.strip() and not rest.lstrip().startswith("#"):
            warnings.append(
                f"{where}: the text {_clip(rest.strip())} after "
                f"'slots={_clip(digits)[1:-1]}' is ignored, "
                f"as DeepSpeed reads only '{HOSTFILE_FORM}' at the start of a line.")
        if not digits.isascii():
            warnings.append(
                f"{where}: the slot count {digits!r} uses non-ASCII digits; it is read as "
                f"{slots}.")
        if not host.isprintable():
            warnings.append(
                f"{where}: host name {host!r} contains invisible or control characters "
                f"(a UTF-8 byte-order mark?); DeepSpeed uses the name as written.")
    if not hosts:
        raise HostfileError(
            f"Hostfile {path} has no host lines, only blank lines and comments; expected "
            f"at least one line of the form '{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}').",
            path=path)
    hosts.path = path
    hosts.lines = lines
    hosts.warnings = tuple(warnings)
    return hosts


def load_hostfile(path: str | os.PathLike) -> Hostfile:
    """Read and parse a DeepSpeed hostfile.

    Unlike DeepSpeed's ``runner.fetch_hostfile``, which logs a warning and falls back to
    the local GPUs when the path is not a file, a path that cannot be read is an error.
    The file is read as UTF-8 text with universal newlines.

    Args:
        path: the hostfile's path.

    Returns:
        The :class:`Hostfile` (host -> slot count, in file order) that
        :func:`parse_hostfile` gives for the file's text.

    Raises:
        HostfileError: the path does not exist, is a directory, cannot be read or is not
            UTF-8 text (the message names the path), or its contents are invalid (see
            :func:`parse_hostfile`).
    """
    name = os.fsdecode(path)
    expected = f"a text file of lines '{HOSTFILE_FORM}'"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise HostfileError(
            f"Hostfile {name} does not exist; expected the path of {expected}.",
            path=name) from None
    except IsADirectoryError:
        raise HostfileError(
            f"Hostfile {name} is a directory; expected the path of {expected}.",
            path=name) from None
    except UnicodeDecodeError as err:
        raise HostfileError(
            f"Hostfile {name} is not UTF-8 text (bad byte at offset {err.start}); expected "
            f"{expected}.", path=name) from None
    except OSError as err:
        reason = err.strerror or str(err)
        raise HostfileError(
            f"Hostfile {name} could not be read ({reason}); expected the path of a "
            f"readable {expected[2:]}.", path=name) from None
    return parse_hostfile(text, path=name)


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True)
class _Spec:
    """One parsed ``NODE_SPEC`` of a filter."""

    token: str
    host: str
    slots: tuple[int, ...]          # as written (unsorted, possibly repeated)
    odd_slots: tuple[str, ...]      # slot texts int() accepts but that are not plain digits


def _is_plain_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


def _slot_problem(item: str, token: str) -> str:
    if item == "":
        if token.endswith(","):
            return "ends with a comma, leaving an empty slot"
        if token.endswith(":"):
            return "has ':' but no slots after it"
        if ":," in token:
            return "has an empty slot right after ':'"
        return "has an empty slot between two commas"
    digits = item.strip()
    digits = digits[1:] if digits[:1] in ("+", "-") else digits
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if digits.replace("_", "").isdecimal() and 0 < limit < len(digits):
        return f"has a slot of {len(digits)} digits, too long to be a number"
    return f"has slot {_clip(item, 40)}, which is not a whole number"


def _expected_spec(token: str) -> str:
    """The clause saying what a NODE_SPEC should look like, with an example."""
    name = token.split(":", 1)[0].strip()
    example = (f"'{name}' or '{name}:0,1'" if name and len(name) < 40
               else "'worker-0@worker-1:0,1'")
    return f"expected {FILTER_FORM} and whole-number slots, e.g. {example}"


def _parse_specs(text: str, kind: str) -> list[_Spec]:
    """Split a filter into ``NODE_SPEC``s the way DeepSpeed's parse_node_config does."""
    specs = []
    for token in text.split("@"):
        if ":" not in token:
            host, items = token, []
        else:
            parts = token.split(":")
            if len(parts) > 2:
                raise FilterError(
                    f"The {kind} filter token {_clip(token)} has more than one ':'; "
                    f"{_expected_spec(token)}.",
                    token=token)
            host, slot_text = parts
            items = slot_text.split(",")
        if host == "":
            if token == "":
                where = ("is empty" if text == "" else
                         f"{_clip(text)} has an empty NODE_SPEC (a leading, trailing or "
                         f"doubled '@')")
                raise FilterError(f"The {kind} filter {where}; {_expected_spec(token)}.",
                                  token=text)
            raise FilterError(
                f"The {kind} filter token {_clip(token)} has no host name before ':'; "
                f"{_expected_spec(token)}.", token=token)
        slots, odd = [], []
        for item in items:
            try:
                slots.append(int(item))
            except ValueError:
                raise FilterError(
                    f"The {kind} filter token {_clip(token)} {_slot_problem(item, token)}; "
                    f"{_expected_spec(token)}.", token=token) from None
            if not _is_plain_number(item):
                odd.append(item)
        specs.append(_Spec(token, host, tuple(slots), tuple(odd)))
    return specs


def _merge(specs: list[_Spec]) -> dict[str, list[int]]:
    """Merge specs per host: first-mention order, slots sorted and de-duplicated."""
    merged: dict[str, set[int]] = {}
    for spec in specs:
        merged.setdefault(spec.host, set()).update(spec.slots)
    return {host: sorted(slots) for host, slots in merged.items()}


def parse_filter(text: str, kind: str = "include") -> dict[str, list[int]]:
    """Parse an ``include``/``exclude`` filter string.

    Syntax (DeepSpeed ``runner.parse_node_config_list`` and ``parse_node_config``):
    ``NODE_SPEC[@NODE_SPEC...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT...]]``. A host named
    more than once has its slots merged; slot lists come back sorted without duplicates; an
    empty list means "all slots". Slots are read with ``int()`` (so ``' 1'`` and ``'+1'``
    are 1); whether a host or slot exists is checked by :func:`resolve_pool`.

    Args:
        text: the filter, e.g. ``"worker-0@worker-1:0,2"``.
        kind: ``"include"`` or ``"exclude"``, used in messages.

    Returns:
        host -> sorted unique slots (``[]`` = every slot), hosts in order of first mention;
        the same dict DeepSpeed's ``parse_node_config_list`` returns.

    Raises:
        FilterError: a token has more than one ``:``, a slot that is not a whole number (an
            empty one from a trailing comma, for instance), or no host name (``a@@b``,
            ``:0``, or an empty filter). The message names the token and the expected form.
    """
    return _merge(_parse_specs(text, kind))


# --------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class ResourcePool:
    """The hosts and local slots a job runs on, in DeepSpeed's rank order.

    Attributes:
        nodes: ``(host, slots)`` pairs in hostfile order, slots ascending; exactly the
            ``active_resources`` DeepSpeed's runner would compute (a host may have no slots
            when the hostfile gave it ``slots=0`` and nothing filtered it).
        warnings: human-readable notes on inputs DeepSpeed accepts silently but that
            probably do not mean what they say (see the module docstring).
    """

    nodes: tuple[tuple[str, tuple[int, ...]], ...]
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> collections.OrderedDict[str, list[int]]:
        """Return the pool as DeepSpeed's ``OrderedDict`` of host -> list of slots.

        Returns:
            A new ``OrderedDict`` equal to DeepSpeed's ``active_resources``.
        """
        return collections.OrderedDict((host, list(slots)) for host, slots in self.nodes)

    @property
    def world_size(self) -> int:
        """Total number of ranks: the number of slots over all hosts."""
        return sum(len(slots) for _, slots in self.nodes)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The pool's hosts in rank order."""
        return tuple(host for host, _ in self.nodes)


def _check_count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FilterError(
            f"The {name} setting must be a whole number (-1 for 'not set'), got {value!r}.",
            token=name)
    if value > MAX_SLOTS_PER_HOST and name == "num_gpus":
        raise FilterError(
            f"The setting num_gpus={value} is more than the {MAX_SLOTS_PER_HOST} slots orch "
            f"allows on one host; expected the number of GPUs to use per host.", token=name)
    return value


def _check_hosts(hosts: Mapping[str, int], source: str) -> None:
    if not hosts:
        raise HostfileError(
            f"Hostfile {source} has no hosts; expected at least one '{HOSTFILE_FORM}'.",
            path=source)
    for host, slots in hosts.items():
        if not isinstance(host, str) or not host:
            raise HostfileError(
                f"Hostfile {source} has host name {host!r}; expected a non-empty string.",
                path=source)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise HostfileError(
                f"Hostfile {source} gives host {host!r} slots={slots!r}; expected a "
                f"non-negative whole number.", path=source)
        if slots > MAX_SLOTS_PER_HOST:
            raise HostfileError(
                f"Hostfile {source} gives host {host!r} slots={slots}, more than the "
                f"{MAX_SLOTS_PER_HOST} slots orch allows on one host; expected the number "
                f"of GPUs on that host.", path=source)


def _host_hint(host: str) -> str:
    if any(c.isspace() for c in host):
        return " (the name contains whitespace; do not put spaces around '@', ':' or ',')"
    return ""


def _apply_filter(hosts: Mapping[str, int], text: str, kind: str, source: str,
                  warnings: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """``parse_resource_filter`` over ``{host: range(slots)}``, in linear time."""
    specs = _parse_specs(text, kind)
    merged = _merge(specs)
    by_host: dict[str, list[_Spec]] = {}
    for spec in specs:
        by_host.setdefault(spec.host, []).append(spec)
    line_of = getattr(hosts, "lines", {})

    for host, slots in merged.items():
        first = by_host[host][0]
        if host not in hosts:
            raise FilterError(
                f"The {kind} filter token {_clip(first.token)} names host {_clip(host)}"
                f"{_host_hint(host)}, which is not in hostfile {source}; its hosts are "
                f"{_names(hosts)}.", token=first.token)
        count = hosts[host]
        bad = [s for s in slots if not 0 <= s < count]
        if bad:
            bad_set = set(bad)
            culprit = next(sp for sp in by_host[host] if bad_set.intersection(sp.slots))
            bad = sorted(bad_set.intersection(culprit.slots))
            where = f" (line {line_of[host]})" if host in line_of else ""
            has = ("so it has no slots at all" if count == 0 else
                   f"so its slots are local {_index_range(count)}")
            raise FilterError(
                f"The {kind} filter token {_clip(culprit.token)} asks for slot(s) "
                f"{_int_list(bad)} on {host}, which do not exist: hostfile {source} gives "
                f"{host} slots={count}{where}, {has}.", token=culprit.token)

    # Everything is valid: note what DeepSpeed does that the user may not expect.
    for host, host_specs in by_host.items():
        bare = [sp.token for sp in host_specs if not sp.slots]
        if bare and merged[host]:
            with_slots = [sp.token for sp in host_specs if sp.slots]
            effect = "uses only" if kind == "include" else "removes only"
            warnings.append(
                f"The {kind} filter names host {_clip(host)} both on its own "
                f"({_clip(bare[0])}) and with slots ({_clip(with_slots[0])}); DeepSpeed merges "
                f"these and {effect} slot(s) {_int_list(merged[host])} of {host}"
                f"{'' if kind == 'include' else ', not the whole host'}.")

    specs_with_odd = [sp for sp in specs if sp.odd_slots]
    if specs_with_odd:
        sp = specs_with_odd[0]
        more = (f" (and {len(specs_with_odd) - 1} more token(s) like it)"
                if len(specs_with_odd) > 1 else "")
        warnings.append(
            f"The {kind} filter token {_clip(sp.token)}{more} writes slot(s) as "
            f"{_names(_clip(s, 40) for s in sp.odd_slots)}, which DeepSpeed reads with int() as "
            f"{_int_list(int(s) for s in sp.odd_slots)}.")
    unsorted = [sp for sp in specs if list(sp.slots) != sorted(set(sp.slots))]
    if kind == "include" and unsorted:
        sp = unsorted[0]
        more = f" (and {len(unsorted) - 1} more token(s))" if len(unsorted) > 1 else ""
        warnings.append(
            f"The include filter token {_clip(sp.token)}{more} lists slots out of order or "
            f"repeated; ranks use them sorted and de-duplicated: "
            f"{_int_list(sorted(set(sp.slots)))}.")

    nodes: list[tuple[str, tuple[int, ...]]] = []
    if kind == "include":
        order = {host: i for i, host in enumerate(hosts)}
        named = list(merged)
        if named != sorted(named, key=order.__getitem__):
            warnings.append(
                f"The include filter lists hosts in the order {_names(named)}, but ranks "
                f"follow hostfile order: {_names(sorted(named, key=order.__getitem__))}.")
        empty = [h for h in named if not merged[h] and hosts[h] == 0]
        if empty:
            warnings.append(
                f"The include filter names host(s) {_names(empty)}, which have slots=0 in "
                f"hostfile {source}; DeepSpeed drops them from the pool.")
        for host, count in hosts.items():
            if host in merged:
                chosen = tuple(merged[host]) if merged[host] else tuple(range(count))
                if chosen:
                    nodes.append((host, chosen))
    else:
        dropped_zero = [h for h, c in hosts.items() if c == 0 and h not in merged]
        if dropped_zero:
            warnings.append(
                f"Host(s) {_names(dropped_zero)} have slots=0 in hostfile {source}; any "
                f"exclude filter makes DeepSpeed drop them, although it does not name them.")
        for host, count in hosts.items():
            if host not in merged:
                kept = tuple(range(count))
            elif not merged[host]:
                kept = ()
            else:
                removed = set(merged[host])
                kept = tuple(s for s in range(count) if s not in removed)
            if kept:
                nodes.append((host, kept))
    return nodes


def resolve_pool(hosts: Mapping[str, int], include: str = "", exclude: str = "",
                 num_nodes: int = -1, num_gpus: int = -1, *,
                 source: str = "<hostfile>") -> ResourcePool:
    """Resolve a hostfile and DeepSpeed's resource flags to the pool of ranks.

    Rules, applied in DeepSpeed's order:

    1. ``runner.main``: ``num_nodes >= 0`` or ``num_gpus >= 0`` together with a non-empty
       ``include`` or ``exclude`` is an error (so 0 counts as set; -1 is DeepSpeed's
       default, "not set").
    2. ``runner.parse_inclusion_exclusion`` / ``parse_resource_filter``: every host gets
       slots ``0..slots-1``; ``include`` and ``exclude`` are mutually exclusive; every named
       host and slot must exist; ``include`` keeps only what it names, ``exclude`` removes
       it; hosts left with no slots are dropped (only when a filter is given); the result
       follows hostfile order with ascending slots.
    3. ``runner.apply_num_nodes_and_gpus``: ``num_nodes > 0`` keeps the first
       ``num_nodes`` hosts; ``num_gpus > 0`` gives every kept host slots
       ``0..num_gpus-1``, whatever its slot count.

    Args:
        hosts: host -> slot count in hostfile order, e.g. from :func:`load_hostfile`.
        include: DeepSpeed's ``--include`` filter, ``""`` for none.
        exclude: DeepSpeed's ``--exclude`` filter, ``""`` for none.
        num_nodes: DeepSpeed's ``--num_nodes``; -1 (any negative) means not set.
        num_gpus: DeepSpeed's ``--num_gpus``; -1 (any negative) means not set.
        source: the hostfile's name for messages; defaults to ``hosts.path`` when
            ``hosts`` is a :class:`Hostfile`.

    Returns:
        The :class:`ResourcePool`, whose :meth:`~ResourcePool.as_dict` equals DeepSpeed's
        ``active_resources``; its ``warnings`` hold the hostfile's warnings and notes on
        anything DeepSpeed accepts silently but oddly (it may even be empty).

    Raises:
        FilterError: the flags conflict (naming the fields), a filter token is malformed,
            names a host not in the hostfile (listing the hostfile's hosts) or a slot the
            host does not have (giving its valid local indices), or ``num_nodes`` /
            ``num_gpus`` is not an integer.
        HostfileError: ``hosts`` is empty or has a slot count that is not a non-negative
            integer (or above :data:`MAX_SLOTS_PER_HOST`).
    """
    if source == "<hostfile>":
        source = getattr(hosts, "path", source)
    for name, value in (("include", include), ("exclude", exclude)):
        if not isinstance(value, str):
            raise FilterError(
                f"The {name} setting must be a filter string ('' for none), got {value!r}.",
                token=name)
    num_nodes = _check_count(num_nodes, "num_nodes")
    num_gpus = _check_count(num_gpus, "num_gpus")
    _check_hosts(hosts, source)
    warnings = list(getattr(hosts, "warnings", ()))

    if (num_nodes >= 0 or num_gpus >= 0) and (include != "" or exclude != ""):
        counts = " and ".join(f"{n}={v}" for n, v in
                              (("num_nodes", num_nodes), ("num_gpus", num_gpus)) if v >= 0)
        filters = " and ".join(f"{n}={_clip(v)}" for n, v in
                               (("include", include), ("exclude", exclude)) if v != "")
        raise FilterError(
            f"Setting {counts} together with {filters} is not allowed: DeepSpeed forbids "
            f"num_nodes/num_gpus (any value >= 0, even 0) with include/exclude; set num_nodes "
            f"and num_gpus to -1, or express the selection in the filter alone.",
            token="num_nodes" if num_nodes >= 0 else "num_gpus")
    if include != "" and exclude != "":
        raise FilterError(
            f"Both include={_clip(include)} and exclude={_clip(exclude)} are given, but they are "
            f"mutually exclusive: include lists the only hosts/slots to use, exclude removes "
            f"hosts/slots from the hostfile; give one of them.", token="include")

    if include != "":
        nodes = _apply_filter(hosts, include, "include", source, warnings)
    elif exclude != "":
        nodes = _apply_filter(hosts, exclude, "exclude", source, warnings)
    else:
        nodes = [(host, tuple(range(count))) for host, count in hosts.items()]
    if (include or exclude) and not nodes:
        kind, text = ("include", include) if include else ("exclude", exclude)
        warnings.append(
            f"The {kind} filter {_clip(text)} leaves no host with any slot in hostfile {source}; "
            f"the pool is empty.")

    for name, value in (("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if value == 0:
            limit = "the number of nodes" if name == "num_nodes" else "the GPUs per node"
            warnings.append(
                f"{name}=0 does not limit {limit}: DeepSpeed only applies {name} when it is "
                f"above 0 (it still counts as set, which forbids include/exclude).")
        elif value < -1:
            warnings.append(f"{name}={value} is treated as not set, like -1.")

    if num_nodes > 0:
        if num_nodes > len(nodes):
            warnings.append(
                f"num_nodes={num_nodes} is more than the {len(nodes)} host(s) in hostfile "
                f"{source}; all of them are used.")
        nodes = nodes[:num_nodes]
    if num_gpus > 0:
        short = [h for h, slots in nodes if hosts[h] < num_gpus]
        if short:
            warnings.append(
                f"num_gpus={num_gpus} gives host(s) {_names(short)} slots 0..{num_gpus - 1} "
                f"although hostfile {source} gives them fewer (e.g. {short[0]} has "
                f"slots={hosts[short[0]]}); DeepSpeed does not check num_gpus against the "
                f"hostfile.")
        gpus = tuple(range(num_gpus))
        nodes = [(host, gpus) for host, _ in nodes]
    else:
        empty = [h for h, slots in nodes if not slots]
        if empty:
            warnings.append(
                f"Host(s) {_names(empty)} have slots=0 in hostfile {source}; DeepSpeed keeps "
                f"them in the pool with no slots (they get no ranks"
                f"{', but count towards num_nodes' if num_nodes > 0 else ''}).")
    return ResourcePool(nodes=tuple(nodes), warnings=tuple(warnings))
