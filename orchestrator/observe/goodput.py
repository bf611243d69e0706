"""Goodput of a job: its wall time split into what it was spent on, from what orch records (no I/O here).

A job's *wall time* runs from its submission (``JobRecord.created_at``) to its end (its last attempt's
``ended_at`` once the job is terminal; ``now`` while it is not). It is cut into the categories below, which add
up to it exactly: every boundary is clamped between the one before it and the wall's end, so the parts always
telescope to the whole (a clock that went back shortens a part to 0, never makes one negative).

Per attempt (numbers in order), with its *timeline*: every step any rank reported, each at the earliest time a
rank reported it (``at``, the rank's clock), times made non-decreasing with the step:

* ``queued``: job created -> its first attempt created (waiting for a scheduler's nodes, or a queue of orch's);
  a job with no attempt yet (or cancelled before one): all of it;
* ``startup``: attempt created -> its first step of any rank (provision, agents, preflight, rank start,
  imports, rendezvous, checkpoint load, the first step itself); an attempt that never reported a step: all of it;
* the *training span*, first step -> last step, split three ways:

  * ``checkpoint``: saves as orch sees them. A gap between two consecutive timeline points that contains the
    modification time of a file the checkpoint ledger recorded (``checkpoint_files.mtime_ns``) is a save gap; its
    save time is the gap less what its steps take typically (``typical_step_seconds`` x the steps it spans), at
    least 0. ``typical_step_seconds`` is the median of ``gap / steps`` over the attempt's gaps without a file
    write (over every gap when all have one). An estimate: a save that overlaps the next step's compute, or a
    write whose file was saved again later (its ledger row then holds the newer time), is not seen;
  * ``lost_work``: steps done and thrown away, their time: an attempt's steps above the step the attempts after
    it resumed from (the least resume step of every later attempt; a fresh start resumes from step 0), from the
    timeline's time at that step (interpolated between kept points; the first step's time if it is below the
    attempt's first step) to the attempt's last step, less the save gaps in it;
  * ``productive``: the rest of the span: training steps that were kept (a running or failed-last attempt's
    steps count as kept: nothing has thrown them away yet);

* after the last step (or after start-up when there was no step): ``failure_detection`` for a FAILED attempt
  (the crash itself, then orch noticing and ending the attempt), ``wind_down`` for any other ended attempt
  (SUCCEEDED: final saves, shutdown; CANCELLED: stopping), ``since_last_step`` for an attempt still running
  (its newest step -> now: the step in flight, or a stall);
* ``restart_gap``: an attempt's end -> the next attempt's creation (teardown, backoff, checkpoint choice and
  conversion, planning); a job waiting for its next attempt: its last attempt's end -> now.

``effective_ratio`` = productive / wall (0 for a zero wall); ``lost_steps``: the steps counted in lost_work.

A resume's step is the number its tag's name ends with (``step_40``, ``global_step40``; for a converted universal
checkpoint, the tag it was converted from); a name without one: the resumed attempt's first step - 1, else 0.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..store import AttemptRecord, JobRecord, JobState

__all__ = ["CATEGORIES", "Goodput", "compute_goodput", "tag_step", "timeline"]

#: Every category, in the order a job lives them.
CATEGORIES = ("queued", "startup", "productive", "checkpoint", "lost_work", "failure_detection", "wind_down",
              "since_last_step", "restart_gap")


@dataclass
class Goodput:
    """A job's goodput.

    Attributes:
        wall_seconds: submission -> end (or now).
        seconds: ``{category: seconds}`` for every one of :data:`CATEGORIES`; they add up to ``wall_seconds``.
        effective_ratio: ``productive / wall_seconds`` (0 when the wall is 0).
        lost_steps: steps done and later thrown away by resumes from an earlier step.
        typical_step_seconds: the median step time of the last attempt with steps (None: no two steps).
        checkpoint_saves: how many save gaps were found.
        start, end: the wall's ends (epoch seconds); running: the end is ``now``.
    """

    wall_seconds: float
    seconds: dict[str, float]
    effective_ratio: float
    lost_steps: int
    typical_step_seconds: float | None
    checkpoint_saves: int
    start: float
    end: float
    running: bool
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``percent`` is each category's share of the wall (0-100)."""
        wall = self.wall_seconds
        return {"wall_seconds": wall, "seconds": dict(self.seconds),
                "percent": {k: (100.0 * v / wall if wall > 0 else 0.0) for k, v in self.seconds.items()},
                "effective_ratio": self.effective_ratio, "lost_steps": self.lost_steps,
                "typical_step_seconds": self.typical_step_seconds, "checkpoint_saves": self.checkpoint_saves,
                "start": self.start, "end": self.end, "running": self.running, "attempts": list(self.attempts)}


