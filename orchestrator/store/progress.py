"""Each attempt's progress in one row, kept as its steps are recorded: what the job list shows per job
(``orch list``, ``GET /api/jobs``, the dashboard's job list) without reading the attempt's points or logs.

A part of :class:`~.sqlite.Store` (mixed in there): :meth:`~.sqlite.Store.add_progress` folds every batch of
reported points into the attempt's row (:func:`fold`) in the same transaction, and
:meth:`ProgressSummaries.progress_summaries` reads a page of jobs' rows in one query on the primary key.

A row's ``data`` (JSON) holds:

* ``ranks``: ``{global rank: its newest step}``; ``step``: the least of them (the job is as far as its
  slowest rank: a straggler shows);
* ``loss``, ``loss_rank``, ``loss_step``: the newest loss of the lowest-numbered rank that reported one
  (rank 0's, when it reports losses), and the step it was reported with;
* ``total_steps``: the newest ``total_steps`` a rank reported (``agents.report.step(..., total_steps=N)``);
* ``at``: when the newest batch was recorded (the store's clock, the controller's);
* ``samples``: ``[[at, step], ...]``, oldest first, about one a second: the newest sample at least
  :data:`WINDOW_S` older than the newest one, and every later one; the step rate is read from them
  (``orchestrator.observe.progress``).
"""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any

__all__ = ["ProgressSummaries", "PROGRESS_SCHEMA", "WINDOW_S", "fold"]

# (no foreign key to jobs: a job's removal need not know of this table first; its rows go with the job's points)
PROGRESS_SCHEMA = """
CREATE TABLE IF NOT EXISTS progress_summary (
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, attempt)
);
"""

#: The window the step rate is measured over (seconds before the newest sample).
WINDOW_S = 30.0
#: Samples are kept this far apart (seconds) at least: a newer one replaces the newest until it is.
SAMPLE_GAP_S = 1.0
#: The most rows one query reads (SQLite's bound on a statement's variables is 32766).
_CHUNK = 400


def _total(value: Any) -> int | None:
    try:
        total = float(value)
    except (TypeError, ValueError):
        return None
    return int(total) if math.isfinite(total) and total > 0 else None


def fold(summary: dict[str, Any] | None, points: list[tuple[int, dict]], at: float) -> dict[str, Any]:
    """``summary`` (an attempt's row, or None for its first batch) with a batch of reported points, oldest
    first (``[(global rank, {"step": n, "loss": x, "total_steps": t, ...})]``), recorded at ``at``."""
    s = summary or {"ranks": {}, "samples": []}
    ranks: dict[str, int] = s["ranks"]
    for rank, point in points:
        ranks[str(rank)] = int(point["step"])
        if point.get("loss") is not None and (s.get("loss_rank") is None or rank <= s["loss_rank"]):
            s.update(loss=point["loss"], loss_rank=rank, loss_step=int(point["step"]))
        total = _total(point.get("total_steps"))
        if total is not None:
            s["total_steps"] = total
    if not ranks:
        return s
    step = min(ranks.values())
    samples: list[list[float]] = s["samples"]
    if samples and (step < samples[-1][1] or at < samples[-1][0]):
        samples.clear()  # the step counted down (a counter restarted) or the clock went back: measure anew
    if len(samples) >= 2 and samples[-1][0] - samples[-2][0] < SAMPLE_GAP_S:
        samples[-1] = [at, step]  # (the newest sample is provisional until it is a gap after the one before)
    else:
        samples.append([at, step])
    start = max((i for i, (t, _) in enumerate(samples) if t <= at - WINDOW_S), default=0)
    del samples[:start]
    s.update(step=step, at=at)
    return s


class ProgressSummaries:
    """The per-attempt progress rows (methods of the Store)."""

    _db: sqlite3.Connection
    _lock: Any

    def _fold_progress(self, db: sqlite3.Connection, job_id: str, attempt: int, points: list[tuple[int, dict]],
                       at: float) -> None:
        """Fold ``points`` into the attempt's row, inside the caller's transaction."""
        row = db.execute("SELECT data FROM progress_summary WHERE job_id = ? AND attempt = ?",
                         (job_id, attempt)).fetchone()
        summary = fold(json.loads(row["data"]) if row else None, points, at)
        db.execute("INSERT OR REPLACE INTO progress_summary (job_id, attempt, data) VALUES (?, ?, ?)",
                   (job_id, attempt, json.dumps(summary, sort_keys=True)))

    def progress_summaries(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], dict[str, Any]]:
        """``{(job id, attempt): its progress row}`` for the attempts in ``keys`` that recorded a step (one
        query on the primary key per 400 attempts)."""
        out: dict[tuple[str, int], dict[str, Any]] = {}
        wanted = list(dict.fromkeys(keys))
        for i in range(0, len(wanted), _CHUNK):
            chunk = wanted[i:i + _CHUNK]
            where = " OR ".join(["(job_id = ? AND attempt = ?)"] * len(chunk))
            with self._lock:
                rows = self._db.execute(f"SELECT * FROM progress_summary WHERE {where}",
                                        [v for key in chunk for v in key]).fetchall()
            for r in rows:
                out[(r["job_id"], r["attempt"])] = json.loads(r["data"])
        return out
