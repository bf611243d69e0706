"""The end of every attempt, whatever happened: stop every reachable agent's ranks, kill what does not
stop, sweep what is still marked with the attempt, and name the root cause when a lost node made
other ranks fail.

A lost node (its heartbeats stopped, or its link closed) is not waited for: its agent stops its own
ranks when the controller's pings stop reaching it (its lease), and its connection is dropped here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..planning import JobPlan
from ..provisioners import AgentHandle, Provisioner
from .watches import ENDED, HeartbeatWatch

__all__ = ["Teardown", "root_cause"]

#: Seconds a stopped agent has beyond the grace period before it is dropped.
STOP_SLACK_S = 5.0


class Teardown:
    """Stops one attempt's agents and what they run.

    Args:
        agents: node rank -> the agent's handle.
        node_state: node rank -> state; updated here (``lost``) and by ``drain`` (``stopped``, ``done``,
            ``gone``) while the agents stop.
        heartbeats: the attempt's heartbeat watch (who was heard from when).
        provisioner: started the agents; drops lost nodes, sweeps, closes.
        drain: reads and handles every message waiting from the agents, without waiting.
        clock: monotonic seconds.
        exits_known: whether every rank's exit is known (then no node is waited for after a failure).
        idle: node rank -> its agent's ``idle`` message (filled by ``drain``): the agent's attempt is over and it
            stays up for the next (``orchestrator.supervision.warm``), so its process is not waited for.
    """

    def __init__(self, agents: Mapping[int, AgentHandle], node_state: dict[int, str], heartbeats: HeartbeatWatch,
                 provisioner: Provisioner, drain: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic,
                 exits_known: Callable[[], bool] = lambda: False, idle: Mapping[int, dict] | None = None) -> None:
        self.agents = agents
        self.node_state = node_state
        self.heartbeats = heartbeats
        self.provisioner = provisioner
        self.drain = drain
        self.clock = clock
        self.exits_known = exits_known
        self.idle = idle if idle is not None else {}
        #: The wait for silent nodes after a failure, when there was one: ``{"nodes": [node ranks waited
        #: for], "seconds"}`` (the attempt records it as a ``silence_wait`` event); None when none was needed.
        self.silence_wait: dict[str, Any] | None = None
        self._live: dict[int, AgentHandle] = {}

    def stop(self, reason: str, grace_s: float, failed_at: float | None, kill: Collection[int] = ()) -> set[int]:
        """Tell every reachable agent to stop its ranks (SIGTERM, ``grace_s``, SIGKILL) and wait until it said
        ``stopped`` (or its process ended; at most ``grace_s`` + :data:`STOP_SLACK_S`); after a failure,
        unless every rank's exit is known already (``exits_known``), give nodes silent since it until the
        node timeout to speak: only a node whose ranks' fate is unknown is waited for. ``kill``: global
        ranks found hung (their stacks dumped), which their agents SIGKILL at once.

        Returns:
            Every lost node: lost before (``lost``/``gone``) or while stopping (silent past the node
            timeout); they are dropped from the provisioner.
        """
        lost = self._lost()
        for node_rank in lost & set(self.agents):
            self._tell_lost(self.agents[node_rank], reason)
            self.provisioner.forget(node_rank)
        self._live = {n: h for n, h in self.agents.items() if n not in lost}
        for node_rank, handle in self._live.items():
            if self.node_state[node_rank] not in ENDED:
                handle.send({"type": "stop", "reason": reason, **({"kill": sorted(kill)} if kill else {})})
        deadline = self.clock() + grace_s + STOP_SLACK_S
        for node_rank, handle in self._live.items():
            # "stopped" is the agent's last word (sent once its ranks and their leftovers are gone): its own
            # exit is not waited for ("done" is followed by its cleanup, which is; a warm agent then says "idle")
            while self.node_state[node_rank] != "stopped" and node_rank not in self.idle and not handle.wait(0.1) \
                    and self.clock() < deadline:
                self.drain()
                if node_rank in self._lost_while_stopping():
                    break
        self.drain()
        if failed_at is not None and not self.exits_known():
            self._await_silent(failed_at + self.heartbeats.heartbeat_s)
        newly_lost = self._lost_while_stopping()
        for node_rank in newly_lost:
            self.provisioner.forget(node_rank)
            self._live.pop(node_rank, None)
        return lost | newly_lost

    @staticmethod
    def _tell_lost(handle: AgentHandle, reason: str) -> None:
        """Send a lost node's agent ``stop`` anyway (0.5 s at most): should its link come back, the agent then
        stops its ranks instead of taking the link's end for its controller's death and awaiting a successor."""
        sender = threading.Thread(target=handle.send, args=({"type": "stop", "reason": reason},), daemon=True)
        sender.start()
        sender.join(0.5)

    def finish(self, plan: JobPlan, keep: Collection[int] = (), spare: Collection[int] = ()) -> list[int]:
        """Close every live agent's link (kill one that does not end in 0.5 s), sweep every process
        still marked with the attempt, close the provisioner; returns the swept pids. ``keep``: nodes whose agents
        stay up for the next attempt (not closed; their connections stay with the provisioner, which is then left
        open), ``spare``: their pids (and their templates'), which the sweep leaves alive."""
        live = {n: h for n, h in self._live.items() if n not in keep}
        for handle in live.values():
            handle.close()
        for handle in live.values():
            if not handle.wait(0.5):
                handle.kill()
        swept = self.provisioner.sweep(plan, spare=spare)
        if not keep:
            self.provisioner.close()
        else:
            for node_rank in set(self.agents) - set(keep):
                self.provisioner.forget(node_rank)
        return swept

    def _lost(self) -> set[int]:
        return {n for n, state in self.node_state.items() if state in ("lost", "gone")}

    def _lost_while_stopping(self) -> set[int]:
        """Marks nodes that went silent past the node timeout ``lost``; returns every lost node."""
        for node_rank in self.heartbeats.overdue(self.node_state):
            self.node_state[node_rank] = "lost"
        return self._lost()

    def _await_silent(self, since: float) -> None:
        """Give each node not heard from since ``since`` until the node timeout to speak; one that
        stays silent is lost. Costs nothing when every node answered; at most the node timeout. A wait
        that happened is kept in :attr:`silence_wait`."""
        started, waited = self.clock(), set()
        while True:
            self.drain()
            silent = self.heartbeats.silent_since(self.node_state, since)
            if not silent:
                break
            waited.update(silent)
            time.sleep(0.05)
        if waited:
            self.silence_wait = {"nodes": sorted(waited), "seconds": round(self.clock() - started, 3)}


def root_cause(cause: dict[str, Any], lost: set[int], heartbeats: HeartbeatWatch, failed_at: float,
               hosts: Mapping[int, str]) -> dict[str, Any] | None:
    """The lost node behind a rank's failure on *another* node, as the attempt's revised cause; or None.

    A killed node takes its ranks' sockets with it: the surviving ranks' collectives fail with a
    connection error at once, often before the node's silence reaches the node timeout. The rank that
    exited first is then a symptom: the cause becomes ``node_lost`` (the first lost node, by node rank)
    and keeps the rank's failure under ``"first_symptom"``. A node counts only if it fell silent no
    later than one heartbeat after the failure (a node lost later did not cause it).

    Args:
        cause: the attempt's recorded cause (only a ``rank_exit`` is revised).
        lost: every lost node (from :meth:`Teardown.stop`).
        heartbeats: when each node was last heard from.
        failed_at: when the attempt failed (monotonic seconds).
        hosts: node rank -> host.
    """
    if cause.get("kind") != "rank_exit":
        return None
    suspects = heartbeats.suspects(lost, failed_at, besides=cause.get("node_rank"))
    if not suspects:
        return None
    node_rank = suspects[0]
    silent = failed_at - heartbeats.last_heard.get(node_rank, failed_at)
    return {"kind": "node_lost", "node": hosts[node_rank], "node_rank": node_rank,
            "nodes": [hosts[n] for n in suspects],
            "message": f"node lost: the agent on {hosts[node_rank]} (node {node_rank}) fell silent "
                       f"and never answered again; {max(silent, 0.0):.1f} s later {cause.get('message')} "
                       "(a consequence)",
            "first_symptom": cause}
