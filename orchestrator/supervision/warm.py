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

Between jobs (an ``orch server --keep-warm S``: :attr:`WarmPool.share_s` > 0), every job's agents stay up the same
way when it ends (succeeded, failed for good or cancelled): :meth:`WarmPool.retire` moves them to a pool shared by
all jobs, keyed by :meth:`~orchestrator.provisioners.Provisioner.warm_key` (how the agent logs in, its interpreter)
and host, for ``S`` seconds. A later job's attempt takes the one on each of its hosts whose key is its own
(:meth:`WarmPool.take_shared`), its ranks forked from the template kept there when their imports match
(``agents.forkserver.ForkServer.serves``): no connection, no agent start, no import.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..provisioners import AgentHandle, Provisioner

__all__ = ["Relay", "WarmNode", "WarmSet", "WarmPool", "keep_warm_for", "adopt_warm", "parkable", "spare_pids",
           "WARM_RECORD"]

#: the file in the state directory that lists the agents kept for later jobs (``housekeeping.kept_pids``)
WARM_RECORD = "warm-agents.json"


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
    template's pid or None); once parked, the job that had it, its provisioner's :meth:`warm_key
    <orchestrator.provisioners.Provisioner.warm_key>` for its host (None: not shared between jobs) and when it stops
    waiting (monotonic seconds)."""

    host: str
    handle: AgentHandle
    relay: Relay
    idle: dict[str, Any]
    inbox: "queue.Queue[tuple[int, dict]]" = field(default_factory=queue.Queue)
    job_id: str = ""
    key: tuple | None = None
    until: float = 0.0

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
    """The controller's parked agents, by job, and (``share_s`` > 0) those of ended jobs, for any later job whose
    provisioner key and host match (see the module docstring).

    Args:
        share_s: how long an ended job's agents stay up for another job (seconds; 0: they end with their job).
        record: a file that lists the pids of the agents (and templates) kept for other jobs, with ``owner``,
            while there are any (JSON ``{"owner", "pids"}``; ``housekeeping.kept_pids`` reads it): ``orch gc``
            leaves them alone though the jobs they are marked with are over.
        owner: the controller's owner record (``{"pid", "host", "create_time"}``), written into ``record``.

    Example::

        pool = WarmPool(share_s=300)
        pool.park("job-1", 1, provisioner, {host: WarmNode(...)}, keep_s=60)
        warm = pool.take("job-1", {"node1", "node2"})   # the restart's attempt: host -> WarmNode
        pool.retire("job-1")               # no restart: shared (share_s > 0), else links closed, agents gone
        pool.take_shared({"node1": provisioner.warm_key("node1")}, "job2")  # another job's attempt
    """

    #: A shared agent is not handed out (and is ended) this many seconds before it would stop waiting by itself.
    MARGIN_S = 5.0
    #: How long a job's attempt waits for the agents of a job that just ended on its hosts (:meth:`expect`) to
    #: come back to the pool, at most (starting new ones takes longer), and how long such an expectation holds.
    WAIT_S, EXPECT_S = 5.0, 60.0

    def __init__(self, share_s: float = 0.0, record: Path | None = None, owner: dict | None = None) -> None:
        self.share_s = share_s
        self._record, self._owner = record, owner
        self._sets: dict[str, WarmSet] = {}
        self._shared: list[WarmNode] = []
        self._lent: dict[str, list[int]] = {}  # job id -> pids of the shared agents (and templates) it runs on now
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)
        self._incoming: dict[str, tuple[set[str], float]] = {}  # job id -> (hosts, until): see expect()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    def park(self, job_id: str, attempt: int, provisioner: Provisioner, nodes: dict[str, WarmNode],
             keep_s: float) -> None:
        """Keep ``nodes`` (host -> parked agent) of the job's ended ``attempt`` for ``keep_s`` seconds; their
        relays deliver to each node's own inbox meanwhile. A set parked before for the job is released; so is this
        one when the pool is closed."""
        now = time.monotonic()
        for node in nodes.values():
            node.relay.retarget(node.inbox, node.relay.node_rank)
            node.job_id, node.until = job_id, now + keep_s
            node.key = _key(provisioner, node.host) if self.share_s > 0 else None
        warm = WarmSet(job_id, attempt, provisioner, nodes, now + keep_s)
        if self._closed.is_set():
            return self._close(warm)
        with self._lock:
            old = self._sets.pop(job_id, None)
            self._sets[job_id] = warm
            self._start_reaper()
        if old is not None:
            self._close(old)

    def expect(self, job_id: str, hosts: set[str]) -> None:
        """The job has just ended (its state is recorded before its agents are stopped and parked): until they are
        retired or released (or :data:`EXPECT_S` passes), :meth:`take_shared` for any of ``hosts`` waits up to
        :data:`WAIT_S` for them, so that a job submitted as soon as the last one ended finds its agents."""
        if self.share_s > 0 and not self._closed.is_set():
            with self._lock:
                self._incoming[job_id] = (set(hosts), time.monotonic() + self.EXPECT_S)

    def _arrived(self, job_id: str) -> None:
        """The job's agents are in the pool or gone (called holding the lock)."""
        if self._incoming.pop(job_id, None) is not None:
            self._landed.notify_all()

    def _await(self, hosts: set[str]) -> None:
        """Wait (holding the lock, up to :data:`WAIT_S`) while agents of an ended job on ``hosts`` are on their way."""
        deadline = time.monotonic() + self.WAIT_S
        while (now := time.monotonic()) < deadline and not self._closed.is_set() and any(
                until > now and h & hosts for h, until in self._incoming.values()):
            self._landed.wait(min(deadline - now, 0.5))

    def take(self, job_id: str, hosts: set[str]) -> dict[str, WarmNode]:
        """The job's parked agents on ``hosts`` whose link is still open, for its next attempt (host -> node); their
        connections leave the provisioner that parked them (the attempt's own adopts them:
        :meth:`~orchestrator.provisioners.Provisioner.adopt`). The job's other parked agents are retired."""
        with self._lock:
            warm = self._sets.pop(job_id, None)
        if warm is None:
            return {}
        taken = {h: n for h, n in warm.nodes.items() if h in hosts and n.alive()}
        for node in taken.values():
            warm.provisioner.detach(node.relay.node_rank)
        self._retire(WarmSet(job_id, warm.attempt, warm.provisioner,
                             {h: n for h, n in warm.nodes.items() if h not in taken}, 0.0))
        return taken

    def take_shared(self, keys: dict[str, tuple | None], job_id: str) -> dict[str, WarmNode]:
        """For another job's attempt: one agent an ended job left on each host of ``keys`` (host -> the attempt's
        provisioner's :meth:`~orchestrator.provisioners.Provisioner.warm_key` there) with that very key, its link
        open and at least :data:`MARGIN_S` before it stops waiting. Returns host -> node (hosts without one are
        not in it). The taken agents' pids stay in the record, as run by ``job_id``, until that job's
        :meth:`retire` or :meth:`release`: their processes carry the ended job's attempt id, and ``orch gc`` would
        otherwise sweep them as that job's leftovers while ``job_id`` runs on them."""
        taken: dict[str, WarmNode] = {}
        dead: list[WarmNode] = []
        with self._lock:
            self._await({h for h, k in keys.items() if k is not None})
            now = time.monotonic()
            for node in list(self._shared):
                if node.host in taken or keys.get(node.host) is None or keys[node.host] != node.key:
                    continue
                self._shared.remove(node)
                if node.until - now > self.MARGIN_S and node.alive():
                    taken[node.host] = node
                else:
                    dead.append(node)
            if taken:
                self._lent.setdefault(job_id, []).extend(spare_pids(taken))
            if taken or dead:
                self._publish()
        for node in dead:
            _end(node)
        return taken

    def hosts(self, job_id: str) -> list[str]:
        """The hosts whose agents are parked for the job now."""
        with self._lock:
            warm = self._sets.get(job_id)
            return sorted(warm.nodes) if warm else []

    def shared(self) -> list[dict[str, Any]]:
        """The agents kept for any job: ``[{"host", "job_id", "pid", "template", "expires_in_s"}]``."""
        now = time.monotonic()
        with self._lock:
            return [{"host": n.host, "job_id": n.job_id, "pid": n.idle.get("pid"), "template": n.idle.get("template"),
                     "expires_in_s": round(max(0.0, n.until - self.MARGIN_S - now), 1)} for n in self._shared]

    def retire(self, job_id: str) -> bool:
        """No attempt of the job will take its parked agents: with :attr:`share_s` > 0 they are kept for other
        jobs (:meth:`take_shared`) for that long (no longer than they wait themselves), else released
        (:meth:`release`). False when none were parked."""
        with self._lock:
            warm = self._sets.pop(job_id, None)
        if warm is not None:
            self._retire(warm)  # (they are in the record as shared before they leave it as lent)
        with self._lock:
            self._arrived(job_id)
            self._lend_back(job_id)
        return warm is not None

    def release(self, job_id: str) -> bool:
        """End the job's parked agents (their links close; an agent that does not end within 2 s is killed) and
        close their provisioner; False when none were parked."""
        with self._lock:
            warm = self._sets.pop(job_id, None)
            self._arrived(job_id)
            self._lend_back(job_id)
        if warm is None:
            return False
        self._close(warm)
        return True

    def close(self) -> None:
        """Release every parked agent, every job's and the shared ones."""
        self._closed.set()
        with self._lock:
            sets, self._sets = list(self._sets.values()), {}
            shared, self._shared = self._shared, []
            self._lent.clear()
            self._publish()
            self._incoming.clear()
            self._landed.notify_all()
        for warm in sets:
            self._close(warm)
        for node in shared:
            _end(node)

    def _retire(self, warm: WarmSet) -> None:
        keep = {h: n for h, n in warm.nodes.items() if n.key is not None and self.share_s > 0 and n.alive()} \
            if not self._closed.is_set() else {}
        now = time.monotonic()
        for node in keep.values():
            warm.provisioner.detach(node.relay.node_rank)  # its connection now belongs to the node
            node.until = min(node.until, now + self.share_s)
        with self._lock:
            self._shared += keep.values()
            if keep:
                self._start_reaper()
                self._publish()
        self._close(WarmSet(warm.job_id, warm.attempt, warm.provisioner,
                            {h: n for h, n in warm.nodes.items() if h not in keep}, 0.0))

    def _lend_back(self, job_id: str) -> None:
        """The job no longer runs on the shared agents it took: their pids leave the record (called holding the
        lock; those it handed back are in it as shared by now)."""
        if self._lent.pop(job_id, None):
            self._publish()

    def _publish(self) -> None:
        """Write (or remove, with none kept) the record of the pids of the shared agents and of those a job took
        from them and runs on now (called holding the lock)."""
        if self._record is None:
            return
        pids = spare_pids({str(i): n for i, n in enumerate(self._shared)}) + \
            [p for lent in self._lent.values() for p in lent]
        try:
            if not pids:
                self._record.unlink(missing_ok=True)
                return
            tmp = self._record.with_name(self._record.name + ".tmp")
            tmp.write_text(json.dumps({"owner": self._owner, "pids": pids}))
            os.replace(tmp, self._record)
        except OSError:  # best effort: without it orch gc may end a kept agent early, which the next job survives
            pass

    def _start_reaper(self) -> None:
        if self._reaper is None:  # (called holding the lock)
            self._reaper = threading.Thread(target=self._expire, name="warm-agents", daemon=True)
            self._reaper.start()

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
                old = [n for n in self._shared if n.until - self.MARGIN_S <= now]
                self._shared = [n for n in self._shared if n not in old]
                if old:
                    self._publish()
            for job_id in due:
                self.retire(job_id)
            for node in old:
                _end(node)


