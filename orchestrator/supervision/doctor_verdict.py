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
``allreduce`` (a short gloo all-reduce among every node worked; each node's bus bandwidth, the slowest named).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .preflight import CHECKS

__all__ = ["DOCTOR_CHECKS", "VERSION_KEYS", "Limits", "NodeAnswers", "judge", "clock_offset"]

#: Every check, in the order shown.
DOCTOR_CHECKS = ("agent", *CHECKS, "environment", "versions", "gpus", "disk", "memory", "clock",
                 "master_port_reachable", "allreduce")
#: What must agree across nodes, in the order named.
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "deepspeed")
_GIB = 1 << 30
_LISTED = 8


@dataclass(frozen=True)
class Limits:
    """What the doctor accepts.

    Attributes:
        max_skew_s: a node's clock may differ from the controller's by this many seconds, beyond the
            uncertainty of the round trip that read it.
        min_disk_bytes: free bytes needed on the file systems of the workdir and the checkpoint dir.
        min_memory_bytes: available memory needed on every node.
        timeout_s: the deadline of each phase (named in the failure of a node that did not answer).
    """

    max_skew_s: float = 2.0
    min_disk_bytes: int = _GIB
    min_memory_bytes: int = _GIB
    timeout_s: float = 120.0


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
            "bytes", "iters", "correct"}}``.
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


def _node_checks(a: NodeAnswers, limits: Limits, versions: dict[int, dict[str, Any]],
                 listening: bool | None, slowest: int | None = None, nodes: int = 1) -> list[dict[str, Any]]:
    """Every check of one node that is up (its agent said hello)."""
    checks = [_check("agent", "passed", "its agent started and said hello"), *a.preflight]
    if a.report is None:
        checks.append(_check("environment", "failed", f"no report within {limits.timeout_s:g} s"))
        checks += [_check(n, "skipped", "no report") for n in ("versions", "gpus", "disk", "memory")]
    else:
        checks += [_environment(a), versions[a.node_rank], _gpus(a), _disk(a, limits), _memory(a, limits)]
    checks.append(_clock(a, limits))
    if a.port is not None:
        checks.append(_check("master_port_reachable", str(a.port.get("status")), str(a.port.get("detail"))))
    elif a.node_rank != 0 and listening is False:
        checks.append(_check("master_port_reachable", "skipped", "node 0 is not listening on the master port"))
    else:
        checks.append(_check("master_port_reachable", "failed",
                             f"no answer to the master port check within {limits.timeout_s:g} s"))
    checks.append(_allreduce(a, limits, slowest, nodes))
    return checks


def judge(answers: list[NodeAnswers], limits: Limits, skip: dict[str, str] | None = None) -> dict[str, Any]:
    """The verdict over every node's answers.

    Args:
        answers: one per node of the plan, in node order.
        limits: thresholds (:class:`Limits`).
        skip: checks reported as skipped whatever a node answered, with the reason (e.g. ``entrypoint``
            for a hostfile alone, which names none).

    Returns:
        ``{"passed": bool, "checks": [names shown], "nodes": [{"node_rank", "host", "report", "checks":
        [{"name", "status", "detail"}]}], "failures": [{"node", "node_rank", "check", "message", "text"}]}``.
    """
    skip = skip or {}
    versions = _version_checks([a for a in answers if a.down is None])
    node0 = next((a for a in answers if a.node_rank == 0), None)
    listening = None if node0 is None or node0.port is None else node0.port.get("status") == "passed"
    slowest = _slowest(answers)
    nodes, failures = [], []
    for a in answers:
        if a.down is not None:
            checks = [_check("agent", "failed", a.down)] + [_check(n, "skipped", "its agent is not up")
                                                           for n in DOCTOR_CHECKS[1:]]
        else:
            checks = _node_checks(a, limits, versions, listening, slowest, len(answers))
        checks = [_check(c["name"], "skipped", skip[c["name"]]) if c.get("name") in skip else c for c in checks]
        checks.sort(key=lambda c: DOCTOR_CHECKS.index(c["name"]) if c["name"] in DOCTOR_CHECKS else len(DOCTOR_CHECKS))
        nodes.append({"node_rank": a.node_rank, "host": a.host, "report": a.report, "checks": checks})
        failures += [{"node": a.host, "node_rank": a.node_rank, "check": c["name"], "message": c["detail"],
                      "text": f"{a.host} (node {a.node_rank}) {c['name']}: {c['detail']}"}
                     for c in checks if c["status"] == "failed"]
    shown = [n for n in DOCTOR_CHECKS if any(c["name"] == n for node in nodes for c in node["checks"])]
    return {"passed": not failures, "checks": shown, "nodes": nodes, "failures": failures}
