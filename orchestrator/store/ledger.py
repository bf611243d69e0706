"""The checkpoint ledger of the store: each job's checkpoint manifests (what the agents hashed,
``agents.manifest``) and the tags marked bad (a rank crashed loading them). A part of
:class:`~.sqlite.Store` (mixed in there); same file, same transactions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointLedger", "LEDGER_SCHEMA"]

LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoint_files (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    dir TEXT NOT NULL,
    tag TEXT NOT NULL,
    name TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    hash TEXT,
    mode TEXT NOT NULL,
    node_rank INTEGER,
    attempt INTEGER,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (job_id, dir, tag, name)
);
CREATE TABLE IF NOT EXISTS bad_checkpoints (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    dir TEXT NOT NULL,
    tag TEXT NOT NULL,
    reason TEXT NOT NULL,
    attempt INTEGER,
    at REAL NOT NULL,
    PRIMARY KEY (job_id, dir, tag)
);
"""


class CheckpointLedger:
    """Manifests and bad tags, per job and checkpoint directory (methods of the Store)."""

    def record_checkpoint_files(self, job_id: str, attempt: int, directory: str, node_rank: int | None,
                                files: list[dict[str, Any]]) -> None:
        """Record hashed checkpoint files: ``files`` are ``{"tag", "name", "size", "mtime_ns", "hash",
        "mode"}`` dicts (a ``checkpoint_files`` message's). A file recorded again replaces its row; a tag
        saved again by a later attempt loses its bad mark."""
        now = self.clock()
        rows = [(job_id, directory, f["tag"], f["name"], int(f["size"]), int(f["mtime_ns"]), f.get("hash"),
                 f.get("mode", "off"), node_rank, attempt, now) for f in files]
        with self._tx() as db:
            db.executemany("INSERT OR REPLACE INTO checkpoint_files (job_id, dir, tag, name, size, mtime_ns, hash, "
                           "mode, node_rank, attempt, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            for tag in {f["tag"] for f in files}:
                db.execute("DELETE FROM bad_checkpoints WHERE job_id = ? AND dir = ? AND tag = ? AND attempt < ?",
                           (job_id, directory, tag, attempt))

    def checkpoint_manifest(self, job_id: str, directory: str, tag: str) -> dict[str, dict[str, Any]]:
        """``{file name: {"size", "mtime_ns", "hash", "mode", "node_rank", "attempt"}}`` recorded for one tag."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoint_files WHERE job_id = ? AND dir = ? AND tag = ?",
                                    (job_id, directory, tag)).fetchall()
        return {r["name"]: {"size": r["size"], "mtime_ns": r["mtime_ns"], "hash": r["hash"], "mode": r["mode"],
                            "node_rank": r["node_rank"], "attempt": r["attempt"]} for r in rows}

    def manifest_tags(self, job_id: str, directory: str) -> dict[str, int]:
        """``{tag: number of files recorded}`` for a job's checkpoint directory."""
        with self._lock:
            rows = self._db.execute("SELECT tag, COUNT(*) AS n FROM checkpoint_files WHERE job_id = ? AND dir = ? "
                                    "GROUP BY tag", (job_id, directory)).fetchall()
        return {r["tag"]: r["n"] for r in rows}

    def forget_checkpoint_tags(self, job_id: str, directory: str, tags: list[str]) -> None:
        """Drop the manifests and bad marks of tags that were deleted (checkpoint retention, ``orch gc``)."""
        with self._tx() as db:
            for table in ("checkpoint_files", "bad_checkpoints"):
                db.executemany(f"DELETE FROM {table} WHERE job_id = ? AND dir = ? AND tag = ?",
                               [(job_id, directory, t) for t in tags])

    def mark_checkpoint_bad(self, job_id: str, attempt: int, directory: str, tag: str, reason: str) -> None:
        """Mark a tag bad (a rank of ``attempt`` crashed loading it): resumes skip it until it is saved again."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO bad_checkpoints (job_id, dir, tag, reason, attempt, at) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (job_id, directory, tag, reason, attempt, self.clock()))

    def bad_checkpoints(self, job_id: str, directory: str) -> dict[str, str]:
        """``{tag: why it is bad}`` for a job's checkpoint directory."""
        with self._lock:
            rows = self._db.execute("SELECT tag, reason FROM bad_checkpoints WHERE job_id = ? AND dir = ?",
                                    (job_id, directory)).fetchall()
        return {r["tag"]: r["reason"] for r in rows}