def _key(provisioner: Provisioner, host: str) -> tuple | None:
    """``provisioner.warm_key(host)``, None where it cannot say (a host its config cannot look up)."""
    try:
        return provisioner.warm_key(host)
    except Exception:  # noqa: BLE001 - not shared then
        return None


def _end(node: WarmNode) -> None:
    """End a shared agent: its link closes (it ends), killed after 2 s; its connection (ssh) is closed."""
    node.handle.close()
    if not node.handle.wait(2.0):
        node.handle.kill()
    client = getattr(node.handle, "client", None)  # a connection the node owns since it left its provisioner
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


def keep_warm_for(pool: WarmPool | None, spec: Any, plan: Any, provisioner: Provisioner, keep_s: float) -> float:
    """The ``keep_warm_s`` an attempt's agents get (0: they end with it), where the provisioner can hand agents on
    (:attr:`~orchestrator.provisioners.Provisioner.warm_capable`) and the agents start the ranks (not a real
    launcher: ``launch_mode: native``): the pool's :attr:`~WarmPool.share_s` (kept for other jobs), or the
    controller's ``keep_s`` if longer and the job's restart policy may restart it (``max_restarts`` > 0)."""
    if pool is None or not provisioner.warm_capable or any(n.native for n in plan.nodes):
        return 0.0
    return max(keep_s if keep_s > 0 and spec.restart.max_restarts else 0.0, pool.share_s)


