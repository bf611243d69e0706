"""Preflight, the controller's side: which checks apply to a job, what each node is asked, and
the verdict over the nodes' answers. Pure (no I/O); ``AttemptRun`` carries the messages.

Between every agent's ``hello`` and the first rank's start, each node checks (in
:mod:`agents.preflight`) the spec's Python, DeepSpeed, the workdir and entrypoint, the
checkpoint directory and, on node 0, the master port, and builds (or finds built) the DeepSpeed ops
the job's config needs where its ranks load them, once per node (``ops``; phase ``check``), and what the config's features need there (``zero_pp``: ZeRO++ quantisation on an
accelerator with DeepSpeed's kernels; ``nvme``: libaio and the NVMe paths); then every node
that could write into the checkpoint directory says which nodes' token files it sees there
(phase ``list``), which shows whether the directory is one shared directory. A failing
check fails the attempt with cause ``preflight_failed`` before any rank starts; the
results are recorded as a ``preflight`` event either way.

Example::

    pf = PreflightRound(spec, plan, python, timeout_s=60, heartbeat_s=0.5, lease_s=15)
    for node_rank, msg in pf.requests().items(): send(node_rank, msg)
    pf.record(node_rank, answer)                   # for each ``preflight_result``
    if pf.phase_complete(): msgs = pf.list_requests() or None  # then verdict()
    event, cause = pf.verdict()                    # cause is None when every node passed
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Callable, Iterable

from ..planning import JobPlan
from ..spec import JobSpec
from ..spec.dsops import ops_needed
from ..spec.dszero import nvme_paths, quantized

__all__ = ["PreflightRound", "CHECKS", "TOKEN_PREFIX", "token_dir", "skipped_checks", "ops_summary"]

#: Every check, in the order results are shown.
CHECKS = ("python", "deepspeed", "workdir", "entrypoint", "checkpoint_dir", "master_port", "network",
          "build_locks", "zero_pp", "nvme", "ops", "shared_checkpoint_dir")
#: Seconds the ``ops`` check may take to build DeepSpeed's ops when the spec has no ``startup_timeout``
#: (the ranks would have built them within that deadline).
OPS_TIMEOUT_S = 900.0
#: Name prefix of the token directory inside the checkpoint directory (as agents.preflight).
TOKEN_PREFIX = ".orch-preflight-"
_LISTED = 8  # hosts named per group of a shared-storage failure before "and N more"


def token_dir(checkpoint_dir: str, attempt_id: str) -> str:
    """Where the nodes leave their shared-storage tokens: ``<checkpoint dir>/.orch-preflight-<attempt id>``."""
    return os.path.join(checkpoint_dir, f"{TOKEN_PREFIX}{attempt_id}")


def skipped_checks(spec: JobSpec, plan: JobPlan) -> dict[str, str]:
    """The checks that do not apply to this attempt, each with the reason shown for it.

    ``deepspeed`` applies only to a job known to use DeepSpeed: one whose plan carries a
    DeepSpeed config (the spec's ``deepspeed_config``, or one built from an Accelerate
    config), or that asks for ``deepspeed_args`` (so does ``build_locks``); ``python`` and ``deepspeed`` do not apply
    under ``no_python`` (the entrypoint runs without the spec's Python); the shared-storage
    check needs two nodes and can be turned off (``preflight.shared_checkpoint_dir``); ``zero_pp`` applies to a
    config with ZeRO++ quantisation, ``nvme`` to one that offloads to NVMe (``orchestrator.spec.dszero``).
    """
    skip: dict[str, str] = {}
    if spec.no_python:
        skip["python"] = skip["deepspeed"] = "no_python: the entrypoint runs without the spec's Python"
    elif not plan.deepspeed_config and spec.deepspeed_config is None and not spec.deepspeed_args:
        skip["deepspeed"] = "the spec has no deepspeed_config, so the job is not known to use DeepSpeed"
    if "deepspeed" in skip:
        skip["build_locks"] = skip["ops"] = "the job is not known to build DeepSpeed's ops"
    config = plan.deepspeed_config or {}
    if "python" in skip:
        skip["zero_pp"] = skip["nvme"] = skip["python"]
    else:
        if not quantized(config):
            skip["zero_pp"] = "the DeepSpeed config turns on no ZeRO++ quantisation (zero_quantized_*) at stage 3"
        if not nvme_paths(config):
            skip["nvme"] = "the DeepSpeed config offloads nothing to NVMe (offload_* device nvme at stage 3)"
    if not spec.preflight.shared_checkpoint_dir:
        skip["shared_checkpoint_dir"] = "turned off (preflight.shared_checkpoint_dir: false)"
    elif len(plan.nodes) < 2:
        skip["shared_checkpoint_dir"] = "one node: nothing to share with"
    return skip


def _mode(spec: JobSpec) -> str:
    return "module" if spec.module else "no_python" if spec.no_python else "script"


def _result(name: str, status: str, detail: str, seconds: float = 0.0) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "seconds": round(seconds, 4)}


class PreflightRound:
    """The preflight of one attempt: the requests, the answers so far, and the verdict.

    Args:
        spec: the job's spec (which checks apply, ``preflight`` options).
        plan: the attempt's plan (nodes, checkpoint dir, master address and port).
        python: the ranks' interpreter (absolute where the controller could resolve it).
        timeout_s: seconds the whole preflight may take before nodes still checking fail it, plus, for a
            DeepSpeed job, the ops check's build deadline (the spec's ``startup_timeout``, else
            :data:`OPS_TIMEOUT_S`), which each node also applies to its own build.
        heartbeat_s, lease_s: passed to the agents (heartbeats start with the preflight; an
            agent exits when the controller is silent for ``lease_s``).
        nonce: written into the shared-storage tokens (random by default).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, spec: JobSpec, plan: JobPlan, python: str, *, timeout_s: float, heartbeat_s: float,
                 lease_s: float, nonce: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.plan = plan
        self.python = python
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.nonce = nonce or secrets.token_hex(8)
        self.clock = clock
        self.skip = skipped_checks(spec, plan)
        self.shared_dir = token_dir(plan.checkpoint_dir, plan.attempt_id)
        self.phase = "check"
        self.started = clock()
        self.ops = [] if "ops" in self.skip else ops_needed(plan.deepspeed_config)
        self.ops_timeout_s = float(spec.startup_timeout or OPS_TIMEOUT_S) if self.ops else 0.0
        self.deadline = self.started + timeout_s + self.ops_timeout_s  # building ops may take minutes
        self.phase_seconds: dict[str, float] = {}
        self._phase_started = self.started
        self.checks: dict[int, list[dict[str, Any]]] = {}
        self.seconds: dict[int, float] = {}
        self.wrote: set[int] = set()
        self.seen: dict[int, set[int]] = {}
        self.listed = False  # phase ``list`` was asked for
        self.list_problems: dict[int, list[str]] = {}
        self.waiting: set[int] = {n.node_rank for n in plan.nodes}
        self.current: dict[int, str | None] = {}  # node -> check running (from its heartbeats)

    # -- requests -----------------------------------------------------------------------------

    def requests(self) -> dict[int, dict[str, Any]]:
        """Phase ``check``: the ``preflight`` message for every node, by node rank."""
        spec, plan = self.spec, self.plan
        shared = None if "shared_checkpoint_dir" in self.skip else {"dir": self.shared_dir, "nonce": self.nonce}
        common = {"type": "preflight", "phase": "check", "python": self.python, "entrypoint": spec.entrypoint,
                  "mode": _mode(spec), "checkpoint_dir": plan.checkpoint_dir,
                  "deepspeed": "import" if spec.preflight.import_deepspeed else "find", "shared": shared,
                  "timeout_s": round(self.timeout_s * 0.75, 3), "heartbeat_s": self.heartbeat_s,
                  "lease_s": self.lease_s, "ops": self.ops, "ops_timeout_s": self.ops_timeout_s,
                  "zero_pp": [] if "zero_pp" in self.skip else quantized(plan.deepspeed_config or {}),
                  "nvme": None if "nvme" in self.skip else {"paths": nvme_paths(plan.deepspeed_config or {}),
                                                            "min_free_gb": spec.preflight.nvme_min_free_gb}}
        out = {}
        for node in plan.nodes:
            master = {"addr": plan.master_addr, "port": plan.master_port} if node.node_rank == 0 else None
            out[node.node_rank] = {**common, "node": node.to_dict(), "workdir": node.workdir, "skip": self.skip,
                                   "master_port": master}
        return out

    def list_requests(self) -> dict[int, dict[str, Any]]:
        """Phase ``list`` for the nodes that wrote a token, once phase ``check`` is complete;
        empty (and the preflight is over) when fewer than two nodes wrote one."""
        self._end_phase()
        if "shared_checkpoint_dir" in self.skip or len(self.wrote) < 2:
            self.phase = "done"
            return {}
        self.phase = "list"
        self.listed = True
        self.waiting = set(self.wrote)
        msg = {"type": "preflight", "phase": "list", "shared": {"dir": self.shared_dir, "nonce": self.nonce},
               "expect": sorted(self.wrote)}
        return {n: dict(msg) for n in sorted(self.wrote)}

    def _end_phase(self) -> None:
        now = self.clock()
        self.phase_seconds[self.phase] = round(now - self._phase_started, 4)
        self._phase_started = now

    # -- answers ------------------------------------------------------------------------------

    def record(self, node_rank: int, msg: dict[str, Any]) -> None:
        """Take one node's ``preflight_result`` for the current phase (others are ignored)."""
        if msg.get("phase") != self.phase or node_rank not in self.waiting:
            return
        self.waiting.discard(node_rank)
        self.current.pop(node_rank, None)
        if self.phase == "check":
            self.checks[node_rank] = [c for c in msg.get("checks") or [] if isinstance(c, dict)]
            self.seconds[node_rank] = float(msg.get("seconds") or 0.0)
            checkpoint_ok = any(c.get("name") == "checkpoint_dir" and c.get("status") == "passed"
                                for c in self.checks[node_rank])
            if msg.get("token") and checkpoint_ok:
                self.wrote.add(node_rank)
        else:
            self.seen[node_rank] = {int(n) for n in msg.get("seen") or []}
            self.list_problems[node_rank] = [str(p) for p in msg.get("problems") or []]
            self.seconds[node_rank] = self.seconds.get(node_rank, 0.0) + float(msg.get("seconds") or 0.0)

    def phase_complete(self) -> bool:
        """Every node asked in the current phase has answered."""
        return not self.waiting

    def overdue(self) -> bool:
        """The preflight has run past its timeout with nodes still checking."""
        return bool(self.waiting) and self.clock() > self.deadline

    # -- verdict ------------------------------------------------------------------------------

    def verdict(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(event data, cause)``: the ``preflight`` event's data (every node's checks with
        status, detail and seconds; the shared-storage groups; timings) and the
        ``preflight_failed`` cause, or None when every node passed.

        Nodes still waiting (past the timeout) fail with the check they were running.
        """
        if self.phase != "done":
            self._end_phase()
        failures: list[dict[str, Any]] = []
        nodes = []
        shared = self._shared_results()
        for node in self.plan.nodes:
            n = node.node_rank
            checks = list(self.checks.get(n, []))
            if n in self.waiting and not self.listed:  # silent in phase list: the shared check says so
                check = self.current.get(n) or "preflight"
                detail = (f"the {check} check did not finish within {self.timeout_s:g} s" if check != "preflight"
                          else f"no preflight answer within {self.timeout_s:g} s")
                checks.append(_result(check if check in CHECKS else "preflight", "failed", detail))
            if shared.get(n):
                checks.append(shared[n])
            checks.sort(key=lambda c: CHECKS.index(c["name"]) if c.get("name") in CHECKS else len(CHECKS))
            nodes.append({"node_rank": n, "host": node.host, "seconds": round(self.seconds.get(n, 0.0), 4),
                          "checks": checks})
            failures += [{"node": node.host, "node_rank": n, "check": c["name"], "message": c["detail"],
                          "text": f"{node.host} (node {n}): {c['detail']}"}
                         for c in checks if c.get("status") == "failed" and c.get("name") != "shared_checkpoint_dir"]
        groups, shared_failure = self._shared_failure()
        if shared_failure:
            failures.append(shared_failure)
        event = {"passed": not failures, "seconds": round(self.clock() - self.started, 4),
                 "phases": dict(self.phase_seconds), "nodes": nodes, "ops": ops_summary(nodes),
                 "shared": {"checked": bool(self.seen), "dir": self.shared_dir,
                            "groups": [{"nodes": g, "sees": s} for g, s in groups]}}
        return event, (self._cause(failures) if failures else None)

    def _shared_results(self) -> dict[int, dict[str, Any]]:
        """Each node's ``shared_checkpoint_dir`` result."""
        out = {}
        total = len(self.plan.nodes)
        for node in self.plan.nodes:
            n = node.node_rank
            if "shared_checkpoint_dir" in self.skip:
                out[n] = _result("shared_checkpoint_dir", "skipped", self.skip["shared_checkpoint_dir"])
            elif n not in self.checks:
                out[n] = _result("shared_checkpoint_dir", "skipped", "cannot check: no answer")
            elif n not in self.wrote:
                out[n] = _result("shared_checkpoint_dir", "skipped", "cannot check: this node could not write "
                                 "into the checkpoint dir")
            elif not self.listed and len(self.checks) < total:
                out[n] = _result("shared_checkpoint_dir", "skipped", "cannot check: not every node answered")
            elif not self.listed:
                out[n] = _result("shared_checkpoint_dir", "skipped", "cannot check: only this node could write "
                                 "into the checkpoint dir")
            elif n not in self.seen:
                out[n] = _result("shared_checkpoint_dir", "failed", "no answer to the shared-storage check")
            elif self.seen[n] >= self.wrote:
                out[n] = _result("shared_checkpoint_dir", "passed", f"sees the preflight files of all "
                                 f"{len(self.wrote)} node(s) that wrote one" if len(self.wrote) < total
                                 else f"sees the preflight files of all {total} nodes")
            else:
                missing = sorted(self.wrote - self.seen[n])
                out[n] = _result("shared_checkpoint_dir", "failed", f"does not see the preflight files of "
                                 f"node(s) {_ranks(missing)} in {self.shared_dir}"
                                 + "".join(f"; {p}" for p in self.list_problems.get(n, [])))
        return out

    def _shared_failure(self) -> tuple[list[tuple[list[int], list[int]]], dict[str, Any] | None]:
        """Nodes grouped by the tokens they see, and the failure naming the odd ones out (None
        when every node sees every token)."""
        if not self.listed:
            return [], None
        by_view: dict[frozenset[int], list[int]] = {}
        for n in sorted(self.seen):
            by_view.setdefault(frozenset(self.seen[n]), []).append(n)
        groups = sorted(((members, sorted(view)) for view, members in by_view.items()),
                        key=lambda g: (-len(g[0]), g[0][0]))
        complete = [n for n in self.seen if self.seen[n] >= self.wrote]
        if len(complete) == len(self.seen) and len(self.seen) == len(self.wrote):
            return groups, None
        directory = self.plan.checkpoint_dir
        if not groups:
            odd, words = [], ""
        elif all(len(m) == 1 and v == m for m, v in groups):
            odd = [m[0] for m, _ in groups]
            words = (f"each of the {len(odd)} nodes sees only its own preflight file, so the checkpoint dir is "
                     "on node-local storage")
        else:
            # the largest group (ties: node 0's) is taken as right; every other group is named as wrong
            reference = groups[0] if len(groups[0][0]) > 1 else None
            others = [g for g in groups if g is not reference]
            odd = sorted(n for members, _view in others for n in members)
            ordered = others + ([reference] if reference else [])
            words = "; ".join(self._describe(m, v) for m, v in ordered)
        silent = sorted(self.wrote - set(self.seen))
        if silent:
            words = "; ".join(filter(None, [words, f"{self._hosts(silent)} did not answer"]))
        hosts = [self.plan.nodes[n].host for n in odd + silent]
        message = (f"checkpoint dir {directory} is not the same directory on every node (it must be shared "
                   f"storage, as orch resumes from what any node saved): {words}")
        first = (odd + silent)[0]
        return groups, {"node": hosts[0], "node_rank": first, "nodes": hosts, "check": "shared_checkpoint_dir",
                        "message": message, "text": message}

    def _describe(self, members: list[int], view: list[int]) -> str:
        one = len(members) == 1
        if view == members:
            sees = "sees only its own preflight file" if one else "see only each other's preflight files"
        elif not view:
            sees = "sees no preflight file" if one else "see no preflight file"
        else:
            sees = f"{'sees' if one else 'see'} the preflight files of node(s) {_ranks(view)} only"
        return f"{self._hosts(members)} {sees}"

    def _hosts(self, ranks: list[int]) -> str:
        shown = ranks[:_LISTED]
        names = ", ".join(self.plan.nodes[n].host for n in shown)
        more = f" and {len(ranks) - len(shown)} more" if len(ranks) > len(shown) else ""
        return f"{names}{more} (node{'s' if len(ranks) > 1 else ''} {_ranks(ranks)})"

    def _cause(self, failures: list[dict[str, Any]]) -> dict[str, Any]:
        """The ``preflight_failed`` cause: ``failures`` (one per node and check), ``lines`` (the
        same, nodes with the very same finding on one line, for people), ``nodes`` (every failing
        host, in node order), ``summary`` and ``message`` (summary and lines in one sentence)."""
        order = {node.host: node.node_rank for node in self.plan.nodes}
        failing = sorted({h for f in failures for h in (f.get("nodes") or [f["node"]])}, key=order.__getitem__)
        summary = (f"preflight failed on {len(failing)} of {len(self.plan.nodes)} node(s), so no rank was "
                   "started")
        same: dict[tuple[str, str], list[int]] = {}
        lines: dict[tuple[str, str], str] = {}
        for f in failures:
            if f.get("nodes"):  # already about several nodes (shared storage)
                lines[(f["check"], f["message"])] = f["text"]
            else:
                same.setdefault((f["check"], f["message"]), []).append(f["node_rank"])
                lines.setdefault((f["check"], f["message"]), "")
        for key, ranks in same.items():
            lines[key] = f"{self._hosts(ranks)}: {key[1]}"
        first = failures[0]
        return {"kind": "preflight_failed", "node": first["node"], "node_rank": first["node_rank"],
                "nodes": failing, "failures": failures, "lines": list(lines.values()), "summary": summary,
                "message": f"{summary}: " + "; ".join(lines.values())}


def ops_summary(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``ops`` checks of every node, per op: ``[{"name", "built": n, "cached": n, "not_needed": n,
    "failed": n, "seconds": the longest build}]`` (counts of nodes), in the order the ops were asked."""
    out: dict[str, dict[str, Any]] = {}
    for node in nodes:
        for check in node.get("checks") or []:
            for op in check.get("ops") or [] if check.get("name") == "ops" else []:
                row = out.setdefault(str(op.get("name")), {"name": str(op.get("name")), "built": 0, "cached": 0,
                                                           "not_needed": 0, "failed": 0, "seconds": 0.0})
                if op.get("status") in ("built", "cached", "not_needed", "failed"):
                    row[op["status"]] += 1
                row["seconds"] = max(row["seconds"], round(float(op.get("seconds") or 0.0), 3))
    return list(out.values())


def _ranks(ranks: Iterable[int]) -> str:
    """``0, 1, 2`` (at most ``_LISTED`` numbers, then how many more)."""
    ranks = list(ranks)
    text = ", ".join(map(str, ranks[:_LISTED]))
    return text + (f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else "")
