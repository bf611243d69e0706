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
    """The deadlines of a running attempt's ranks: start-up to the first step, and the step watchdog.

    * **Start-up** (the spec's ``startup_timeout``): counted from RUNNING (every node started its
      ranks) to the attempt's first reported step on any rank: imports, the rendezvous, building ops.
    * **Hangs** (``hang_timeout``): a rank whose step has not moved for the timeout is stalled. A number
      watches every rank once any rank stepped (a rank with no step then counts as stalled); ``auto``
      watches each rank from its own first step, for ``max(floor_s, AUTO_FACTOR x the longest gap
      between two steps seen on any rank of this attempt)``; until a gap is seen, for
      ``max(floor_s, startup_timeout)``. A rank is not watched once it reported its
      final step (``report.step(..., final=True)``), and no rank is once any rank exited 0 (the job is
      finishing: ranks of one job end together).

    The controller's own stall (a gap of more than :data:`STALL_GAP_S` between two looks) moves every
    deadline by the gap, as :class:`HeartbeatWatch` does for node silence.

    An expiry has every node dump its ranks' stacks (:mod:`agents.stacks`); once all answered (or
    :data:`STACKS_WAIT_S` passed) :meth:`due` gives the verdict. A stalled rank whose main thread is
    exiting (past the script's main code) or saving a checkpoint is not hung: it is given
    ``max(timeout, GRACE_S)`` more, once when exiting, :data:`SAVE_GRACES` times when saving. Otherwise the
    cause names each stalled rank and what its main thread is stuck in.

    Args:
        hang_timeout: seconds, ``"auto"``, or None (no step watchdog).
        startup_timeout: seconds, or None (start-up is not timed).
        run_dir: the attempt's run directory (where the stacks are written, for the message).
        floor_s: the shortest ``auto`` timeout (seconds).
        clock: monotonic seconds (injectable for tests).
    """

    #: Longest wait for the nodes' stack dumps after an expiry (seconds).
    STACKS_WAIT_S = 30.0
    #: ``auto``: the timeout is this many times the longest step gap seen (never under the floor).
    AUTO_FACTOR = 10.0
    #: More time for a rank found exiting or saving instead of stuck (seconds; at least the timeout).
    GRACE_S = 300.0
    #: Times a rank found saving a checkpoint is given more time before a save that never ends is a hang.
    SAVE_GRACES = 3

    def __init__(self, hang_timeout: float | str | None, run_dir: str, startup_timeout: float | None = None,
                 floor_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_timeout = hang_timeout
        self.startup_timeout = startup_timeout
        self.floor_s = floor_s
        self.run_dir = run_dir
        self.clock = clock
        self._steps: dict[int, tuple[int | None, float]] = {}  # rank -> (last step, when it last moved)
        self._extra: dict[int, float] = {}  # rank -> seconds added to its deadline (found exiting/saving)
        self._graces: dict[int, dict[str, int]] = {}  # rank -> {"exiting": n, "saving": n} given
        self._done: set[int] = set()  # ranks not watched: final step reported
        self._totals: dict[int, int] = {}  # rank -> the step its run ends at, as it reported (total_steps)
        self._finishing = False  # a rank exited 0 ...
        self._finished_rank, self._finishing_since = -1, 0.0  # ... this one, then
        self._longest_gap = 0.0
        self._started = 0.0
        self._last_look: float | None = None
        self._hang: dict[str, Any] | None = None  # an expiry, waiting for the stack dumps

    @property
    def auto(self) -> bool:
        return self.hang_timeout == "auto"

    def timeout(self) -> float | None:
        """The step watchdog's timeout now (seconds): the spec's number, or ``auto``'s value; None: off."""
        if self.auto:  # before any gap is seen (DeepSpeed's rank 0 says step=0 at initialize, then step=10
            # only after steps_per_print steps), start-up's deadline still holds
            if not self._longest_gap:
                return max(self.floor_s, self.startup_timeout or 0.0)
            return max(self.floor_s, self.AUTO_FACTOR * self._longest_gap)
        return float(self.hang_timeout) if self.hang_timeout else None

    def watch(self, ranks: Iterable[int]) -> None:
        """Start watching these global ranks (the attempt is running): start-up is counted from now."""
        now = self._started = self.clock()
        self._steps = {r: (None, now) for r in ranks}

    def record(self, rows: Iterable[tuple[int, dict]]) -> None:
        """Take reported steps: ``(global rank, {"step": n, ...})`` (``"final"``: the rank's last)."""
        rows = list(rows)
        now = self.clock()
        if self._steps and all(v[0] is None for v in self._steps.values()):
            self._steps = {r: (None, now) for r in self._steps}  # the first step arms the watch
        for rank, point in rows:
            old = self._steps.get(rank)
            if old is not None and (old[0] is None or int(point["step"]) > old[0]):
                if old[0] is not None:
                    self._longest_gap = max(self._longest_gap, now - old[1])
                self._steps[rank] = (int(point["step"]), now)
                self._extra.pop(rank, None)
            if point.get("final"):
                self._done.add(rank)
            total = point.get("total_steps")  # (a number: the agent passes every value on as a float)
            if isinstance(total, (int, float)) and not isinstance(total, bool) and total == total:
                self._totals[rank] = int(total)

    def finished_at(self, rank: int) -> tuple[int, int | None] | None:
        """``(last step, total steps or None)`` of a rank that reported its last step (``final``, or a step at its
        ``total_steps``); None for a rank that did not (or reported no steps)."""
        step = self._steps.get(rank, (None, 0.0))[0]
        if step is None:
            return None
        total = self._totals.get(rank)
        if rank in self._done or (total is not None and step >= total):
            return step, total
        return None

    def ended(self, rank: int, returncode: int) -> None:
        """A rank exited; one that exited 0 means the job is finishing: no rank's steps are watched any
        more, but the others must exit within ``max(timeout, GRACE_S)`` of it."""
        if returncode == 0 and not self._finishing:
            self._finishing = True
            self._finished_rank, self._finishing_since = rank, self.clock()

    def stalled(self, exited: Collection[int]) -> dict[str, Any] | None:
        """The cause of a newly passed deadline, ``startup_timeout`` or ``no_progress`` (``ranks``, ``steps``,
        ``message``, an empty ``stacks``), or None: nothing timed, a verdict pending, none passed.

        Args:
            exited: global ranks that have exited (they are not watched).
        """
        now = self.clock()
        self._own_stall(now)
        if not self._steps or self._hang is not None:
            return None
        if self._finishing:
            return self._not_finishing(now, exited)
        running = {r: v for r, v in self._steps.items() if r not in exited}
        steps = {r: v[0] for r, v in self._steps.items()}
        if all(v[0] is None for v in self._steps.values()):
            late = self.startup_timeout and now - self._started > self.startup_timeout + self._extra.get(-1, 0.0)
            if not late or not running:
                return None
            return {"kind": "startup_timeout", "ranks": sorted(running), "steps": {str(r): None for r in steps},
                    "message": f"start-up: no rank reported a first step within {self.startup_timeout:g} s "
                               f"(startup_timeout){self._stacks_note()}", "stacks": {}}
        timeout = self.timeout()
        if not timeout:
            return None
        watched = {r: v for r, v in running.items() if r not in self._done and (v[0] is not None or not self.auto)}
        stalled = {r: v for r, v in watched.items() if now - v[1] > timeout + self._extra.get(r, 0.0)}
        if not stalled:
            return None
        known = [s for s in (steps[r] for r in watched) if s is not None]
        low = min(known) if known else None
        behind = sorted(r for r in stalled if steps[r] is None) or sorted(r for r in stalled if steps[r] == low)
        how = f"{timeout:g} s" + (" (hang_timeout auto)" if self.auto else "")
        if None in (steps[r] for r in behind):
            what = (f"rank(s) {', '.join(str(r) for r in behind if steps[r] is None)} reported no step "
                    f"{how} after the others started stepping")
        elif max(known) > low:
            what = f"rank(s) {', '.join(map(str, behind))} stuck at step {low} for {how} while others reached step {max(known)}"
        else:
            what = f"no rank passed step {low} for {how} (rank(s) {', '.join(map(str, behind))})"
        return {"kind": "no_progress", "ranks": behind, "steps": {str(r): steps[r] for r in running},
                "message": f"no progress: {what}{self._stacks_note()}", "stacks": {}}

    #: A gap between two looks longer than this is the controller's own stall (suspended, swapped out):
    #: the ranks' silence in it is not theirs, so every deadline moves by the gap (seconds).
    STALL_GAP_S = 2.0

    def _own_stall(self, now: float) -> None:
        last, self._last_look = self._last_look, now
        gap = now - last if last is not None else 0.0
        if gap <= self.STALL_GAP_S:
            return
        self._steps = {r: (step, moved + gap) for r, (step, moved) in self._steps.items()}
        self._started += gap
        self._finishing_since += gap
        if self._hang is not None:
            self._hang["deadline"] += gap

    def _not_finishing(self, now: float, exited: Collection[int]) -> dict[str, Any] | None:
        """Ranks still running ``max(timeout, GRACE_S)`` after one exited 0 (none with no watchdog)."""
        limit = max(self.timeout() or 0.0, self.GRACE_S)
        left = sorted(r for r in self._steps if r not in exited)
        if not self.timeout() or not left or now - self._finishing_since <= limit:
            return None
        return {"kind": "no_progress", "ranks": left, "steps": {str(r): v[0] for r, v in self._steps.items()},
                "finishing": True, "stacks": {},
                "message": f"no progress: rank(s) {', '.join(map(str, left))} still running {limit:g} s after rank "
                           f"{self._finished_rank} exited 0 (the ranks of a job finish together){self._stacks_note()}"}

    def _give_more(self, rank: int, seconds: float) -> None:
        """Move a rank's deadline (-1: start-up's, -2: the finishing ranks') to ``seconds`` from now."""
        now = self.clock()
        if rank == -2:
            self._finishing_since = now + seconds - max(self.timeout() or 0.0, self.GRACE_S)
        elif rank == -1:
            self._extra[-1] = now + seconds - self._started - (self.startup_timeout or 0.0)
        else:
            self._extra[rank] = now + seconds - self._steps[rank][1] - (self.timeout() or 0.0)

    def _stacks_note(self) -> str:
        return f"; stacks of every rank in {os.path.join(self.run_dir, 'logs')}/rank-<rank>.stacks.txt"

    def await_stacks(self, cause: dict[str, Any], nodes: Iterable[int]) -> None:
        """A deadline passed (``cause`` from :meth:`stalled`); these nodes were asked for their stacks."""
        self._hang = {"cause": cause, "waiting": set(nodes), "deadline": self.clock() + self.STACKS_WAIT_S,
                      "summaries": {}}

    def dumped(self, node_rank: int, msg: dict) -> None:
        """A node's ``dumped`` answer: its stack files, errors and per-rank summaries join the verdict."""
        if self._hang is not None:
            self._hang["waiting"].discard(node_rank)
            self._hang["cause"]["stacks"].update(msg.get("files") or {})
            self._hang["summaries"].update(msg.get("summaries") or {})
            if msg.get("errors"):
                self._hang["cause"].setdefault("stack_errors", {}).update(msg["errors"])

    def due(self) -> tuple[str, dict[str, Any]] | None:
        """The verdict once every node asked dumped its stacks (or the wait ran out), else None:
        ``("fail", cause)`` naming what each stalled rank is stuck in (``kill``: the ranks to SIGKILL at
        once), or ``("dismissed", {"ranks", "doing", "more_seconds"})`` when every stalled rank is exiting or
        saving (or a rank exited 0 meanwhile)."""
        if self._hang is None or (self._hang["waiting"] and self.clock() <= self._hang["deadline"]):
            return None
        hang, self._hang = self._hang, None
        cause, summaries = hang["cause"], hang["summaries"]
        if self._finishing and not cause.get("finishing"):
            return "dismissed", {"ranks": cause["ranks"], "doing": {}, "more_seconds": 0.0,
                                 "why": "a rank exited 0: the job is finishing"}
        kinds = {r: (summaries.get(str(r)) or {}).get("kind") for r in cause["ranks"]}
        more = max(self.timeout() or 0.0, self.GRACE_S)
        allowed = {"saving": self.SAVE_GRACES} if cause.get("finishing") else {"exiting": 1, "saving": self.SAVE_GRACES}
        if kinds and all(k in allowed and self._graces.get(r, {}).get(k, 0) < allowed[k] for r, k in kinds.items()):
            for r, k in kinds.items():
                self._graces.setdefault(r, {}).setdefault(k, 0)
                self._graces[r][k] += 1
                self._give_more(-2 if cause.get("finishing") else -1 if cause["kind"] == "startup_timeout" else r,
                                more)
            return "dismissed", {"ranks": cause["ranks"], "more_seconds": more,
                                 "doing": {str(r): (summaries.get(str(r)) or {}).get("doing") for r in kinds}}
        stuck = []
        for r in cause["ranks"][:8]:
            summary = summaries.get(str(r)) or {}
            words = summary.get("doing") or (f"in {summary['where']}" if summary.get("where") else None)
            if words and summary.get("doing") and summary.get("where"):
                words = f"{words}, at {summary['where']}"
            stuck.append(f"rank {r}: {words or 'stacks unknown'}")
        cause["stuck_in"] = {str(r): summaries.get(str(r)) for r in cause["ranks"] if summaries.get(str(r))}
        # SIGKILLed at once (no grace period): the named ranks and every rank its dump found stuck (in user
        # code, a collective, stopped by a signal), not one found exiting or saving (it gets SIGTERM and grace)
        cause["kill"] = sorted(set(cause["ranks"]) | {int(r) for r, s in summaries.items() if str(r).isdigit()
                                                      and (s or {}).get("kind") not in ("exiting", "saving")})
        head, _, tail = cause["message"].partition("; stacks of every rank")
        cause["message"] = f"{head} ({'; '.join(stuck)}); stacks of every rank{tail}"
        return "fail", cause