def adopt_warm(pool: WarmPool | None, job_id: str, plan: Any, provisioner: Provisioner,
               events: "queue.Queue[tuple[int, dict]]") -> dict[int, tuple[AgentHandle, Relay, WarmNode]]:
    """The parked agents on the hosts of ``plan`` (the job's own from its attempt before, else, with a shared
    pool, another job's whose :meth:`~orchestrator.provisioners.Provisioner.warm_key` matches), each linked to its
    node there: its relay delivers to ``events`` as that node's rank, ``provisioner`` adopts its connection.
    Returns node rank -> ``(handle, relay, parked node)``; nodes without a parked agent are not in it."""
    if pool is None:
        return {}
    taken = pool.take(job_id, {n.host for n in plan.nodes})
    left = {n.host for n in plan.nodes} - set(taken)
    if left and pool.share_s > 0 and provisioner.warm_capable and not any(n.native for n in plan.nodes):
        taken.update(pool.take_shared({h: _key(provisioner, h) for h in left}, job_id))
    out = {}
    for node in plan.nodes:
        warm = taken.pop(node.host, None)
        if warm is None:
            continue
        warm.relay.retarget(events, node.node_rank)
        provisioner.adopt(node.node_rank, warm.handle)
        out[node.node_rank] = (warm.handle, warm.relay, warm)
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
