"""Thinning of the ``progress`` table: recent points at full resolution, older ones downsampled, so a job
that reports every step for a month keeps a number of rows that grows with the logarithm of its steps.

For each rank of an attempt, a point's *age* is how many steps it is behind that rank's highest step:

* every point younger than :data:`RECENT_STEPS` is kept;
* an older one, of age in ``[RECENT_STEPS * 2**k, RECENT_STEPS * 2**(k+1))`` (level ``k``), is kept only if
  it is the first (lowest step, then lowest id) of its bucket: steps ``// (RECENT_STEPS * 2**k //``
  :data:`BUCKETS_PER_LEVEL` ``)``. Each level holds about :data:`BUCKETS_PER_LEVEL` buckets; buckets of
  level ``k + 1`` are unions of two of level ``k``, so a point kept as it ages was kept before;
* always kept: the rank's newest point (highest id), its first point (lowest id), and every point whose loss
  was not finite (stored as the text ``"nan"``, ``"inf"`` or ``"-inf"``: :meth:`Store.add_progress`).

So a rank keeps at most ``RECENT_STEPS + (BUCKETS_PER_LEVEL + 2) * (levels) + 2`` points besides the non-finite
ones, where ``levels = log2(steps / RECENT_STEPS) + 1`` (:func:`rank_bound`; one point a step): 2,124 points for a
million steps. Thinning runs inside :meth:`Store.add_progress`'s transaction once the attempt has received as
many points since its last pass as it kept then (at least :data:`MIN_PASS_POINTS`), so its cost per point
stays constant; :meth:`ProgressThinning.thin_progress` runs a pass at once. Readers are unaffected except
that old history is sparser: ``progress(since_id=...)`` still returns every newer point in order, and
``latest_progress`` every rank's newest point.
"""

from __future__ import annotations

import math
import sqlite3
from typing import Any, Iterable

__all__ = ["RECENT_STEPS", "BUCKETS_PER_LEVEL", "MIN_PASS_POINTS", "PASS_ROWS", "kept_ids", "rank_bound",
           "ProgressThinning"]

#: every point of a rank's newest this many steps is kept
RECENT_STEPS = 1000
#: older points: about this many kept per doubling of age
BUCKETS_PER_LEVEL = 100
#: a thinning pass runs after at least this many new points of an attempt (and at least as many as it kept)
MIN_PASS_POINTS = 2000
#: an attempt keeping more rows than this is thinned a part of its ranks per pass
PASS_ROWS = 50_000
#: ids deleted per statement
_CHUNK = 500


def rank_bound(steps: int) -> int:
    """The most points one rank keeps (besides those with a non-finite loss) after a pass, when its points
    span ``steps`` steps at one point per step at most."""
    levels = max(0, math.ceil(math.log2(max(steps, 1) / RECENT_STEPS)) + 1) if steps > RECENT_STEPS else 0
    return RECENT_STEPS + (BUCKETS_PER_LEVEL + 2) * levels + 2


def _bucket(age: int, step: int) -> tuple[int, int] | None:
    """``(level, bucket)`` of a point of ``age`` steps at ``step``; None for a recent point."""
    if age < RECENT_STEPS:
        return None
    level = (age // RECENT_STEPS).bit_length() - 1
    width = max(1, (RECENT_STEPS << level) // BUCKETS_PER_LEVEL)
    return level, step // width


def kept_ids(rows: Iterable[tuple[int, int, int, bool]]) -> set[int]:
    """The ids a pass keeps of an attempt's points ``(id, rank, step, loss not finite)`` (module docstring)."""
    by_rank: dict[int, list[tuple[int, int, bool]]] = {}
    for pid, rank, step, bad in rows:
        by_rank.setdefault(rank, []).append((pid, step, bad))
    keep: set[int] = set()
    for points in by_rank.values():
        top = max(step for _, step, _ in points)
        keep.add(min(pid for pid, _, _ in points))
        keep.add(max(pid for pid, _, _ in points))
        first_of: dict[tuple[int, int], tuple[int, int]] = {}
        for pid, step, bad in points:
            bucket = _bucket(top - step, step)
            if bucket is None or bad:
                keep.add(pid)
                continue
            seen = first_of.get(bucket)
            if seen is None or (step, pid) < seen:
                first_of[bucket] = (step, pid)
        keep.update(pid for _, pid in first_of.values())
    return keep


class ProgressThinning:
    """The ``progress`` table's thinning (methods of the Store)."""

    _db: sqlite3.Connection
    _lock: Any

    def _thin_after_insert(self, db: sqlite3.Connection, job_id: str, attempt: int, added: int) -> None:
        """Count ``added`` new points of the attempt and run a pass (inside the caller's transaction) once there
        are as many as the last passes kept, and at least :data:`MIN_PASS_POINTS`. An attempt that keeps more
        than :data:`PASS_ROWS` rows is thinned a part of its ranks at a time (``rank % parts``, in turn; parts
        only double, and a new count starts its turns anew), each after as many new points as that part keeps:
        the same work per point, without one long pass under the store's lock (a pass reads ~4 us a row here:
        1,000 ranks keep ~1.6M rows)."""
        pending: dict[tuple[str, int], list[int]] = self.__dict__.setdefault("_thin_pending", {})
        # [new points, rows kept (estimate), the next part's turn, parts]
        count = pending.setdefault((job_id, attempt), [0, 0, 0, 1])
        count[0] += added
        while count[1] > count[3] * PASS_ROWS:
            count[3], count[2] = count[3] * 2, 0
        parts = count[3]
        if count[0] >= max(MIN_PASS_POINTS, count[1] // parts):
            count[1] = self._thin(db, job_id, attempt, parts, count[2] % parts) * parts
            count[0], count[2] = 0, count[2] + 1

    def _thin(self, db: sqlite3.Connection, job_id: str, attempt: int, parts: int = 1, part: int = 0) -> int:
        """One pass over the attempt's points of the ranks ``r`` with ``r % parts == part``; returns how many
        rows it kept."""
        rows = db.execute("SELECT id, rank, step, json_type(data, '$.loss') = 'text' FROM progress WHERE job_id = ? "
                          "AND attempt = ? AND rank % ? = ?", (job_id, attempt, parts, part)).fetchall()
        keep = kept_ids((r[0], r[1], r[2], bool(r[3])) for r in rows)
        gone = [r[0] for r in rows if r[0] not in keep]
        for i in range(0, len(gone), _CHUNK):
            chunk = gone[i:i + _CHUNK]
            db.execute(f"DELETE FROM progress WHERE id IN ({','.join('?' * len(chunk))})", chunk)
        return len(keep)

    def thin_progress(self, job_id: str, attempt: int) -> int:
        """Thin the attempt's points now (module docstring); returns how many rows were removed."""
        with self._tx() as db:  # type: ignore[attr-defined]
            before = db.execute("SELECT COUNT(*) FROM progress WHERE job_id = ? AND attempt = ?",
                                (job_id, attempt)).fetchone()[0]
            return before - self._thin(db, job_id, attempt)
