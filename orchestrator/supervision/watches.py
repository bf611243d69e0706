"""What an attempt watches between messages: each node's silence, and each rank's progress.

Both are plain state over a monotonic clock; the attempt (:mod:`.attempt`) feeds them what it hears
and acts on what they find. Neither sends, records or fails anything itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

__all__ = ["HeartbeatWatch", "ProgressWatch", "ENDED"]

#: Node states after which an agent is no longer expected to say anything.
ENDED = ("done", "stopped", "gone", "lost")


class HeartbeatWatch:
    """Node loss by silence: when each node's agent last said anything.

    A node is lost when its agent has been silent for ``node_timeout_s``. A gap of more than half
    that between two :meth:`check` calls is the controller's own stall (suspended, swapped out): the
    silence was its own, so every node's count starts again.

    Args:
        node_timeout_s: an agent's silence (seconds) after which its node counts as lost.
        heartbeat_s: how often agents speak (seconds); see :meth:`suspects`.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, node_timeout_s: float, heartbeat_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_timeout_s = node_timeout_s
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.last_heard: dict[int, float] = {}
        self._last_check = clock()

    def expect(self, node_ranks: Iterable[int]) -> None:
        """Start counting these nodes' silence now (they were just asked to speak)."""
        now = self.clock()
        for node_rank in node_ranks:
            self.last_heard[node_rank] = now

    def heard(self, node_rank: int) -> None:
        """The node's agent said something."""
        self.last_heard[node_rank] = self.clock()

    def check(self, node_state: Mapping[int, str], quiet: bool) -> tuple[int, float] | None:
        """The first node, in the order they were expected, silent past the node timeout: ``(node rank,
        seconds of silence)``; None when there is none, when the controller itself stalled since the
        last check, or unless ``quiet`` (no message is waiting to be read, and the attempt can still
        fail: a message not read yet is no sign of silence).

        Args:
            node_state: node rank -> state; nodes in an :data:`ENDED` state are not watched.
            quiet: whether silence counts now.
        """
        now = self.clock()
        stalled, self._last_check = now - self._last_check > self.node_timeout_s / 2, now
        if stalled:
            self.last_heard = {n: max(t, now) for n, t in self.last_heard.items()}
            return None
        if not quiet:
            return None
        for node_rank, heard in self.last_heard.items():
            if node_state[node_rank] not in ENDED and now - heard > self.node_timeout_s:
                return node_rank, now - heard
        return None

    def overdue(self, node_state: Mapping[int, str]) -> list[int]:
        """Nodes not ended whose silence has passed the node timeout (no stall allowance)."""
        now = self.clock()
        return [n for n, heard in self.last_heard.items()
                if node_state[n] not in ENDED and now - heard > self.node_timeout_s]

    def silent_since(self, node_state: Mapping[int, str], since: float) -> list[int]:
        """Nodes not ended, last heard no later than ``since``, whose silence has not yet reached the
        node timeout: the ones still to be waited for."""
        now = self.clock()
        return [n for n, state in node_state.items()
                if state not in ENDED and n in self.last_heard and self.last_heard[n] <= since
                and now - self.last_heard[n] <= self.node_timeout_s]

    def suspects(self, lost: Iterable[int], failed_at: float, besides: int | None) -> list[int]:
        """Lost nodes (other than ``besides``) that fell silent no later than one heartbeat after
        ``failed_at``, by node rank: the ones that may have caused that failure."""
        return sorted(n for n in lost if n != besides and self.last_heard.get(n, 0.0) <= failed_at + self.heartbeat_s)


