"""Warm agents: after a failed attempt, the agents of healthy nodes (and their fork-server templates) stay up
for the restart, which links them to its plan instead of starting new ones (no connection, no hello, no
re-import of torch and DeepSpeed).

How it goes:

1. Each attempt's ``start`` tells the agents ``keep_warm_s`` (> 0 when the job has a restart policy and the
   provisioner can hand its agents on: :attr:`~orchestrator.provisioners.Provisioner.warm_capable`). An agent
   whose attempt ends as the controller expects (``stop``, or every rank exited) cleans up, says ``idle`` and
   waits that long for the next attempt (``agents.before.stay_warm``).
2. A failed attempt's teardown parks the nodes whose agent said ``idle`` in the controller's :class:`WarmPool`
   (their links stay open; their messages go to a private queue meanwhile, through their :class:`Relay`).
3. The restart's attempt takes them (:meth:`WarmPool.take`): every node of its plan on a parked host gets that agent
   (re-targeted to the new attempt's queue and node rank); other nodes get new agents as usual.
4. No restart (the policy says no, a cancel, a resume by hand, the controller closing) :meth:`releases
   <WarmPool.release>` them: their links close and the agents end; so does a pool entry ``keep_warm_s`` after it
   was parked (the agents would have ended by then anyway).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..provisioners import AgentHandle, Provisioner

__all__ = ["Relay", "WarmNode", "WarmSet", "WarmPool", "keep_warm_for", "adopt_warm", "parkable", "spare_pids"]


class Relay:
    """The queue an agent's link delivers to (its provisioner calls :meth:`put` with ``(tag, message)``): it
    forwards each message as ``(node rank, message)`` to the attempt that has the agent now.

    Args:
        target: the attempt's event queue.
        node_rank: the agent's node rank in that attempt.
    """

    def __init__(self, target: "queue.Queue[tuple[int, dict]]", node_rank: int) -> None:
        self._lock = threading.Lock()
        self.target = target
        self.node_rank = node_rank

    def put(self, item: tuple[Any, dict], block: bool = True, timeout: float | None = None) -> None:
        """Forward ``item``'s message (its tag is replaced by the node rank of now)."""
        with self._lock:
            self.target.put((self.node_rank, item[1]))

    def put_nowait(self, item: tuple[Any, dict]) -> None:
        """As :meth:`put`."""
        self.put(item)

    def retarget(self, target: "queue.Queue[tuple[int, dict]]", node_rank: int) -> None:
        """Deliver to ``target`` as ``node_rank`` from now on."""
        with self._lock:
            self.target, self.node_rank = target, node_rank


@dataclass
class WarmNode:
    """One parked agent: its host, link, relay, and what it said in ``idle`` (``pid``, ``template``: its fork-server
    template's pid or None)."""

    host: str
    handle: AgentHandle
    relay: Relay
    idle: dict[str, Any]
    inbox: "queue.Queue[tuple[int, dict]]" = field(default_factory=queue.Queue)

    def alive(self) -> bool:
        """Whether its link is still open (no end of stream came while it was parked)."""
        while True:
            try:
                _, msg = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if msg.get("type") == "eof":
                return False


@dataclass
class WarmSet:
    """A failed attempt's parked agents: the provisioner that started them (it holds their connections), the
    attempt that parked them, and when they expire (monotonic seconds)."""

    job_id: str
    attempt: int
    provisioner: Provisioner
    nodes: dict[str, WarmNode]
    expires: float


