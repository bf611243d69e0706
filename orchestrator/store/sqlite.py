"""Durable job store: jobs, their attempts and their events, in one SQLite file.

The file lives under the state directory (``<state_dir>/orch.db``) and is opened in WAL
mode, so one controller writes while CLI commands and other controllers read. Every
state change goes through :meth:`Store.set_state`, which checks the move against
``orchestrator.store.TRANSITIONS`` and records it as an event in the same transaction.
A controller that restarts finds every job, attempt and event it wrote before.

Times are wall-clock seconds since the epoch (``float``), from an injectable clock.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import NotFoundError, StateError, StoreFullError
from .ledger import LEDGER_SCHEMA, CheckpointLedger
from .progress import PROGRESS_SCHEMA, ProgressSummaries
from .thinning import ProgressThinning
from .states import JobState, check_transition

__all__ = ["Store", "JobRecord", "AttemptRecord", "EventRecord"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    cause TEXT,
    owner TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    number INTEGER NOT NULL,
    state TEXT NOT NULL,
    plan TEXT NOT NULL,
    resume_tag TEXT,
    cause TEXT,
    created_at REAL NOT NULL,
    running_at REAL,
    ended_at REAL,
    stopped_at REAL,
    PRIMARY KEY (job_id, number)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    attempt INTEGER,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
-- what the job list shows of an attempt's plan (attempt_worlds), written with the attempt: hosts is a JSON list
CREATE TABLE IF NOT EXISTS attempt_worlds (
    job_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    world_size INTEGER,
    hosts TEXT NOT NULL,
    PRIMARY KEY (job_id, number)
);
-- the job list's order (list_jobs): a page reads its rows only, not every job (100k jobs: 0.5 s a page without)
CREATE INDEX IF NOT EXISTS jobs_newest ON jobs(created_at DESC, id);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, id);
CREATE TABLE IF NOT EXISTS progress (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    attempt INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS progress_job ON progress(job_id, attempt, id);
CREATE TABLE IF NOT EXISTS submit_keys (
    key TEXT PRIMARY KEY,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    at REAL NOT NULL
);
"""


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


@dataclass(frozen=True)
class JobRecord:
    """A job as stored.

    Attributes:
        id: the job id (``<name>-<6 hex digits>``).
        name: the spec's name.
        state: the job's state.
        spec: the validated spec as a JSON-able dict (paths absolute).
        attempt: number of the current (latest) attempt, 0 before the first.
        cause: why the latest attempt failed or was cancelled, as a dict, else None.
        owner: the controller running it (``{"pid":..., "host":..., "url":...}``) or None.
        cancel_requested: a cancel was asked for through the store.
        created_at, updated_at: epoch seconds.
    """

    id: str
    name: str
    state: JobState
    spec: dict
    attempt: int
    cause: dict | None
    owner: dict | None
    cancel_requested: bool
    created_at: float
    updated_at: float

    def to_dict(self) -> dict:
        """JSON-able form (state as its string)."""
        return {"id": self.id, "name": self.name, "state": self.state.value, "attempt": self.attempt,
                "cause": self.cause, "owner": self.owner, "cancel_requested": self.cancel_requested,
                "created_at": self.created_at, "updated_at": self.updated_at}


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a job.

    Attributes:
        job_id, number: which attempt (numbers start at 1).
        state: the attempt's own state (the job's state while it was current).
        plan: the attempt's JobPlan as a dict (``orchestrator.planning.JobPlan.to_dict``).
        resume_tag: the checkpoint tag it started from, or None for a fresh start.
        cause: why it ended, when it failed or was cancelled.
        created_at, running_at, ended_at, stopped_at: epoch seconds or None;
            ``ended_at`` is when it reached a terminal state, ``stopped_at`` when its
            last process was gone.
    """

    job_id: str
    number: int
    state: JobState
    plan: dict
    resume_tag: str | None
    cause: dict | None
    created_at: float
    running_at: float | None
    ended_at: float | None
    stopped_at: float | None

    def to_dict(self, with_plan: bool = False) -> dict:
        """JSON-able form; the (large) plan only when asked for, else its node list."""
        d = {"job_id": self.job_id, "number": self.number, "state": self.state.value,
             "resume_tag": self.resume_tag, "cause": self.cause, "created_at": self.created_at,
             "running_at": self.running_at, "ended_at": self.ended_at, "stopped_at": self.stopped_at,
             "nodes": [n["host"] for n in self.plan.get("nodes", [])],
             "world_size": self.plan.get("world_size"),
             "resume_universal_from": self.plan.get("resume_universal_from")}
        if with_plan:
            d["plan"] = self.plan
        return d


@dataclass(frozen=True)
class EventRecord:
    """One event: a state change, a rank exit, a message from an agent."""

    id: int
    job_id: str
    attempt: int | None
    at: float
    kind: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-able form."""
        return {"id": self.id, "job_id": self.job_id, "attempt": self.attempt, "at": self.at,
                "kind": self.kind, "data": self.data}


