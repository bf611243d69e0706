"""DeepSpeed's ``include``/``exclude``/``num_nodes``/``num_gpus`` resource filter and the pool it selects.

orch hands DeepSpeed's launchers the same resource pool ``deepspeed.launcher.runner`` would
build from the same inputs, so this module reproduces, rule for rule, the semantics of the
installed DeepSpeed (0.19.8) functions ``parse_node_config``, ``parse_node_config_list``,
``parse_resource_filter``, ``parse_inclusion_exclusion``, ``apply_num_nodes_and_gpus`` and the
check in ``main()`` that forbids ``--num_nodes``/``--num_gpus`` together with
``--include``/``--exclude``. The implementation is independent (linear time) and
``tests/test_hostfile_differential.py`` checks it against DeepSpeed's own functions on
thousands of generated inputs. Everywhere DeepSpeed raises, this module raises a
:class:`~orchestrator.errors.FilterError` (or a :class:`~orchestrator.errors.HostfileError`
for a bad host table) whose message is one sentence naming the token and what was expected.

Filter syntax (``parse_resource_filter``)::

    FILTER    = NODE_SPEC[@NODE_SPEC...]
    NODE_SPEC = NAME[:SLOT[,SLOT...]]

``include`` keeps only the named hosts (all of a host's slots when no slot list is given);
``exclude`` removes the named hosts or slots. Slots are local indices ``0..slots-1``. The
pool always follows hostfile order with each host's slots ascending.

DeepSpeed quirks reproduced here (same pool as DeepSpeed), each reported in
:attr:`ResourcePool.warnings` rather than silently (the hostfile's own quirks, 1-3, are
listed in :mod:`.hostfile`):

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

* :func:`parse_filter` rejects a ``NODE_SPEC`` with an empty name (``a@@b``, ``:0``),
  which DeepSpeed's parser returns as host ``''`` and its filter then always rejects.
* :func:`resolve_pool` refuses more than :data:`MAX_SLOTS_PER_HOST` slots on one host
  (from the hostfile or ``num_gpus``), where DeepSpeed would try to build a list of that
  many indices and run out of memory somewhere, machine-dependently.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import FilterError, HostfileError
from .hostfile import HOSTFILE_FORM
from .words import clip, int_list, names

__all__ = ["FILTER_FORM", "MAX_SLOTS_PER_HOST", "ResourcePool", "parse_filter", "resolve_pool"]

#: The form of an ``include``/``exclude`` filter.
FILTER_FORM = "NODE_SPEC[@NODE_SPEC...] with NODE_SPEC = NAME[:SLOT[,SLOT...]]"
#: Most slots one host may have in a pool (DeepSpeed has no limit but materialises them).
MAX_SLOTS_PER_HOST = 4096


def _index_range(slots: int) -> str:
    """A host's local slot indices in words: ``index 0`` or ``indices 0..7``."""
    if slots == 1:
        return "index 0"
    return f"indices 0..{slots - 1}"


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
    return f"has slot {clip(item, 40)}, which is not a whole number"


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
                    f"The {kind} filter token {clip(token)} has more than one ':'; "
                    f"{_expected_spec(token)}.",
                    token=token)
            host, slot_text = parts
            items = slot_text.split(",")
        if host == "":
            if token == "":
                where = ("is empty" if text == "" else
                         f"{clip(text)} has an empty NODE_SPEC (a leading, trailing or "
                         f"doubled '@')")
                raise FilterError(f"The {kind} filter {where}; {_expected_spec(token)}.",
                                  token=text)
            raise FilterError(
                f"The {kind} filter token {clip(token)} has no host name before ':'; "
                f"{_expected_spec(token)}.", token=token)
        slots, odd = [], []
        for item in items:
            try:
                slots.append(int(item))
            except ValueError:
                raise FilterError(
                    f"The {kind} filter token {clip(token)} {_slot_problem(item, token)}; "
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


def _check_named(hosts: Mapping[str, int], merged: dict[str, list[int]], by_host: dict[str, list[_Spec]],
                 kind: str, source: str) -> None:
    """Every host a filter names is in the hostfile, and every slot it names exists there."""
    line_of = getattr(hosts, "lines", {})
    for host, slots in merged.items():
        first = by_host[host][0]
        if host not in hosts:
            raise FilterError(
                f"The {kind} filter token {clip(first.token)} names host {clip(host)}"
                f"{_host_hint(host)}, which is not in hostfile {source}; its hosts are "
                f"{names(hosts)}.", token=first.token)
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
                f"The {kind} filter token {clip(culprit.token)} asks for slot(s) "
                f"{int_list(bad)} on {host}, which do not exist: hostfile {source} gives "
                f"{host} slots={count}{where}, {has}.", token=culprit.token)


