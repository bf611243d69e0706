"""The provisioner interface: start an agent for a node, talk to it, make sure it is gone."""

from __future__ import annotations

import collections
import queue
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import Any

from ..errors import ProvisionError
from ..planning import JobPlan, NodePlan, ResourcePool

__all__ = ["AgentHandle", "Provisioner"]


class AgentHandle(ABC):
    """The controller's side of one running agent.

    Messages from the agent arrive on the queue given to
    :meth:`Provisioner.start_agent` as ``(node_rank, message)`` pairs, ending with one
    ``{"type": "eof"}`` when the link closes.
    """

    node_rank: int
    host: str
    #: the agent's process id on its node, where known (a re-attached agent's, from its ``attached``)
    pid: int | None = None

    @abstractmethod
    def send(self, msg: dict[str, Any]) -> bool:
        """Send a message; False if the link is gone."""

    @abstractmethod
    def close(self) -> None:
        """Close the link; the agent sees end-of-stream and stops its ranks."""

    @abstractmethod
    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the agent to be gone; True if it is."""

    @abstractmethod
    def kill(self) -> None:
        """Kill the agent and everything it started, without grace."""

    def diagnostics(self) -> str:
        """What the agent wrote to its stderr lately (why it failed to start), or ``""``."""
        return ""


class Provisioner(ABC):
    """Starts agents. One instance serves one attempt.

    Attributes:
        name: the spec's ``provisioner`` value.
        max_parallel: how many agents are started at once.
        granted: the nodes were granted by a scheduler for this attempt alone (a restart asks again).
    """

    name: str
    max_parallel: int = 64
    #: the nodes were granted by a scheduler for this attempt alone (a restart asks for new ones)
    granted: bool = False
    #: a new controller can take over this provisioner's running agents (:meth:`attach_agent`)
    reattaches: bool = False
    #: its agents can stay up for the next attempt, which another instance then runs (:meth:`detach`,
    #: :meth:`adopt`; ``orchestrator.supervision.warm``)
    warm_capable: bool = False

    def check(self, pool: ResourcePool) -> None:
        """Refuse, before anything starts, nodes that cannot be reached (or placed) as configured.

        Raises:
            ProvisionError: naming every such host and why.
        """

    def plan_notes(self) -> tuple[str, ...]:
        """What this provisioner could not check while only looking (``orch plan``), for the plan's warnings."""
        return ()

    def discover(self) -> "collections.OrderedDict[str, int] | None":
        """The hosts and slots to use when the spec names no hostfile, or None (then: localhost)."""
        return None

    def master_addr(self, host: str) -> str:
        """The address the ranks rendezvous at when ``host`` is node 0 (no ``master_addr`` set)."""
        return "127.0.0.1"

    def close(self) -> None:
        """Release connections (and resources held for the attempt) once the attempt is over."""

    def needs_allocation(self) -> bool:
        """Whether each attempt must first be granted its nodes by a scheduler, and is planned only then
        (the slurm provisioner on a login node: ``allocate``)."""
        return False

    def forget(self, node_rank: int) -> None:
        """Drop a lost node's connection without waiting for it (it may never answer)."""

    def detach(self, node_rank: int) -> None:
        """Let go of the node's agent without closing anything: another attempt's provisioner :meth:`adopt`\\ s it
        (a warm agent: ``orchestrator.supervision.warm``)."""

    def adopt(self, node_rank: int, handle: AgentHandle) -> None:
        """Take on a running agent another instance started (and :meth:`detach`\\ ed), as node ``node_rank``: its
        connection is closed and its node swept with this provisioner's from now on."""

    def warm_key(self, host: str) -> tuple | None:
        """What an agent this provisioner starts on ``host`` depends on (how it is reached and logged in, the
        interpreter): a warm agent kept from another job serves this one's node on ``host`` only when the keys are
        equal (an ``orch server --keep-warm``: ``orchestrator.supervision.warm``). None: never shared."""
        return None

    def unavailable(self, hosts: "Sequence[str]") -> list[str]:
        """Those of ``hosts`` the scheduler has taken out of service (down, drained, failing), in the order given;
        [] when this provisioner has no scheduler to ask, or it did not answer. Used to name the node that was
        lost when the scheduler ends every step of an allocation at once."""
        return []

    @abstractmethod
    def start_agent(self, node: NodePlan, plan: JobPlan,
                    events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Start the agent of ``node``; its messages go to ``events``.

        Raises:
            ProvisionError: the agent could not be started (the message names the node).
        """

    def attach_agent(self, node: NodePlan, plan: JobPlan,
                     events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Link to the running agent of ``node`` that another controller started (``agents.attach``); the
        ``attach`` request is sent, and the agent's ``attached`` answer will arrive on ``events``.

        Raises:
            ProvisionError: this provisioner cannot re-attach, or no agent of the attempt listens there.
        """
        raise ProvisionError(f"the {self.name} provisioner cannot re-attach to running agents",
                             reason="cannot re-attach")

    def sweep(self, plan: JobPlan, spare: "Collection[int]" = ()) -> list[int]:
        """Last-resort cleanup once every agent is gone; returns pids it had to kill. ``spare``: pids of agents
        (and their templates) kept warm for the next attempt, not to be killed."""
        return []