def tag_step(tag: str | None) -> int | None:
    """The step a checkpoint tag names: the number its name ends with (``step_40`` -> 40), else None."""
    if not tag:
        return None
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else None


def timeline(points: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """``[(step, at), ...]`` by step from reported points (dicts with ``step`` and ``at``, any rank): each step
    at the earliest time a rank reported it, times made non-decreasing (a later step is never earlier)."""
    first: dict[int, float] = {}
    for p in points:
        step, at = int(p["step"]), float(p["at"])
        if step not in first or at < first[step]:
            first[step] = at
    out, latest = [], float("-inf")
    for step in sorted(first):
        latest = max(latest, first[step])
        out.append((step, latest))
    return out


def _at_step(line: list[tuple[int, float]], step: int) -> float:
    """The timeline's time at ``step``: interpolated between the points around it; its first time below it."""
    steps = [s for s, _ in line]
    i = bisect_right(steps, step)
    if i == 0:
        return line[0][1]
    if i == len(line) or steps[i - 1] == step:
        return line[i - 1][1]
    (s0, t0), (s1, t1) = line[i - 1], line[i]
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def _save_gaps(line: list[tuple[int, float]], writes: Sequence[float]) -> tuple[list[tuple[float, float, float]],
                                                                                 float | None]:
    """``([(gap start, gap end, save seconds)], typical step seconds)`` of a timeline and the sorted write times."""
    written, plain, every = [], [], []
    for (s0, t0), (s1, t1) in zip(line, line[1:]):
        i = bisect_right(writes, t0)
        per_step = (t1 - t0) / max(1, s1 - s0)
        every.append(per_step)
        if i < len(writes) and writes[i] <= t1:
            written.append((t0, t1, max(1, s1 - s0)))
        else:
            plain.append(per_step)
    typical = statistics.median(plain or every) if every else None
    saves = [(t0, t1, max(0.0, (t1 - t0) - (typical or 0.0) * n)) for t0, t1, n in written]
    return saves, typical


def _resume_step(attempt: AttemptRecord, line: list[tuple[int, float]]) -> int:
    """The step attempt ``attempt`` resumed from (module docstring); 0 for a fresh start."""
    if not attempt.resume_tag:
        return 0
    step = tag_step(attempt.plan.get("resume_universal_from") or attempt.resume_tag)
    if step is None:
        step = tag_step(attempt.resume_tag)
    if step is None:
        step = line[0][0] - 1 if line else 0
    return max(0, step)


class _Clock:
    """Adds up consecutive parts of ``[start, end]``: each boundary clamped to ``[the last one, end]``."""

    def __init__(self, start: float, end: float) -> None:
        self.at, self.end = start, end
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)

    def to(self, t: float | None, category: str) -> float:
        t = self.at if t is None else min(max(t, self.at), self.end)
        self.seconds[category] += t - self.at
        spent, self.at = t - self.at, t
        return spent


