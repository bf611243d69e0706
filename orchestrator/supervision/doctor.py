"""``orch doctor``: start every node's agent as an attempt does, ask each node about its environment,
and judge the answers (:mod:`.doctor_verdict`). No rank is started and nothing is stored.

The agents are started by the job's provisioner (:func:`.provisioning.start_agents`, every hello
awaited), then, over the same links as an attempt's:

1. the preflight round (:class:`.preflight.PreflightRound`, both phases; the ``ops`` check, which may
   build DeepSpeed's ops for minutes, is skipped) and, at the same time, every node's ``doctor``
   ``report`` (:mod:`agents.doctor`: versions, accelerator, GPUs, free disk and memory);
2. node 0 listens on the master port (``listen``);
3. every other node connects to it (``connect``), and every node reads its clock (``clock``);
4. when every node reached the master port: node 0 closes its listener (``unlisten``) and every node
   runs a short all-reduce through the master port (``allreduce``; ``nccl`` on GPUs where every node's
   accelerator is ``cuda``, else ``gloo``), reporting its bus bandwidth, then the link tests in the same
   process group: every pair of nodes (ring neighbours only above 16 nodes) in rounds of disjoint pairs,
   each pair exchanging a buffer both ways, reporting GB/s per pair.

Every phase has the deadline ``timeout_s``: a node that has not answered by then fails that check,
named. The agents are then closed (end of stream: they exit), killed if they linger, and swept.

Example::

    run = DoctorRun(spec, plan, provisioner, timeout_s=120, progress=print)
    verdict = run.run()          # orchestrator.supervision.doctor_verdict.judge's dict
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..planning import JobPlan
from ..provisioners import AgentHandle, Provisioner
from ..spec import JobSpec
from .doctor_verdict import Limits, NodeAnswers, judge, pair_rounds
from .preflight import PreflightRound
from .prepare import rank_python
from .provisioning import await_hellos, start_agents

__all__ = ["DoctorRun", "CONNECT_TIMEOUT_S", "ALLREDUCE_BYTES", "PAIR_BYTES", "PAIR_ITERS", "collective_backend"]

#: Bytes each node all-reduces (float32), 5 times after a warm-up.
ALLREDUCE_BYTES = 4 << 20
#: Bytes each node of a pair sends the other (and receives) in a link test, :data:`PAIR_ITERS` times after a warm-up.
PAIR_BYTES, PAIR_ITERS = 4 << 20, 3
#: Seconds a node has to connect to the master port (``connect``), within the phase's deadline.
CONNECT_TIMEOUT_S = 5.0
_HEARTBEAT_S, _LEASE_S = 0.5, 15.0


class DoctorRun:
    """One ``orch doctor`` over a plan's nodes.

    Args:
        spec: the job's spec (the ranks' Python, which preflight checks apply).
        plan: the plan (nodes, master address and port, checkpoint dir); its master port should be
            reserved by the caller for the run's duration.
        provisioner: starts the agents (the spec's).
        timeout_s: the deadline of each phase (starting the agents, the checks, the master port).
        limits: what the verdict accepts (clock skew, free disk and memory); ``timeout_s`` is set from above.
        skip: checks reported as skipped, with the reason (``orch doctor HOSTFILE``: ``entrypoint``).
        progress: called with a dict of counts (``phase``, ``nodes``, ``up``, ``preflight``, ``reports``,
            ``port``, ``clock``) whenever one changes; for a live display.
    """

    def __init__(self, spec: JobSpec, plan: JobPlan, provisioner: Provisioner, *, timeout_s: float = 120.0,
                 limits: Limits | None = None, skip: dict[str, str] | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spec, self.plan, self.provisioner = spec, plan, provisioner
        self.timeout_s = timeout_s
        base = limits or Limits()
        self.limits = replace(base, timeout_s=timeout_s)
        self.skip = dict(skip or {})
        self._progress = progress
        self.events: "queue.Queue[tuple[int, dict]]" = queue.Queue()
        self.agents: dict[int, AgentHandle] = {}
        self.answers = {n.node_rank: NodeAnswers(n.node_rank, n.host, slots=max(1, len(n.slots)))
                        for n in plan.nodes}
        self.preflight: PreflightRound | None = None
        self._preflight_done = False
        self._clock_sent: dict[int, float] = {}
        self._last_ping = 0.0
        self._counts: dict[str, Any] = {}
        self._unlistened = False
        #: why the all-reduce did not run (None: it ran, or the run has not got there)
        self.allreduce_skipped: str | None = None
        #: the all-reduce's and link tests' backend (None: they did not run)
        self.backend: str | None = None

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Start the agents, ask every phase, close everything; returns the verdict
        (:func:`.doctor_verdict.judge`). Never raises for what a node answers (or does not)."""
        try:
            self._start()
            up = [n for n, a in self.answers.items() if a.down is None]
            if up:
                self._checks(up)
                self._master_port(up)
                self._allreduce(up)
        finally:
            self._close()
        skip = dict(self.skip)
        if self.allreduce_skipped:
            skip.setdefault("allreduce", self.allreduce_skipped)
            skip.setdefault("links", self.allreduce_skipped)
        return judge([self.answers[n.node_rank] for n in self.plan.nodes], self.limits, skip)

    def _start(self) -> None:
        self._show("starting agents")
        cancelled = threading.Event()
        self.agents, failures = start_agents(self.provisioner, self.plan, self.events, cancelled)
        for n, err in failures.items():
            self.answers[n].down = f"its agent could not be started: {err}"
        if self.agents:
            late, _gone = await_hellos(self.events, self.agents, self.timeout_s, cancelled,
                                       lambda n, _msg: self._show("starting agents"))
            for n, err in late.items():
                self.answers[n].down = f"its agent did not come up: {err}"
        self._show("agents up")

    def _checks(self, up: list[int]) -> None:
        """Phase 1: the preflight round and every node's report, at once."""
        pf = self.preflight = PreflightRound(self.spec, self.plan, rank_python(self.spec), timeout_s=self.timeout_s,
                                             heartbeat_s=_HEARTBEAT_S, lease_s=_LEASE_S)
        pf.skip["ops"] = "orch doctor does not build DeepSpeed's ops (a run's preflight does)"
        pf.ops, pf.ops_timeout_s, pf.deadline = [], 0.0, pf.started + self.timeout_s
        pf.waiting &= set(up)
        requests = pf.requests()
        common = {"type": "doctor", "heartbeat_s": _HEARTBEAT_S, "lease_s": _LEASE_S}
        for n in up:
            node = self.plan.nodes[n]
            self.agents[n].send({**common, "phase": "report", "node": node.to_dict(), "python": pf.python,
                                 "workdir": node.workdir, "checkpoint_dir": self.plan.checkpoint_dir,
                                 "timeout_s": round(self.timeout_s * 0.75, 3)})
            self.agents[n].send(requests[n])
        self._show("checking")
        self._wait(lambda: self._preflight_done and all(self.answers[n].report is not None for n in up), up)
        event, _cause = pf.verdict()
        for node in event["nodes"]:
            self.answers[node["node_rank"]].preflight = node["checks"]

    def _master_port(self, up: list[int]) -> None:
        """Phases 2 and 3: node 0 listens on the master port; every other node connects; every clock is read."""
        addr, port = self.plan.master_addr, self.plan.master_port
        common = {"type": "doctor", "heartbeat_s": _HEARTBEAT_S, "lease_s": _LEASE_S, "addr": addr, "port": port}
        node0 = self.answers.get(0)
        if node0 is not None and node0.down is None:
            self.agents[0].send({**common, "phase": "listen"})
            self._show("master port")
            self._wait(lambda: node0.port is not None, [0])
        listening = node0 is not None and node0.port is not None and node0.port.get("status") == "passed"
        timeout = min(CONNECT_TIMEOUT_S, self.timeout_s)
        for n in up:
            if n != 0 and listening:
                self.agents[n].send({**common, "phase": "connect", "timeout_s": timeout})
            self._clock_sent[n] = time.time()
            self.agents[n].send({**common, "phase": "clock"})
        self._wait(lambda: all(self.answers[n].clock is not None and (
            n == 0 or not listening or self.answers[n].port is not None) for n in up), up)

    def _allreduce(self, up: list[int]) -> None:
        """Phase 4: the all-reduce among every node through the master port (node 0's listener closed first), then
        the link tests (:func:`.doctor_verdict.pair_rounds`); only when every node is up and reached the master
        port. ``nccl`` on each node's first slot's GPU where every node's accelerator is ``cuda``, else ``gloo``."""
        blocked = [a for a in self.answers.values() if a.down is not None or a.port is None
                   or a.port.get("status") != "passed"]
        if blocked:
            named = ", ".join(a.host for a in blocked[:8]) + (" and more" if len(blocked) > 8 else "")
            self.allreduce_skipped = f"not every node reached the master port ({named})"
            return
        addr, port = self.plan.master_addr, self.plan.master_port
        common = {"type": "doctor", "heartbeat_s": _HEARTBEAT_S, "lease_s": _LEASE_S}
        self.agents[0].send({**common, "phase": "unlisten"})
        self._wait(lambda: self._unlistened, [0])
        self.backend = collective_backend([self.answers[n].report for n in up])
        self._show(f"all-reduce and link tests ({self.backend})")
        rounds, _scope = pair_rounds(len(self.plan.nodes))
        for n in up:
            node = self.plan.nodes[n]
            self.agents[n].send({**common, "phase": "allreduce", "addr": addr, "port": port, "rank": n,
                                 "world": len(self.plan.nodes), "bytes": ALLREDUCE_BYTES, "iters": 5,
                                 "rounds": rounds, "pair_bytes": PAIR_BYTES, "pair_iters": PAIR_ITERS,
                                 "backend": self.backend, "slot": node.slots[0] if node.slots else 0,
                                 "timeout_s": round(self.timeout_s * 0.9, 3), "python": rank_python(self.spec),
                                 "master": node.to_dict().get("master")})
        self._wait(lambda: all(self.answers[n].allreduce is not None for n in up), up)

    # -- messages -----------------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], nodes: list[int]) -> None:
        """Handle messages until ``done()`` or ``timeout_s`` passed (or every node of ``nodes`` is gone)."""
        deadline = time.monotonic() + self.timeout_s
        while not done() and time.monotonic() < deadline:
            if all(n not in self.agents for n in nodes):
                return
            self._ping()
            try:
                node_rank, msg = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(node_rank, msg)

    def _handle(self, n: int, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        a = self.answers.get(n)
        if a is None:
            return
        if kind == "doctor_result":
            phase = msg.get("phase")
            if phase == "report":
                a.report = dict(msg.get("report") or {})
            elif phase == "clock" and n in self._clock_sent:
                a.clock = (self._clock_sent[n], time.time(), float(msg.get("at") or 0.0))
            elif phase == "unlisten":
                self._unlistened = True
            elif phase == "allreduce":
                a.allreduce = {k: msg.get(k) for k in ("status", "detail", "result")}
            elif phase in ("listen", "connect"):
                a.port = {"status": msg.get("status"), "detail": msg.get("detail")}
        elif kind == "preflight_result" and self.preflight is not None:
            self._preflight_answer(n, msg)
        elif kind == "heartbeat" and self.preflight is not None and msg.get("preflight"):
            self.preflight.current[n] = msg["preflight"]
        elif kind == "eof" and n in self.agents:
            handle = self.agents.pop(n)
            why = f"its agent ended during the checks{_diagnostics(handle)}"
            if a.report is None:
                a.report = {"errors": [why]}
        self._show(self._counts.get("phase", ""))

    def _preflight_answer(self, n: int, msg: dict[str, Any]) -> None:
        pf = self.preflight
        assert pf is not None
        pf.record(n, msg)
        if not pf.phase_complete() or self._preflight_done:
            return
        if pf.phase == "check":
            for m, request in pf.list_requests().items():
                if m in self.agents:
                    self.agents[m].send(request)
            self._preflight_done = pf.phase == "done"
        else:
            self._preflight_done = True

    def _ping(self) -> None:
        now = time.monotonic()
        if now - self._last_ping >= _HEARTBEAT_S:
            self._last_ping = now
            for handle in list(self.agents.values()):
                handle.send({"type": "ping"})

    def _show(self, phase: str) -> None:
        if self._progress is None:
            return
        answers = self.answers.values()
        counts = {"phase": phase, "nodes": len(self.answers), "up": sum(1 for a in answers if a.down is None),
                  "reports": sum(1 for a in answers if a.report is not None),
                  "preflight": len(self.preflight.checks) if self.preflight is not None else 0,
                  "port": sum(1 for a in answers if a.port is not None),
                  "clock": sum(1 for a in answers if a.clock is not None),
                  "allreduce": sum(1 for a in answers if a.allreduce is not None)}
        if counts != self._counts:
            self._counts = counts
            self._progress(dict(counts))

    # -- the end ------------------------------------------------------------------------------

    def _close(self) -> None:
        """Close every link (the agents exit), kill what lingers, sweep; remove the preflight tokens."""
        handles = list(self.agents.values())
        for handle in handles:
            handle.close()

        def gone(handle: AgentHandle) -> None:
            if not handle.wait(5.0):
                handle.kill()
        if handles:
            with ThreadPoolExecutor(max_workers=min(32, len(handles))) as pool:
                list(pool.map(gone, handles))
        try:
            self.provisioner.sweep(self.plan)
        finally:
            self.provisioner.close()
            if self.preflight is not None:
                shutil.rmtree(self.preflight.shared_dir, ignore_errors=True)


def collective_backend(reports: list[dict[str, Any] | None]) -> str:
    """``nccl`` when every node's report names the ``cuda`` accelerator and at least one GPU, else ``gloo``."""
    cuda = [bool(r) and r.get("accelerator") == "cuda" and int(r.get("gpus") or 0) > 0 for r in reports]
    return "nccl" if cuda and all(cuda) else "gloo"


def _diagnostics(handle: AgentHandle) -> str:
    text = " ".join(handle.diagnostics().split())
    return f": {text[-300:]}" if text else ""