class Store(CheckpointLedger, ProgressSummaries, ProgressThinning):
    """The durable store. Thread-safe: one connection guarded by a lock.

    Example::

        store = Store(Path(state_dir) / "orch.db")
        store.create_job("demo-1a2b3c", "demo", spec_dict)
        store.set_state("demo-1a2b3c", JobState.PROVISIONING, attempt=1)

    Args:
        path: the database file; its directory is created if missing.
        clock: returns epoch seconds; injectable for tests.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                       timeout=30.0)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA + LEDGER_SCHEMA + PROGRESS_SCHEMA)
        except sqlite3.OperationalError as err:
            # on a full disk a schema update cannot be written: what is there still reads, and a write
            # raises StoreFullError (_Tx)
            if not is_full(err) or not hasattr(self, "_db") or not self._has_tables():
                raise self._unusable(err) from err
        except sqlite3.DatabaseError as err:  # not a database, or one orch cannot write
            raise self._unusable(err) from err

    def _unusable(self, err: BaseException) -> StateError:
        return StateError(f"Cannot use the state database {self.path}: {err}. It holds every job of this "
                          "state dir: if it is damaged, move it away (jobs and logs under jobs/ stay) or use "
                          "another --state-dir.")

    def _has_tables(self) -> bool:
        try:
            return self._db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('jobs', 'attempts', "
                                    "'events')").fetchone()[0] == 3
        except sqlite3.DatabaseError:
            return False

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    # -- transactions -------------------------------------------------------------------

    def _tx(self) -> "_Tx":
        return _Tx(self)

    # -- jobs -----------------------------------------------------------------------------

    def create_job(self, job_id: str, name: str, spec: dict, *, owner: dict | None = None,
                   key: str | None = None) -> JobRecord:
        """Insert a new job in PENDING and record a ``submitted`` event; ``key``: the submit's idempotency
        key, remembered with the job in the same transaction (:meth:`job_for_key`)."""
        now = self.clock()
        with self._tx() as db:
            db.execute("INSERT INTO jobs (id, name, state, spec, attempt, owner, created_at, updated_at)"
                       " VALUES (?, ?, ?, ?, 0, ?, ?, ?)",
                       (job_id, name, JobState.PENDING.value, _dump(spec), _dump(owner), now, now))
            if key is not None:
                db.execute("INSERT INTO submit_keys (key, job_id, at) VALUES (?, ?, ?)", (key, job_id, now))
            self._event(db, job_id, None, "submitted", {"name": name}, now)
        return self.get_job(job_id)

    def job_for_key(self, key: str) -> str | None:
        """The id of the job a submit with this idempotency key made, or None."""
        with self._lock:
            row = self._db.execute("SELECT job_id FROM submit_keys WHERE key = ?", (key,)).fetchone()
        return row["job_id"] if row else None

    def get_job(self, job_id: str) -> JobRecord:
        """Return the job with this id, or the only job whose id starts with it.

        Raises:
            NotFoundError: no job matches, or a prefix matches several (they are listed).
        """
        if not job_id.isprintable() or any("\ud800" <= c <= "\udfff" for c in job_id):  # (argv's undecodable bytes)
            raise NotFoundError(f"No job {job_id!r} in {self.path}; `orch list` shows the jobs.")
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                rows = self._db.execute("SELECT * FROM jobs WHERE id LIKE ? ESCAPE '\\' ORDER BY id",
                                        (_like_prefix(job_id),)).fetchall()
                if len(rows) == 1:
                    row = rows[0]
                elif len(rows) > 1:
                    ids = ", ".join(r["id"] for r in rows[:10])
                    raise NotFoundError(f"Job id '{job_id}' is ambiguous: it matches {ids}.")
        if row is None:
            raise NotFoundError(f"No job {job_id!r} in {self.path}; `orch list` shows the jobs.")
        return self._job(row)

    def list_jobs(self, limit: int = 100) -> list[JobRecord]:
        """Return up to ``limit`` jobs, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY created_at DESC, id LIMIT ?",
                                    (limit,)).fetchall()
        return [self._job(r) for r in rows]

    def active_jobs(self) -> list[JobRecord]:
        """Every job not in a terminal state, oldest first."""
        terminal = tuple(s.value for s in JobState if s.is_terminal())
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE state NOT IN (?, ?, ?) ORDER BY created_at",
                                    terminal).fetchall()
        return [self._job(r) for r in rows]

    def count_by_state(self) -> dict[str, int]:
        """``{state: number of jobs}`` for the states that have jobs."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}

    def set_state(self, job_id: str, new: JobState, *, cause: dict | None = None,
                  data: dict | None = None, queued: bool = False) -> JobRecord:
        """Move a job (and its current attempt) to ``new``; the one place state changes.

        ``queued``: the move ends an attempt still waiting for its nodes (a scheduler's queue), which has
        no attempt record yet: the job's last attempt is left as it is, the event goes under the next number.

        The move is checked with ``orchestrator.store.check_transition`` inside the same
        transaction that writes it, so two writers cannot both leave a state. Entering a
        terminal state sets the attempt's ``ended_at`` and ``cause``; entering RUNNING sets
        its ``running_at``.

        Raises:
            StateError: the move is illegal.
            NotFoundError: no such job.
        """
        new = JobState(new)
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT state, attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"No job {job_id!r}.")
            old = JobState(row["state"])
            check_transition(job_id, old, new)
            attempt = row["attempt"]
            db.execute("UPDATE jobs SET state = ?, cause = ?, updated_at = ?,"
                       " cancel_requested = CASE WHEN ? THEN 0 ELSE cancel_requested END WHERE id = ?",
                       (new.value, _dump(cause) if new.is_terminal() else None, now,
                        new == JobState.PENDING, job_id))
            if attempt and new != JobState.PENDING and not queued:
                db.execute("UPDATE attempts SET state = ? WHERE job_id = ? AND number = ?",
                           (new.value, job_id, attempt))
                if new == JobState.RUNNING:
                    db.execute("UPDATE attempts SET running_at = ? WHERE job_id = ? AND number = ?",
                               (now, job_id, attempt))
                if new.is_terminal():
                    db.execute("UPDATE attempts SET ended_at = ?, cause = ? WHERE job_id = ? AND number = ?",
                               (now, _dump(cause), job_id, attempt))
            # PENDING always announces the next attempt (resume); record it under that number
            ev_attempt = attempt + 1 if new == JobState.PENDING or queued else attempt
            self._event(db, job_id, ev_attempt or None, "state",
                        {"from": old.value, "to": new.value, "cause": cause, **(data or {})}, now)
        return self.get_job(job_id)

    def revise_cause(self, job_id: str, number: int, cause: dict) -> None:
        """Replace the recorded cause of a FAILED attempt (and of its job, while the attempt is
        the job's current one) once teardown found the root cause; the first one stays in the
        ``cause_revised`` event.

        Raises:
            StateError: the attempt has not ended.
        """
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT ended_at, cause FROM attempts WHERE job_id = ? AND number = ?",
                             (job_id, number)).fetchone()
            if row is None or row["ended_at"] is None:
                raise StateError(f"job {job_id} attempt {number} has not ended; its cause cannot be revised")
            db.execute("UPDATE attempts SET cause = ? WHERE job_id = ? AND number = ?",
                       (_dump(cause), job_id, number))
            db.execute("UPDATE jobs SET cause = ?, updated_at = ? WHERE id = ? AND attempt = ?",
                       (_dump(cause), now, job_id, number))
            self._event(db, job_id, number, "cause_revised", {"was": _load(row["cause"]), "cause": cause}, now)

    def update_spec(self, job_id: str, spec: dict, shown: dict | None = None) -> None:
        """Replace the job's spec (e.g. hosts excluded on resume); the ``spec_updated`` event records
        ``shown`` (the spec with its secrets masked), else the spec."""
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE jobs SET spec = ?, updated_at = ? WHERE id = ?", (_dump(spec), now, job_id))
            self._event(db, job_id, None, "spec_updated", {"spec": spec if shown is None else shown}, now)

    def set_owner(self, job_id: str, owner: dict | None) -> None:
        """Record which controller runs the job (None: nobody)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET owner = ? WHERE id = ?", (_dump(owner), job_id))

    def request_cancel(self, job_id: str) -> None:
        """Ask, through the store, the controller that owns the job to cancel it."""
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE jobs SET cancel_requested = 1, updated_at = ? WHERE id = ?", (now, job_id))
            self._event(db, job_id, None, "cancel_requested", {}, now)

    # -- attempts -------------------------------------------------------------------------

    def add_attempt(self, job_id: str, number: int, plan: dict, resume_tag: str | None) -> AttemptRecord:
        """Insert attempt ``number`` (its plan and start checkpoint) and make it current."""
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            db.execute("INSERT INTO attempts (job_id, number, state, plan, resume_tag, created_at)"
                       " VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, number, row["state"], _dump(plan), resume_tag, now))
            db.execute("UPDATE jobs SET attempt = ?, updated_at = ? WHERE id = ?", (number, now, job_id))
            db.execute("INSERT OR REPLACE INTO attempt_worlds (job_id, number, world_size, hosts) VALUES (?, ?, ?, ?)",
                       (job_id, number, plan.get("world_size"), json.dumps([n["host"] for n in plan.get("nodes", [])])))
            self._event(db, job_id, number, "attempt",
                        {"number": number, "resume_tag": resume_tag,
                         "nodes": [n["host"] for n in plan.get("nodes", [])]}, now)
        return self.get_attempt(job_id, number)

    def mark_stopped(self, job_id: str, number: int) -> None:
        """Record that every process of the attempt is gone."""
        now = self.clock()
        with self._tx() as db:
            db.execute("UPDATE attempts SET stopped_at = ? WHERE job_id = ? AND number = ?",
                       (now, job_id, number))
            self._event(db, job_id, number, "stopped", {}, now)

    def attempt_worlds(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[Any, list[str]]]:
        """``{(job id, attempt): (its plan's world_size, its nodes' hosts in node order)}`` for the attempts in
        ``keys``: the job list shows no more of a plan, and a plan of 4,096 x 8 is ~32 MiB of JSON (0.5 s to load).
        Read from the ``attempt_worlds`` rows :meth:`add_attempt` writes; an attempt of an older store without
        one, from its plan by SQLite's JSON functions. One query per 400 attempts."""
        out: dict[tuple[str, int], tuple[Any, list[str]]] = {}
        wanted = list(dict.fromkeys(keys))
        older = ("json_extract(plan, '$.world_size') AS world_size, (SELECT json_group_array(h) FROM (SELECT "
                 "json_extract(value, '$.host') AS h FROM json_each(plan, '$.nodes') ORDER BY key)) AS hosts")
        for table, columns in (("attempt_worlds", "world_size, hosts"), ("attempts", older)):
            wanted = [key for key in wanted if key not in out]
            for i in range(0, len(wanted), 400):
                chunk = wanted[i:i + 400]
                where = " OR ".join(["(job_id = ? AND number = ?)"] * len(chunk))
                with self._lock:
                    rows = self._db.execute(f"SELECT job_id, number, {columns} FROM {table} WHERE {where}",
                                            [v for key in chunk for v in key]).fetchall()
                out.update({(r["job_id"], r["number"]): (r["world_size"], json.loads(r["hosts"])) for r in rows})
        return out

    def get_attempt(self, job_id: str, number: int) -> AttemptRecord:
        """Return one attempt.

        Raises:
            NotFoundError: no such attempt.
        """
        with self._lock:
            row = self._db.execute("SELECT * FROM attempts WHERE job_id = ? AND number = ?",
                                   (job_id, number)).fetchone()
        if row is None:
            raise NotFoundError(f"Job {job_id} has no attempt {number}.")
        return self._attempt(row)

    def attempts(self, job_id: str) -> list[AttemptRecord]:
        """Return every attempt of a job, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM attempts WHERE job_id = ? ORDER BY number",
                                    (job_id,)).fetchall()
        return [self._attempt(r) for r in rows]

    # -- events ---------------------------------------------------------------------------

    def add_event(self, job_id: str, attempt: int | None, kind: str, data: dict | None = None) -> None:
        """Append an event (e.g. ``rank_exit``, ``agent_started``) to the job's history."""
        with self._tx() as db:
            self._event(db, job_id, attempt, kind, data or {}, self.clock())

    def events(self, job_id: str, since_id: int = 0, limit: int = 10_000) -> list[EventRecord]:
        """Return the job's events with id > ``since_id``, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id LIMIT ?",
                                    (job_id, since_id, limit)).fetchall()
        return [EventRecord(r["id"], r["job_id"], r["attempt"], r["at"], r["kind"], _load(r["data"]))
                for r in rows]

    # -- progress -------------------------------------------------------------------------

    def add_progress(self, job_id: str, attempt: int, points: list[tuple[int, dict]]) -> None:
        """Record reported steps, oldest first: ``[(global rank, point), ...]``; a point has
        ``step`` (int) and ``at`` (epoch seconds) and any of ``loss``, ``lr``,
        ``samples_per_second``, ``tokens_per_second``, ``step_seconds``, ``source``
        (see agents/metrics.py). Non-finite floats are kept as the strings "nan"/"inf". The attempt's
        progress row (:mod:`.progress`: its step, loss, step rate window) takes them in the same transaction, and
        older points are thinned there now and then (:mod:`.thinning`)."""
        rows, cleaned = [], []
        for rank, point in points:
            clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in point.items()}
            cleaned.append((int(rank), clean))
            rows.append((job_id, attempt, int(rank), int(point["step"]), float(point.get("at") or self.clock()),
                         json.dumps(clean, sort_keys=True)))
        with self._tx() as db:
            db.executemany("INSERT INTO progress (job_id, attempt, rank, step, at, data) VALUES (?, ?, ?, ?, ?, ?)",
                           rows)
            if cleaned:
                self._fold_progress(db, job_id, attempt, cleaned, self.clock())
                self._thin_after_insert(db, job_id, attempt, len(cleaned))

    def progress(self, job_id: str, attempt: int, since_id: int = 0, limit: int = 100_000) -> list[dict]:
        """The attempt's recorded points with id > ``since_id``, oldest first: dicts with ``id``,
        ``rank``, ``step``, ``at`` and the point's other fields."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM progress WHERE job_id = ? AND attempt = ? AND id > ? "
                                    "ORDER BY id LIMIT ?", (job_id, attempt, since_id, limit)).fetchall()
        return [{**json.loads(r["data"]), "id": r["id"], "rank": r["rank"], "step": r["step"], "at": r["at"]}
                for r in rows]

    def latest_progress(self, job_id: str, attempt: int) -> dict[int, dict]:
        """``{global rank: its newest point}`` of an attempt."""
        with self._lock:
            rows = self._db.execute("SELECT p.* FROM progress p JOIN (SELECT rank, MAX(id) AS id FROM progress "
                                    "WHERE job_id = ? AND attempt = ? GROUP BY rank) m ON p.id = m.id",
                                    (job_id, attempt)).fetchall()
        return {r["rank"]: {**json.loads(r["data"]), "id": r["id"], "rank": r["rank"], "step": r["step"],
                            "at": r["at"]} for r in rows}

    # -- helpers --------------------------------------------------------------------------

    @staticmethod
    def _event(db: sqlite3.Connection, job_id: str, attempt: int | None, kind: str, data: dict,
               at: float) -> None:
        db.execute("INSERT INTO events (job_id, attempt, at, kind, data) VALUES (?, ?, ?, ?, ?)",
                   (job_id, attempt, at, kind, json.dumps(data, sort_keys=True)))

    @staticmethod
    def _job(row: sqlite3.Row) -> JobRecord:
        return JobRecord(row["id"], row["name"], JobState(row["state"]), _load(row["spec"]), row["attempt"],
                         _load(row["cause"]), _load(row["owner"]), bool(row["cancel_requested"]),
                         row["created_at"], row["updated_at"])

    @staticmethod
    def _attempt(row: sqlite3.Row) -> AttemptRecord:
        return AttemptRecord(row["job_id"], row["number"], JobState(row["state"]), _load(row["plan"]),
                             row["resume_tag"], _load(row["cause"]), row["created_at"], row["running_at"],
                             row["ended_at"], row["stopped_at"])


def _like_prefix(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


class _Tx:
    """``with store._tx() as db:`` runs the block in one IMMEDIATE transaction under the lock."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.store._db.execute("BEGIN IMMEDIATE")
        return self.store._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            try:
                self.store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            except sqlite3.OperationalError as err:
                if not is_full(err):
                    raise
                self.store._db.execute("ROLLBACK") if self.store._db.in_transaction else None
                raise full_error(self.store.path, err) from err
            if exc_type is not None and isinstance(exc, sqlite3.OperationalError) and is_full(exc):
                raise full_error(self.store.path, exc) from exc
        finally:
            self.store._lock.release()


def is_full(err: BaseException) -> bool:
    """Whether a database error is the disk refusing the write (full, or failing)."""
    text = str(err).lower()
    return "full" in text or "disk i/o error" in text or "no space" in text


def full_error(path: Path, err: BaseException) -> StoreFullError:
    """The error for a write the disk refused, naming the database and the free space left."""
    try:
        st = os.statvfs(path.parent)
        free = f"{st.f_bavail * st.f_frsize / (1 << 20):.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return StoreFullError(f"The state database {path} cannot be written: {err} ({free} on its file system). "
                          "Free space there; what was recorded is kept, reads work, and orch retries what it "
                          "could not record.")