class WarmPool:
    """The controller's parked agents, by job (see the module docstring).

    Example::

        pool = WarmPool()
        pool.park("job-1", 1, provisioner, {host: WarmNode(...)}, keep_s=60)
        warm = pool.take("job-1", {"node1", "node2"})   # the restart's attempt: host -> WarmNode
        pool.release("job-1")              # no restart: links closed, agents gone
    """

    def __init__(self) -> None:
        self._sets: dict[str, WarmSet] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    def park(self, job_id: str, attempt: int, provisioner: Provisioner, nodes: dict[str, WarmNode],
             keep_s: float) -> None:
        """Keep ``nodes`` (host -> parked agent) of the job's failed ``attempt`` for ``keep_s`` seconds; their
        relays deliver to each node's own inbox meanwhile. A set parked before for the job is released."""
        for node in nodes.values():
            node.relay.retarget(node.inbox, node.relay.node_rank)
        with self._lock:
            old = self._sets.pop(job_id, None)
            self._sets[job_id] = WarmSet(job_id, attempt, provisioner, nodes, time.monotonic() + keep_s)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._expire, name="warm-agents", daemon=True)
                self._reaper.start()
        if old is not None:
            self._close(old)

    def take(self, job_id: str, hosts: set[str]) -> dict[str, WarmNode]:
        """The job's parked agents on ``hosts`` whose link is still open, for its next attempt (host -> node); their
        connections leave the provisioner that parked them (the attempt's own adopts them:
        :meth:`~orchestrator.provisioners.Provisioner.adopt`). The job's other parked agents are released."""
        with self._lock:
            warm = self._sets.pop(job_id, None)
        if warm is None:
            return {}
        taken = {h: n for h, n in warm.nodes.items() if h in hosts and n.alive()}
        for node in taken.values():
            warm.provisioner.detach(node.relay.node_rank)
        self._close(WarmSet(job_id, warm.attempt, warm.provisioner,
                            {h: n for h, n in warm.nodes.items() if h not in taken}, 0.0))
        return taken

    def hosts(self, job_id: str) -> list[str]:
        """The hosts whose agents are parked for the job now."""
        with self._lock:
            warm = self._sets.get(job_id)
            return sorted(warm.nodes) if warm else []

    def release(self, job_id: str) -> bool:
        """End the job's parked agents (their links close; an agent that does not end within 2 s is killed) and
        close their provisioner; False when none were parked."""
        with self._lock:
            warm = self._sets.pop(job_id, None)
        if warm is None:
            return False
        self._close(warm)
        return True

    def close(self) -> None:
        """Release every job's parked agents."""
        self._closed.set()
        with self._lock:
            sets, self._sets = list(self._sets.values()), {}
        for warm in sets:
            self._close(warm)

    @staticmethod
    def _close(warm: WarmSet, provisioner: bool = True) -> None:
        for node in warm.nodes.values():
            node.handle.close()
        for node in warm.nodes.values():
            if not node.handle.wait(2.0):
                node.handle.kill()
        if provisioner:
            for node in warm.nodes.values():
                warm.provisioner.forget(node.relay.node_rank)
            warm.provisioner.close()

    def _expire(self) -> None:
        while not self._closed.wait(1.0):
            now = time.monotonic()
            with self._lock:
                due = [j for j, w in self._sets.items() if w.expires <= now]
            for job_id in due:
                self.release(job_id)


def keep_warm_for(pool: WarmPool | None, spec: Any, plan: Any, provisioner: Provisioner, keep_s: float) -> float:
    """The ``keep_warm_s`` an attempt's agents get (0: they end with it): the controller's ``keep_s`` where it has
    a pool, the provisioner can hand agents on (:attr:`~orchestrator.provisioners.Provisioner.warm_capable`), the
    job's restart policy may restart it (``max_restarts`` > 0), and its ranks are started by the agents (not by a
    real launcher: ``launch_mode: native``)."""
    if pool is None or keep_s <= 0 or not provisioner.warm_capable or not spec.restart.max_restarts:
        return 0.0
    return 0.0 if any(n.native for n in plan.nodes) else keep_s


def adopt_warm(pool: WarmPool | None, job_id: str, plan: Any, provisioner: Provisioner,
               events: "queue.Queue[tuple[int, dict]]") -> dict[int, tuple[AgentHandle, Relay, dict]]:
    """The job's parked agents on the hosts of ``plan`` (a restart's), each linked to its node there: its relay
    delivers to ``events`` as that node's rank, ``provisioner`` adopts its connection. Returns node rank ->
    ``(handle, relay, idle message)``; nodes without a parked agent are not in it."""
    if pool is None:
        return {}
    taken = pool.take(job_id, {n.host for n in plan.nodes})
    out = {}
    for node in plan.nodes:
        warm = taken.pop(node.host, None)
        if warm is None:
            continue
        warm.relay.retarget(events, node.node_rank)
        provisioner.adopt(node.node_rank, warm.handle)
        out[node.node_rank] = (warm.handle, warm.relay, warm.idle)
    return out


def parkable(node_state: dict[int, str], idle: dict[int, dict], relays: dict[int, Relay],
             agents: dict[int, AgentHandle], hosts: dict[int, str]) -> dict[str, WarmNode]:
    """The nodes of an ended attempt whose agent can be parked: it stopped or finished as told, said ``idle``,
    its link delivers through a relay and its process still runs. Returns host -> :class:`WarmNode`."""
    out = {}
    for node_rank, msg in idle.items():
        handle = agents.get(node_rank)
        if node_state.get(node_rank) in ("stopped", "done") and node_rank in relays and handle is not None \
                and not handle.wait(0):
            out[hosts[node_rank]] = WarmNode(hosts[node_rank], handle, relays[node_rank], msg)
    return out


def spare_pids(nodes: dict[str, WarmNode]) -> list[int]:
    """The pids a sweep must leave alive: the parked agents and their templates."""
    return [int(p) for n in nodes.values() for p in (n.idle.get("pid"), n.idle.get("template")) if p]