def _token_notes(specs: list[_Spec], merged: dict[str, list[int]], by_host: dict[str, list[_Spec]],
                 kind: str) -> list[str]:
    """What DeepSpeed does with a valid filter's tokens that the user may not expect (quirks 8-10)."""
    notes = []
    for host, host_specs in by_host.items():
        bare = [sp.token for sp in host_specs if not sp.slots]
        if bare and merged[host]:
            with_slots = [sp.token for sp in host_specs if sp.slots]
            effect = "uses only" if kind == "include" else "removes only"
            notes.append(
                f"The {kind} filter names host {clip(host)} both on its own "
                f"({clip(bare[0])}) and with slots ({clip(with_slots[0])}); DeepSpeed merges "
                f"these and {effect} slot(s) {int_list(merged[host])} of {host}"
                f"{'' if kind == 'include' else ', not the whole host'}.")
    specs_with_odd = [sp for sp in specs if sp.odd_slots]
    if specs_with_odd:
        sp = specs_with_odd[0]
        more = (f" (and {len(specs_with_odd) - 1} more token(s) like it)"
                if len(specs_with_odd) > 1 else "")
        notes.append(
            f"The {kind} filter token {clip(sp.token)}{more} writes slot(s) as "
            f"{names(clip(s, 40) for s in sp.odd_slots)}, which DeepSpeed reads with int() as "
            f"{int_list(int(s) for s in sp.odd_slots)}.")
    unsorted = [sp for sp in specs if list(sp.slots) != sorted(set(sp.slots))]
    if kind == "include" and unsorted:
        sp = unsorted[0]
        more = f" (and {len(unsorted) - 1} more token(s))" if len(unsorted) > 1 else ""
        notes.append(
            f"The include filter token {clip(sp.token)}{more} lists slots out of order or "
            f"repeated; ranks use them sorted and de-duplicated: "
            f"{int_list(sorted(set(sp.slots)))}.")
    return notes