class ProgressWatch:
    """Hang detection (the spec's ``hang_timeout``): every rank's last step and when it last moved.

    Armed by the attempt's first step on any rank (start-up: imports, the rendezvous, building ops,
    may take long and counts against no rank). A running rank whose step has not moved for
    ``hang_timeout`` seconds is stalled; the attempt then has every node dump its ranks' stacks and
    fails once all answered or :data:`STACKS_WAIT_S` passed.

    Args:
        hang_timeout: seconds without a new step, or None (never).
        run_dir: the attempt's run directory (where the stacks are written, for the message).
        clock: monotonic seconds (injectable for tests).
    """

    #: Longest wait for the nodes' stack dumps after a hang was found (seconds).
    STACKS_WAIT_S = 30.0

    def __init__(self, hang_timeout: float | None, run_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_timeout = hang_timeout
        self.run_dir = run_dir
        self.clock = clock
        self._steps: dict[int, tuple[int | None, float]] = {}  # rank -> (last step, when it last moved)
        self._hang: dict[str, Any] | None = None  # a detected hang, waiting for the stack dumps

    def watch(self, ranks: Iterable[int]) -> None:
        """Start watching these global ranks (the attempt is running)."""
        now = self.clock()
        self._steps = {r: (None, now) for r in ranks}

    def record(self, rows: Iterable[tuple[int, dict]]) -> None:
        """Take reported steps: ``(global rank, {"step": n, ...})``."""
        rows = list(rows)
        now = self.clock()
        if self._steps and all(v[0] is None for v in self._steps.values()):
            self._steps = {r: (None, now) for r in self._steps}  # the first step arms the watch
        for rank, point in rows:
            old = self._steps.get(rank)
            if old is not None and (old[0] is None or int(point["step"]) > old[0]):
                self._steps[rank] = (int(point["step"]), now)

    def stalled(self, exited: Collection[int]) -> dict[str, Any] | None:
        """The ``no_progress`` cause of a newly found hang (``ranks``, ``steps``, ``message``, an empty
        ``stacks``), or None: no timeout, not armed yet, a hang already found, or no rank stalled.

        Args:
            exited: global ranks that have exited (they are not watched).
        """
        timeout = self.hang_timeout
        if not timeout or not self._steps or self._hang is not None:
            return None
        if all(v[0] is None for v in self._steps.values()):
            return None
        now = self.clock()
        running = {r: v for r, v in self._steps.items() if r not in exited}
        stalled = {r: v for r, v in running.items() if now - v[1] > timeout}
        if not stalled:
            return None
        steps = {r: v[0] for r, v in running.items()}
        known = [s for s in steps.values() if s is not None]
        low = min(known) if known else None
        behind = sorted(r for r in stalled if steps[r] is None) or sorted(r for r in stalled if steps[r] == low)
        if None in (steps[r] for r in behind):
            what = (f"rank(s) {', '.join(str(r) for r in behind if steps[r] is None)} reported no step "
                    f"{timeout:g} s after the others started stepping")
        elif max(known) > low:
            what = (f"rank(s) {', '.join(map(str, behind))} stuck at step {low} for {timeout:g} s while others "
                    f"reached step {max(known)}")
        else:
            what = f"no rank passed step {low} for {timeout:g} s (rank(s) {', '.join(map(str, behind))})"
        run_logs = os.path.join(self.run_dir, "logs")
        return {"kind": "no_progress", "ranks": behind, "steps": {str(r): s for r, s in steps.items()},
                "message": f"no progress: {what}; stacks of every rank in {run_logs}/rank-<rank>.stacks.txt",
                "stacks": {}}

    def await_stacks(self, cause: dict[str, Any], nodes: Iterable[int]) -> None:
        """A hang was found (``cause`` from :meth:`stalled`); these nodes were asked for their stacks."""
        self._hang = {"cause": cause, "waiting": set(nodes), "deadline": self.clock() + self.STACKS_WAIT_S}

    def dumped(self, node_rank: int, msg: dict) -> None:
        """A node's ``dumped`` answer: its stack files (and errors) join the cause."""
        if self._hang is not None:
            self._hang["waiting"].discard(node_rank)
            self._hang["cause"]["stacks"].update(msg.get("files") or {})
            if msg.get("errors"):
                self._hang["cause"].setdefault("stack_errors", {}).update(msg["errors"])

    def due(self) -> dict[str, Any] | None:
        """The hang's cause once every node asked dumped its stacks (or the wait ran out), else None."""
        if self._hang is None or (self._hang["waiting"] and self.clock() <= self._hang["deadline"]):
            return None
        cause, self._hang = self._hang["cause"], None
        return cause
