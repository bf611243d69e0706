"""An attempt's first phase: one agent started on every node, and every agent's hello awaited.

No rank starts anywhere until every node's agent is up: a node that cannot be reached, refuses the
key or lacks the spec's Python is a failure of that node, with its reason, and the attempt fails
with ``provision_failed`` before any rank runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ProvisionError
from ..planning import JobPlan
from ..provisioners import AgentHandle, Provisioner
from .warm import Relay

__all__ = ["start_agents", "await_hellos", "provision_failure"]


def start_agents(provisioner: Provisioner, plan: JobPlan, events: "queue.Queue[tuple[int, dict]]",
                 cancelled: threading.Event, relays: dict[int, Relay] | None = None,
                 skip: Collection[int] = ()) -> tuple[dict[int, AgentHandle], dict[int, ProvisionError]]:
    """Start every node's agent in parallel (at most ``provisioner.max_parallel`` at once).

    Args:
        provisioner: starts one agent.
        plan: the attempt's plan (its nodes).
        events: where every agent's messages go, as ``(node rank, message)``.
        cancelled: set when the attempt is cancelled (nodes not started yet are skipped).
        relays: where given, each agent's link delivers through a :class:`~.warm.Relay` (node rank -> it, filled
            here), so a warm agent can be handed to the next attempt.
        skip: nodes not to start (their agents were kept warm).

    Returns:
        ``(agents, failures)``: node rank -> handle of each started agent; node rank -> the error of
        each node whose agent could not be started.
    """
    agents: dict[int, AgentHandle] = {}
    failures: dict[int, ProvisionError] = {}

    def start(node: Any) -> None:
        if cancelled.is_set():
            return
        sink: Any = events
        if relays is not None:
            sink = relays[node.node_rank] = Relay(events, node.node_rank)
        try:
            agents[node.node_rank] = provisioner.start_agent(node, plan, sink)
        except ProvisionError as err:
            failures[node.node_rank] = err

    workers = max(1, min(len(plan.nodes), getattr(provisioner, "max_parallel", 64)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="provision") as pool:
        list(pool.map(start, [n for n in plan.nodes if n.node_rank not in skip]))
    return agents, failures


def await_hellos(events: "queue.Queue[tuple[int, dict]]", agents: dict[int, AgentHandle], timeout_s: float,
                 cancelled: threading.Event,
                 on_hello: Callable[[int, dict], None]) -> tuple[dict[int, ProvisionError], set[int]]:
    """Wait until every agent said hello; an agent that ends or stays silent is a failure.

    Other messages that arrive meanwhile are dropped (agents send nothing else before their plan).

    Args:
        events: the agents' messages.
        agents: node rank -> handle, of every agent started.
        timeout_s: how long all of them have.
        cancelled: stop waiting when set.
        on_hello: called with ``(node rank, message)`` for each hello.

    Returns:
        ``(failures, gone)``: node rank -> the error of each failed node; the nodes whose agent ended.
    """
    waiting = set(agents)
    failures: dict[int, ProvisionError] = {}
    gone: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while waiting and not cancelled.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            for n in waiting:
                failures[n] = ProvisionError(f"its agent did not answer within {timeout_s:.0f} s"
                                             f"{detail(agents[n].diagnostics())}")
            break
        try:
            node_rank, msg = events.get(timeout=min(left, 0.1))
        except queue.Empty:
            continue
        if msg.get("type") == "hello":
            waiting.discard(node_rank)
            on_hello(node_rank, msg)
        elif msg.get("type") == "eof" and node_rank in waiting:
            waiting.discard(node_rank)
            gone.add(node_rank)
            failures[node_rank] = ProvisionError(f"its agent ended before it started"
                                                 f"{detail(agents[node_rank].diagnostics())}")
    return failures, gone


def provision_failure(failures: dict[int, ProvisionError], plan: JobPlan) -> dict[str, Any]:
    """The ``provision_failed`` cause: every failed node (host, node rank, its own reason) under ``nodes``,
    and, for people, one line per reason naming every node that failed for it (``lines``, with a
    ``summary``; ``message`` says both in one sentence)."""
    nodes = [{"node": plan.nodes[n].host, "node_rank": n, "reason": str(err)} for n, err in sorted(failures.items())]
    by_reason: dict[str, list[int]] = {}
    for n, err in sorted(failures.items()):
        by_reason.setdefault(err.reason, []).append(n)
    lines = [", ".join(f"{plan.nodes[n].host} (node {n})" for n in ranks) + f": {reason}"
             for reason, ranks in by_reason.items()]
    summary = (f"could not start the agent on {len(nodes)} of {len(plan.nodes)} node(s), so no rank was started")
    return {"kind": "provision_failed", "nodes": nodes, "node": nodes[0]["node"], "node_rank": nodes[0]["node_rank"],
            "lines": lines, "summary": summary, "message": f"{summary}: " + "; ".join(lines)}


def detail(text: str) -> str:
    """``": <text>"`` for a non-empty diagnostic (its last 500 characters, on one line), else ``""``."""
    text = " ".join(text.split())
    return f": {text[-500:]}" if text else ""