def compute_goodput(job: JobRecord, attempts: Sequence[AttemptRecord],
                    points: Mapping[int, Iterable[Mapping[str, Any]]], writes: Iterable[float],
                    now: float) -> Goodput:
    """The goodput of ``job`` (module docstring for each category's rule).

    Args:
        job: the job's record.
        attempts: its attempts, any order.
        points: ``{attempt number: its reported points}`` (``Store.progress`` dicts: ``step``, ``at``, any rank).
        writes: modification times (epoch seconds) of the checkpoint files the ledger recorded for the job.
        now: the clock (epoch seconds) for a job still going.
    """
    attempts = sorted(attempts, key=lambda a: a.number)
    lines = {a.number: timeline(points.get(a.number, ())) for a in attempts}
    terminal = job.state.is_terminal()
    end = (attempts[-1].ended_at if attempts and attempts[-1].ended_at is not None else job.updated_at) \
        if terminal else now
    end = max(end, job.created_at)
    clock = _Clock(job.created_at, end)
    write_times = sorted(writes)
    bounds = _kept_bounds(attempts, lines)
    lost_steps, saves, typical, rows = 0, 0, None, []
    clock.to(attempts[0].created_at if attempts else end, "queued")
    for i, a in enumerate(attempts):
        line = lines[a.number]
        row = {"number": a.number, "state": a.state.value, "resume_step": _resume_step(a, line),
               "first_step": line[0][0] if line else None, "last_step": line[-1][0] if line else None,
               "lost_steps": 0}
        if i:
            clock.to(a.created_at, "restart_gap")
        row["startup"] = clock.to(line[0][1] if line else a.ended_at, "startup")
        if line:
            gaps, step_s = _save_gaps(line, write_times)
            typical = step_s if step_s is not None else typical
            saves += sum(1 for g in gaps if g[2] > 0)
            lost_from = max(bounds[a.number], row["resume_step"])
            lost = max(0, line[-1][0] - lost_from)
            lost_steps += lost
            row["lost_steps"] = lost
            _split_span(clock, line, gaps, _at_step(line, lost_from) if lost else None)
        if a.ended_at is not None:
            clock.to(a.ended_at, "failure_detection" if a.state == JobState.FAILED else "wind_down")
        elif not terminal and i == len(attempts) - 1:
            clock.to(end, "since_last_step" if line else "startup")
        rows.append(row)
    clock.to(end, "restart_gap" if attempts else "queued")
    wall = end - job.created_at
    productive = clock.seconds["productive"]
    return Goodput(wall, clock.seconds, productive / wall if wall > 0 else 0.0, lost_steps, typical, saves,
                   job.created_at, end, not terminal, rows)


def _kept_bounds(attempts: Sequence[AttemptRecord], lines: Mapping[int, list[tuple[int, float]]]) -> dict[int, float]:
    """``{attempt number: the highest of its steps that was kept}``: the least resume step of the attempts after
    it (infinity for the last)."""
    bounds, bound = {}, float("inf")
    for a in reversed(attempts):
        bounds[a.number] = bound
        bound = min(bound, _resume_step(a, lines[a.number]))
    return bounds


def _split_span(clock: _Clock, line: list[tuple[int, float]], gaps: list[tuple[float, float, float]],
                lost_at: float | None) -> None:
    """Advance ``clock`` over the training span (first step -> last step): checkpoint, lost_work, productive."""
    start = clock.at
    stop = min(max(line[-1][1], start), clock.end)
    span = stop - start
    save = {"kept": 0.0, "lost": 0.0}
    for t0, t1, seconds in gaps:
        save["lost" if lost_at is not None and t0 >= lost_at else "kept"] += seconds
    cut = stop if lost_at is None else min(max(lost_at, start), stop)
    checkpoint = min(span, save["kept"] + save["lost"])
    lost = min(span - checkpoint, max(0.0, (stop - cut) - save["lost"]))
    clock.seconds["checkpoint"] += checkpoint
    clock.seconds["lost_work"] += lost
    clock.seconds["productive"] += span - checkpoint - lost
    clock.at = stop