def _include(hosts: Mapping[str, int], merged: dict[str, list[int]], source: str,
             warnings: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """The hosts and slots an include filter keeps, in hostfile order (quirks 4 and 9)."""
    order = {host: i for i, host in enumerate(hosts)}
    named = list(merged)
    if named != sorted(named, key=order.__getitem__):
        warnings.append(
            f"The include filter lists hosts in the order {names(named)}, but ranks "
            f"follow hostfile order: {names(sorted(named, key=order.__getitem__))}.")
    empty = [h for h in named if not merged[h] and hosts[h] == 0]
    if empty:
        warnings.append(
            f"The include filter names host(s) {names(empty)}, which have slots=0 in "
            f"hostfile {source}; DeepSpeed drops them from the pool.")
    nodes = []
    for host, count in hosts.items():
        if host in merged:
            chosen = tuple(merged[host]) if merged[host] else tuple(range(count))
            if chosen:
                nodes.append((host, chosen))
    return nodes


def _exclude(hosts: Mapping[str, int], merged: dict[str, list[int]], source: str,
             warnings: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """The hosts and slots an exclude filter leaves, in hostfile order (quirk 4)."""
    dropped_zero = [h for h, c in hosts.items() if c == 0 and h not in merged]
    if dropped_zero:
        warnings.append(
            f"Host(s) {names(dropped_zero)} have slots=0 in hostfile {source}; any "
            f"exclude filter makes DeepSpeed drop them, although it does not name them.")
    nodes = []
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


def _apply_filter(hosts: Mapping[str, int], text: str, kind: str, source: str,
                  warnings: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """``parse_resource_filter`` over ``{host: range(slots)}``, in linear time."""
    specs = _parse_specs(text, kind)
    merged = _merge(specs)
    by_host: dict[str, list[_Spec]] = {}
    for spec in specs:
        by_host.setdefault(spec.host, []).append(spec)
    _check_named(hosts, merged, by_host, kind, source)
    warnings += _token_notes(specs, merged, by_host, kind)
    return (_include if kind == "include" else _exclude)(hosts, merged, source, warnings)


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
    _check_together(include, exclude, num_nodes, num_gpus)
    if include != "":
        nodes = _apply_filter(hosts, include, "include", source, warnings)
    elif exclude != "":
        nodes = _apply_filter(hosts, exclude, "exclude", source, warnings)
    else:
        nodes = [(host, tuple(range(count))) for host, count in hosts.items()]
    if (include or exclude) and not nodes:
        kind, text = ("include", include) if include else ("exclude", exclude)
        warnings.append(
            f"The {kind} filter {clip(text)} leaves no host with any slot in hostfile {source}; "
            f"the pool is empty.")
    nodes = _apply_counts(hosts, nodes, num_nodes, num_gpus, source, warnings)
    return ResourcePool(nodes=tuple(nodes), warnings=tuple(warnings))


def _check_together(include: str, exclude: str, num_nodes: int, num_gpus: int) -> None:
    """DeepSpeed's rules on which settings may be given together (``runner.main``: no
    num_nodes/num_gpus with a filter; ``parse_inclusion_exclusion``: not both filters)."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include != "" or exclude != ""):
        counts = " and ".join(f"{n}={v}" for n, v in
                              (("num_nodes", num_nodes), ("num_gpus", num_gpus)) if v >= 0)
        filters = " and ".join(f"{n}={clip(v)}" for n, v in
                               (("include", include), ("exclude", exclude)) if v != "")
        raise FilterError(
            f"Setting {counts} together with {filters} is not allowed: DeepSpeed forbids "
            f"num_nodes/num_gpus (any value >= 0, even 0) with include/exclude; set num_nodes "
            f"and num_gpus to -1, or express the selection in the filter alone.",
            token="num_nodes" if num_nodes >= 0 else "num_gpus")
    if include != "" and exclude != "":
        raise FilterError(
            f"Both include={clip(include)} and exclude={clip(exclude)} are given, but they are "
            f"mutually exclusive: include lists the only hosts/slots to use, exclude removes "
            f"hosts/slots from the hostfile; give one of them.", token="include")


def _apply_counts(hosts: Mapping[str, int], nodes: list[tuple[str, tuple[int, ...]]], num_nodes: int, num_gpus: int,
                  source: str, warnings: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """``runner.apply_num_nodes_and_gpus`` (quirks 4-7): the first ``num_nodes`` hosts, each with slots
    ``0..num_gpus-1``."""
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
                f"num_gpus={num_gpus} gives host(s) {names(short)} slots 0..{num_gpus - 1} "
                f"although hostfile {source} gives them fewer (e.g. {short[0]} has "
                f"slots={hosts[short[0]]}); DeepSpeed does not check num_gpus against the "
                f"hostfile.")
        gpus = tuple(range(num_gpus))
        nodes = [(host, gpus) for host, _ in nodes]
    else:
        empty = [h for h, slots in nodes if not slots]
        if empty:
            warnings.append(
                f"Host(s) {names(empty)} have slots=0 in hostfile {source}; DeepSpeed keeps "
                f"them in the pool with no slots (they get no ranks"
                f"{', but count towards num_nodes' if num_nodes > 0 else ''}).")
    return nodes
