"""Straggler detection: a rank whose per-step time stays above the other ranks' for a window of steps.

Pure state over the progress points an attempt hears (:meth:`StragglerWatch.record`); the attempt
(:mod:`.messages`) records what it returns as events (``straggler``, ``straggler_cleared``); the
metric, the API's flag and ``on_straggler: exclude_on_restart`` read those events
(:mod:`orchestrator.observe.stragglers`).

The signal. In synchronous data-parallel training every rank's wall step time is the slowest rank's:
the collectives of a step wait for the last rank to enter them, so the time between two reported
steps (``step_seconds``) is the same on every rank and names nobody. What differs is the time a rank
spends on its own work *before* it enters the step's collectives: a script that reports it
(``agents.report.step(..., compute_seconds=...)``, as examples/train_gpt.py does: the forward passes
of the step) gives the detector that; a script that does not is judged on ``step_seconds``, which
separates ranks only where they do not wait for each other every step.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..spec.straggler import StragglerOptions

__all__ = ["StragglerWatch", "signal_of"]


def signal_of(point: Mapping[str, Any]) -> tuple[str, float] | None:
    """The per-step time (seconds) of a progress point the detector judges, with its name:
    ``compute_seconds`` when the rank reports it, else ``step_seconds``; None when it has neither (or
    one that is not a finite number >= 0)."""
    for key in ("compute_seconds", "step_seconds"):
        value = point.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"):
            return key, float(value)
    return None


class _Rank:
    """One rank's recent per-step times and where it stands against the others."""

    def __init__(self, window: int) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.median: float | None = None    # of ``recent``, kept as it changes
        self.listed: float | None = None    # ``median`` as the last sorted list of every rank's holds it
        self.last_step = -1
        self.over_from: int | None = None   # the first step of the current run of steps over the threshold
        self.under_from: int | None = None  # (flagged) the first step of the current run within it
        self.flag: dict[str, Any] | None = None


class StragglerWatch:
    """Flags stragglers among an attempt's ranks (see the module docstring for the signal).

    A rank's step is *over* when its time exceeds ``(1 + threshold) * m`` and ``m + min_excess_seconds``,
    ``m`` being the median over the other ranks of each one's median of its last ``window_steps`` times.
    A rank is flagged once its steps were over for ``window_steps`` steps in a row (counted in step
    numbers, so points the agent thinned out still count), and unflagged after as many in a row that
    are not: one event per (rank, episode) each way.

    Args:
        options: the spec's ``straggler`` section.
        hosts: global rank -> (host, node rank), named in the events.
    """

    #: With more ranks than this, the sorted list of every rank's median is rebuilt at most every
    #: :data:`REBUILD_EVERY_S` (one sort of R values) instead of for every point: judging each of R ranks'
    #: points against the others' median by recomputing it made a step cost O(R^2) (1,000 ranks: ~10^6
    #: medians a step). Below it, the list is rebuilt whenever a median changed (exact).
    SMALL = 64
    REBUILD_EVERY_S = 0.5

    def __init__(self, options: StragglerOptions, hosts: Mapping[int, tuple[str, int]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.hosts = dict(hosts)
        self.ranks: dict[int, _Rank] = {}
        self._clock = clock
        self._sorted: list[float] = []     # every rank's ``listed`` median, sorted
        self._built_at = float("-inf")
        self._dirty = False

    def flagged(self) -> dict[int, dict[str, Any]]:
        """The ranks flagged now: global rank -> the data of its ``straggler`` event."""
        return {r: s.flag for r, s in self.ranks.items() if s.flag is not None}

    def _others_median(self, rank: int) -> float | None:
        """The median over the other ranks of each one's median: the sorted list of every rank's (rebuilt as
        :data:`SMALL` says) less one occurrence of this rank's own, in O(log R)."""
        now = self._clock()
        if self._dirty and (len(self.ranks) <= self.SMALL or now - self._built_at >= self.REBUILD_EVERY_S):
            for s in self.ranks.values():
                s.listed = s.median
            self._sorted = sorted(s.listed for s in self.ranks.values() if s.listed is not None)
            self._built_at, self._dirty = now, False
        own = self.ranks[rank].listed
        values, skip = self._sorted, (bisect.bisect_left(self._sorted, own) if own is not None else None)
        n = len(values) - (skip is not None)
        if n <= 0:
            return None

        def at(k: int) -> float:  # the k-th smallest of the others
            return values[k + 1] if skip is not None and k >= skip else values[k]
        half = n // 2
        return at(half) if n % 2 else (at(half - 1) + at(half)) / 2

    def record(self, rows: Iterable[tuple[int, Mapping[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        """Take reported points (``(global rank, point)``, a point with ``step`` and ``compute_seconds``
        or ``step_seconds``); returns the events they cause, ``[(kind, data)]`` with kind ``straggler``
        (a rank became one) or ``straggler_cleared`` (it no longer is); data: ``global_rank``, ``node``
        (host), ``node_rank``, ``step``, ``seconds`` (the rank's median over the window), ``median_seconds``
        (the others'), ``ratio``, ``signal``, ``threshold``, ``window_steps``."""
        out: list[tuple[str, dict[str, Any]]] = []
        if not self.options.enabled:
            return out
        for rank, point in rows:
            got, step = signal_of(point), point.get("step")
            if got is None or not isinstance(step, int):
                continue
            state = self.ranks.setdefault(rank, _Rank(self.options.window_steps))
            if step <= state.last_step:
                continue
            state.last_step = step
            state.recent.append(got[1])
            state.median, self._dirty = statistics.median(state.recent), True
            median = self._others_median(rank)
            if median is None:
                continue
            event = self._judge(rank, state, step, got, median)
            if event is not None:
                out.append(event)
        return out

    def _judge(self, rank: int, state: _Rank, step: int, got: tuple[str, float], median: float
               ) -> tuple[str, dict[str, Any]] | None:
        """Count the step over or within the threshold; the event when the rank's flag changes."""
        o, value = self.options, got[1]
        over = value > (1 + o.threshold) * median and value - median >= o.min_excess_seconds
        if over:
            state.under_from = None
            state.over_from = step if state.over_from is None else state.over_from
        else:
            state.over_from = None
            if state.flag is not None and state.under_from is None:
                state.under_from = step
        if state.flag is None and state.over_from is not None and step - state.over_from + 1 >= o.window_steps:
            state.flag = self._data(rank, step, got[0], median)
            return "straggler", state.flag
        if state.flag is not None and state.under_from is not None and step - state.under_from + 1 >= o.window_steps:
            state.flag, state.under_from = None, None
            return "straggler_cleared", self._data(rank, step, got[0], median)
        return None

    def _data(self, rank: int, step: int, signal: str, median: float) -> dict[str, Any]:
        mine = statistics.median(self.ranks[rank].recent)
        host, node_rank = self.hosts.get(rank, (None, None))
        return {"global_rank": rank, "node": host, "node_rank": node_rank, "step": step, "seconds": round(mine, 6),
                "median_seconds": round(median, 6), "ratio": round(mine / median, 3) if median > 0 else None,
                "signal": signal, "threshold": self.options.threshold, "window_steps": self.options.window_steps,
                "message": f"rank {rank} on {host} (node {node_rank}) is a straggler: {signal} {mine:.3f}s against "
                           f"the other ranks' median {median:.3f}s over {self.options.window_steps} steps"}
