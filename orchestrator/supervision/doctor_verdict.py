"""``orch doctor``'s verdict: every node's answers (the preflight round's checks, its environment report,
its clock, the master port) judged into one table of node x check. Pure (no I/O);
:mod:`.doctor` gathers the answers.

Example::

    out = judge(nodes, answers, Limits())
    out["passed"], out["failures"]     # each failure names the node and the check

The checks, in the order shown (:data:`DOCTOR_CHECKS`): ``agent`` (the node's agent started and said
hello), the preflight's (:data:`.preflight.CHECKS`), ``environment`` (the spec's Python imported torch
and DeepSpeed and named its accelerator), ``versions`` (Python, torch, CUDA, NCCL and DeepSpeed agree
across nodes: the largest group of nodes that agree is taken as right, every other node is named with
its versions), ``gpus``, ``disk``, ``memory``, ``clock`` (skew against the controller's clock),
``master_port_reachable`` (node 0 listens on the master port, every other node connects to it),
``allreduce`` (a short all-reduce among every node worked; each node's bus bandwidth, the slowest named),
``links`` (every link tested, :func:`pair_rounds`, carried data at or above ``Limits.min_link_gbps``; the
slowest link named) and, in the place of the preflight's ``ops`` (which the doctor does not run),
``ops`` (DeepSpeed's op builders: installed prebuilt, compatible; a node whose compatible set differs from
the largest group's is a *warning*, named with the difference, and does not fail the doctor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .preflight import CHECKS

__all__ = ["DOCTOR_CHECKS", "VERSION_KEYS", "ALL_PAIRS_UP_TO", "Limits", "NodeAnswers", "judge", "clock_offset",
           "pair_rounds", "links_of"]

#: Every check, in the order shown (``ops`` is the doctor's own, in the preflight's place).
DOCTOR_CHECKS = ("agent", *CHECKS, "environment", "versions", "gpus", "disk", "memory", "clock",
                 "master_port_reachable", "allreduce", "links")
#: What must agree across nodes, in the order named.
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "deepspeed")
_GIB = 1 << 30
_LISTED = 8
#: Up to this many nodes every pair's link is tested; above, only ring neighbours' (i <-> i + 1 mod n).
ALL_PAIRS_UP_TO = 16


@dataclass(frozen=True)
class Limits:
    """What the doctor accepts.

    Attributes:
        max_skew_s: a node's clock may differ from the controller's by this many seconds, beyond the
            uncertainty of the round trip that read it.
        min_disk_bytes: free bytes needed on the file systems of the workdir and the checkpoint dir.
        min_memory_bytes: available memory needed on every node.
        timeout_s: the deadline of each phase (named in the failure of a node that did not answer).
        min_link_gbps: a link test under this many GB/s (10^9 bytes/s each way) fails both its nodes; None:
            no threshold (the slowest link is named all the same).
    """

    max_skew_s: float = 2.0
    min_disk_bytes: int = _GIB
    min_memory_bytes: int = _GIB
    timeout_s: float = 120.0
    min_link_gbps: float | None = None


@dataclass
class NodeAnswers:
    """What one node answered (None: it did not answer that part in time).

    Attributes:
        node_rank, host: the node.
        slots: how many slots (devices) the plan gives it.
        down: why its agent never said hello (None: it did).
        preflight: its preflight checks (``[{"name", "status", "detail", ...}]``, from the round's verdict).
        report: its ``report`` (:mod:`agents.doctor`).
        clock: ``(controller's time.time() when asked, when answered, the node's clock)``.
        port: its ``listen`` (node 0) or ``connect`` answer: ``{"status", "detail"}``.
        allreduce: its ``allreduce`` answer: ``{"status", "detail", "result": {"busbw", "algbw", "seconds",
            "bytes", "iters", "correct", "backend", "links": [{"peer", "gbps", "seconds", "bytes", "correct"}],
            "rounds", "rounds_done", "links_error"?}}``.
    """

    node_rank: int
    host: str
    slots: int = 1
    down: str | None = None
    preflight: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None
    clock: tuple[float, float, float] | None = None
    port: dict[str, Any] | None = None
    allreduce: dict[str, Any] | None = None


def _check(name: str, status: str, detail: str) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail}


def clock_offset(sent: float, received: float, node_at: float) -> tuple[float, float]:
    """``(offset, uncertainty)`` in seconds: how far the node's clock is ahead of the controller's (negative:
    behind), taking the node's reading as made halfway through the round trip, and half the round trip."""
    return node_at - (sent + received) / 2.0, max(0.0, received - sent) / 2.0


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def _versions_of(report: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(report.get(k)) if report.get(k) else "none" for k in VERSION_KEYS)


def _words(versions: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {v}" for k, v in zip(VERSION_KEYS, versions))


def _version_checks(answers: list[NodeAnswers]) -> dict[int, dict[str, Any]]:
    """Each reporting node's ``versions`` check: passed in the largest group (ties: the one with the
    lowest node rank), failed elsewhere, naming what the others have."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for a in answers:
        if a.report is not None:
            groups.setdefault(_versions_of(a.report), []).append(a.node_rank)
    if not groups:
        return {}
    right = max(groups, key=lambda v: (len(groups[v]), -min(groups[v])))
    total = sum(len(m) for m in groups.values())
    out = {}
    for versions, members in groups.items():
        for n in members:
            if versions == right:
                out[n] = _check("versions", "passed", f"{_words(versions)}" + (
                    f" (as on all {total} nodes that reported)" if len(groups) == 1 else
                    f" (as on {len(members)} of {total} nodes)"))
            else:
                diff = [i for i, (mine, theirs) in enumerate(zip(versions, right)) if mine != theirs]
                mine = ", ".join(f"{VERSION_KEYS[i]} {versions[i]}" for i in diff)
                theirs = ", ".join(f"{VERSION_KEYS[i]} {right[i]}" for i in diff)
                out[n] = _check("versions", "failed",
                                f"{mine} where {len(groups[right])} of {total} nodes have {theirs}")
    return out


def _environment(a: NodeAnswers) -> dict[str, Any]:
    r = a.report or {}
    errors = [str(e) for e in r.get("errors") or []]
    if errors:
        return _check("environment", "failed", "; ".join(errors))
    cuda = ""
    if r.get("cuda"):
        cuda = f" (CUDA {r['cuda']}" + (f", NCCL {r['nccl']})" if r.get("nccl") else ")")
    return _check("environment", "passed", f"Python {r.get('python')}, torch {r.get('torch')}{cuda}, "
                  f"DeepSpeed {r.get('deepspeed')}, accelerator {r.get('accelerator')}")


def _gpus(a: NodeAnswers) -> dict[str, Any]:
    r = a.report or {}
    accelerator, gpus = r.get("accelerator"), int(r.get("gpus") or 0)
    if accelerator == "cuda" and gpus < a.slots:
        return _check("gpus", "failed", f"{gpus} GPU(s) visible to torch, the plan gives this node {a.slots} slot(s)")
    if accelerator == "cuda" or gpus:
        return _check("gpus", "passed", f"{gpus} GPU(s) visible (accelerator {accelerator})")
    return _check("gpus", "passed", f"no GPU: accelerator {accelerator or 'unknown'}")


def _disk(a: NodeAnswers, limits: Limits) -> dict[str, Any]:
    parts, failed = [], False
    for what, d in sorted(((a.report or {}).get("disk") or {}).items()):
        if d.get("free") is None:
            failed = True
            parts.append(f"{what} {d.get('path')}: cannot measure ({d.get('error')})")
            continue
        low = d["free"] < limits.min_disk_bytes
        failed |= low
        parts.append(f"{what} {d.get('path')}: {_gib(d['free'])} free" + (
            f", under {_gib(limits.min_disk_bytes)}" if low else ""))
    return _check("disk", "failed" if failed else "passed", "; ".join(parts) or "no answer")


def _memory(a: NodeAnswers, limits: Limits) -> dict[str, Any]:
    free = (a.report or {}).get("memory")
    if free is None:
        return _check("memory", "failed", "cannot read the node's available memory")
    if free < limits.min_memory_bytes:
        return _check("memory", "failed", f"{_gib(free)} available, under {_gib(limits.min_memory_bytes)}")
    return _check("memory", "passed", f"{_gib(free)} available")


def _clock(a: NodeAnswers, limits: Limits) -> dict[str, Any]:
    if a.clock is None:
        return _check("clock", "failed", f"no answer to the clock request within {limits.timeout_s:g} s")
    offset, uncertainty = clock_offset(*a.clock)
    way = "ahead of" if offset >= 0 else "behind"
    detail = f"{abs(offset):.3f} s {way} the controller's clock (±{uncertainty:.3f} s)"
    if abs(offset) - uncertainty > limits.max_skew_s:
        return _check("clock", "failed", f"{detail}: more than {limits.max_skew_s:g} s")
    return _check("clock", "passed", detail)


def _allreduce(a: NodeAnswers, limits: Limits, slowest: int | None, nodes: int) -> dict[str, Any]:
    if a.allreduce is None:
        return _check("allreduce", "failed", f"no answer to the all-reduce within {limits.timeout_s:g} s")
    r = a.allreduce.get("result") or {}
    if a.allreduce.get("status") != "passed":
        return _check("allreduce", "failed", str(a.allreduce.get("detail")))
    if not r.get("correct"):
        return _check("allreduce", "failed", "the all-reduce returned a wrong sum")
    detail = (f"bus bandwidth {float(r.get('busbw') or 0) / 1e6:.1f} MB/s ({int(r.get('bytes') or 0) >> 20} MiB, "
              f"{float(r.get('seconds') or 0) * 1000:.1f} ms each)")
    return _check("allreduce", "passed", detail + (f"; the slowest of {nodes} nodes" if a.node_rank == slowest else ""))


def _slowest(answers: list[NodeAnswers]) -> int | None:
    """The node with the lowest all-reduce bus bandwidth, among two or more that ran it."""
    ran = [(float((a.allreduce.get("result") or {}).get("busbw") or 0.0), a.node_rank) for a in answers
           if a.allreduce is not None and a.allreduce.get("status") == "passed"]
    return min(ran)[1] if len(ran) > 1 else None


def pair_rounds(n: int) -> tuple[list[list[list[int]]], str]:
    """The link tests' schedule among ``n`` nodes, and what it covers.

    Returns:
        ``(rounds, scope)``: each round a list of disjoint pairs ``[a, b]`` (node ranks, ``a < b``) tested at
        once, the rounds one after another. Up to :data:`ALL_PAIRS_UP_TO` nodes every pair once, in a
        round-robin (``n - 1`` rounds for even ``n``, ``n`` for odd); above, the ring neighbours
        ``i <-> i + 1 mod n`` only (2 or 3 rounds). ``scope`` says which, in words.
    """
    if n < 2:
        return [], "no links (one node)"
    if n <= ALL_PAIRS_UP_TO:
        m = n + n % 2  # odd n: a stand-in node n; its partner sits the round out
        order, rounds = list(range(m)), []
        for _ in range(m - 1):
            pairs = [sorted((order[i], order[m - 1 - i])) for i in range(m // 2)]
            rounds.append(sorted(p for p in pairs if p[1] < n))
            order = [order[0], order[-1], *order[1:-1]]
        return rounds, "all pairs"
    rounds, busy = [], []
    for edge in sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n)}, key=lambda e: (e[1] - e[0] != 1, e)):
        k = next((k for k, nodes in enumerate(busy) if not nodes & set(edge)), len(busy))
        if k == len(busy):
            rounds.append([])
            busy.append(set())
        rounds[k].append(list(edge))
        busy[k] |= set(edge)
    return rounds, f"ring neighbours only (i <-> i+1 mod {n}): more than {ALL_PAIRS_UP_TO} nodes"


def _result(a: NodeAnswers) -> dict[str, Any] | None:
    """The node's all-reduce result where its all-reduce passed, else None."""
    if a.allreduce is None or a.allreduce.get("status") != "passed":
        return None
    return a.allreduce.get("result") or {}


def links_of(answers: list[NodeAnswers]) -> list[dict[str, Any]]:
    """Every scheduled link (:func:`pair_rounds` over the nodes): ``{"a", "b"}`` (hosts), ``"a_rank", "b_rank"``,
    ``"gbps"`` (GB/s, 10^9 bytes/s each way: the lower of the two nodes' measurements; None: not measured) and
    ``"correct"`` (both received what the other sent; None: not measured)."""
    by_rank = {a.node_rank: a for a in answers}
    seen: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for a in answers:
        for link in (_result(a) or {}).get("links") or []:
            seen.setdefault(tuple(sorted((a.node_rank, int(link.get("peer", -1))))), []).append(link)
    out = []
    for rnd in pair_rounds(len(answers))[0]:
        for x, y in rnd:
            got = seen.get((x, y), [])
            out.append({"a": by_rank[x].host, "b": by_rank[y].host, "a_rank": x, "b_rank": y,
                        "gbps": min(float(g.get("gbps") or 0.0) for g in got) if got else None,
                        "correct": all(bool(g.get("correct")) for g in got) if got else None})
    return sorted(out, key=lambda link: (link["a_rank"], link["b_rank"]))


def _gbps(g: float) -> str:
    return f"{g:.3g} GB/s"


def _links_check(a: NodeAnswers, links: list[dict[str, Any]], limits: Limits, slowest: dict[str, Any] | None,
                 ran: set[int]) -> dict[str, Any]:
    """One node's ``links`` check: failed for a link of it that was not measured (both ends' all-reduce ran),
    carried wrong data, or is under ``limits.min_link_gbps``; else passed, naming its slowest link."""
    if _result(a) is None:
        return _check("links", "skipped", "the all-reduce did not pass on this node")
    mine = [link for link in links if a.node_rank in (link["a_rank"], link["b_rank"])]
    if not mine:
        return _check("links", "skipped", "one node: no link to test")
    problems = []
    for link in mine:
        name = f"{link['a']} <-> {link['b']}"
        if link["gbps"] is None:
            if {link["a_rank"], link["b_rank"]} <= ran:
                why = (_result(a) or {}).get("links_error") or "its other node's link tests did not finish"
                problems.append(f"{name} not measured: {why}")
        elif not link["correct"]:
            problems.append(f"{name} carried wrong data")
        elif limits.min_link_gbps is not None and link["gbps"] < limits.min_link_gbps:
            problems.append(f"{name} {_gbps(link['gbps'])}, under the minimum {limits.min_link_gbps:g} GB/s")
    if problems:
        return _check("links", "failed", "; ".join(problems))
    measured = [link for link in mine if link["gbps"] is not None]
    if not measured:
        return _check("links", "skipped", "no link of this node was tested (its other nodes' all-reduce failed)")
    low = min(measured, key=lambda link: link["gbps"])
    detail = f"{len(measured)} link(s), slowest {low['a']} <-> {low['b']} {_gbps(low['gbps'])}"
    if slowest is not None and (low["a_rank"], low["b_rank"]) == (slowest["a_rank"], slowest["b_rank"]):
        detail += f"; the slowest link of {sum(1 for link in links if link['gbps'] is not None)}"
    return _check("links", "passed", detail)


def _ops_checks(answers: list[NodeAnswers]) -> dict[int, dict[str, Any]]:
    """Each up node's ``ops`` check: passed in the largest group of nodes with the same compatible ops (ties: the
    lowest node rank), a *warning* elsewhere naming the difference; skipped where DeepSpeed was not imported."""
    out, groups = {}, {}
    for a in answers:
        r = a.report or {}
        if r.get("ops_error"):
            out[a.node_rank] = _check("ops", "warning", str(r["ops_error"]))
        elif not isinstance(r.get("ops"), dict):
            out[a.node_rank] = _check("ops", "skipped", "no report of DeepSpeed's ops (DeepSpeed was not imported)")
        else:
            groups.setdefault(frozenset(k for k, v in r["ops"].items() if v.get("compatible")), []).append(a)
    if not groups:
        return out
    right = max(groups, key=lambda g: (len(groups[g]), -min(a.node_rank for a in groups[g])))
    total = sum(len(m) for m in groups.values())
    for compatible, members in groups.items():
        for a in members:
            ops = a.report["ops"]  # type: ignore[index]
            counts = (f"{len(ops)} ops, {len(compatible)} compatible, "
                      f"{sum(1 for v in ops.values() if v.get('installed'))} installed prebuilt")
            if compatible == right:
                nope = sorted(set(ops) - compatible)
                where = (f"the same on all {total} nodes" if len(groups) == 1
                         else f"as on {len(members)} of {total} nodes")
                out[a.node_rank] = _check("ops", "passed", counts + (
                    f"; not compatible: {_names(nope)}" if nope else "") + f" ({where})")
                continue
            others = f"{len(groups[right])} of {total} nodes"
            more, fewer = sorted(compatible - right), sorted(right - compatible)
            said = [f"compatible here but not on {others}: {_names(more)}"] * bool(more)
            said += [f"not compatible here but on {others}: {_names(fewer)}"] * bool(fewer)
            out[a.node_rank] = _check("ops", "warning", f"{'; '.join(said)} ({counts})")
    return out


def _names(names: list[str]) -> str:
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


@dataclass
class _Across:
    """What the checks of one node need from every node's answers."""

    versions: dict[int, dict[str, Any]]
    ops: dict[int, dict[str, Any]]
    listening: bool | None
    slowest_node: int | None
    nodes: int
    links: list[dict[str, Any]]
    slowest_link: dict[str, Any] | None
    ran: set[int]


def _node_checks(a: NodeAnswers, limits: Limits, across: _Across) -> list[dict[str, Any]]:
    """Every check of one node that is up (its agent said hello)."""
    checks = [_check("agent", "passed", "its agent started and said hello"),
              *(c for c in a.preflight if c.get("name") != "ops")]  # the preflight's ops (a build) gives way to ours
    if a.report is None:
        checks.append(_check("environment", "failed", f"no report within {limits.timeout_s:g} s"))
        checks += [_check(n, "skipped", "no report") for n in ("versions", "gpus", "disk", "memory", "ops")]
    else:
        checks += [_environment(a), across.versions[a.node_rank], _gpus(a), _disk(a, limits), _memory(a, limits),
                   across.ops[a.node_rank]]
    checks.append(_clock(a, limits))
    if a.port is not None:
        checks.append(_check("master_port_reachable", str(a.port.get("status")), str(a.port.get("detail"))))
    elif a.node_rank != 0 and across.listening is False:
        checks.append(_check("master_port_reachable", "skipped", "node 0 is not listening on the master port"))
    else:
        checks.append(_check("master_port_reachable", "failed",
                             f"no answer to the master port check within {limits.timeout_s:g} s"))
    checks.append(_allreduce(a, limits, across.slowest_node, across.nodes))
    checks.append(_links_check(a, across.links, limits, across.slowest_link, across.ran))
    return checks


def _across(answers: list[NodeAnswers]) -> _Across:
    up = [a for a in answers if a.down is None]
    node0 = next((a for a in answers if a.node_rank == 0), None)
    links = links_of(answers)
    measured = [link for link in links if link["gbps"] is not None]
    return _Across(versions=_version_checks(up), ops=_ops_checks([a for a in up if a.report is not None]),
                   listening=None if node0 is None or node0.port is None else node0.port.get("status") == "passed",
                   slowest_node=_slowest(answers), nodes=len(answers), links=links,
                   slowest_link=min(measured, key=lambda link: link["gbps"]) if measured else None,
                   ran={a.node_rank for a in answers if _result(a) is not None})


def _listed(a: NodeAnswers, checks: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """The checks of ``a`` with ``status``, as the verdict's ``failures`` (or ``warnings``) list them."""
    return [{"node": a.host, "node_rank": a.node_rank, "check": c["name"], "message": c["detail"],
             "text": f"{a.host} (node {a.node_rank}) {c['name']}: {c['detail']}"}
            for c in checks if c["status"] == status]


def judge(answers: list[NodeAnswers], limits: Limits, skip: dict[str, str] | None = None) -> dict[str, Any]:
    """The verdict over every node's answers.

    Args:
        answers: one per node of the plan, in node order.
        limits: thresholds (:class:`Limits`).
        skip: checks reported as skipped whatever a node answered, with the reason (e.g. ``entrypoint``
            for a hostfile alone, which names none).

    Returns:
        ``{"passed": bool, "checks": [names shown], "nodes": [{"node_rank", "host", "report", "checks":
        [{"name", "status", "detail"}]}], "failures": [{"node", "node_rank", "check", "message", "text"}],
        "warnings": [the same, for checks with status "warning": they do not fail the doctor], "backend": the
        all-reduce's ("gloo", "nccl"; None: it did not run), "links": [{"a", "b", "a_rank", "b_rank", "gbps",
        "correct"}], "links_scope": which pairs were tested, in words, "slowest_link": {"a", "b", "gbps"} or None}``.
    """
    skip = skip or {}
    across = _across(answers)
    nodes, failures, warnings = [], [], []
    for a in answers:
        if a.down is not None:
            checks = [_check("agent", "failed", a.down)] + [_check(n, "skipped", "its agent is not up")
                                                           for n in DOCTOR_CHECKS[1:]]
        else:
            checks = _node_checks(a, limits, across)
        checks = [_check(c["name"], "skipped", skip[c["name"]]) if c.get("name") in skip else c for c in checks]
        checks.sort(key=lambda c: DOCTOR_CHECKS.index(c["name"]) if c["name"] in DOCTOR_CHECKS else len(DOCTOR_CHECKS))
        nodes.append({"node_rank": a.node_rank, "host": a.host, "report": a.report, "checks": checks})
        failures += _listed(a, checks, "failed")
        warnings += _listed(a, checks, "warning")
    shown = [n for n in DOCTOR_CHECKS if any(c["name"] == n for node in nodes for c in node["checks"])]
    backend = next((r.get("backend") for r in map(_result, answers) if r and r.get("backend")), None)
    low = across.slowest_link
    return {"passed": not failures, "checks": shown, "nodes": nodes, "failures": failures, "warnings": warnings,
            "backend": backend, "links": across.links, "links_scope": pair_rounds(len(answers))[1],
            "slowest_link": {"a": low["a"], "b": low["b"], "gbps": low["gbps"]} if low else None}
