"""A job's checkpoints as the faces show them (``orch status``, the dashboard, ``GET /api/jobs/{id}``):
every checkpoint found, which are complete, which are skipped and why, and which one the next resume
would use. Sizes are compared with the manifest here, contents are not hashed (``orch resume
--dry-run`` does that); a directory is looked at again at most every :data:`CACHE_S` seconds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..checkpoints.integrity import Choice, choose
from ..store import AttemptRecord, JobRecord, Store

__all__ = ["checkpoints_view", "job_choice", "resume_dir", "CACHE_S"]

#: Seconds a directory's view is reused (the dashboard polls every second).
CACHE_S = 5.0
_cache: dict[tuple[str, str], tuple[float, dict]] = {}
_cache_lock = threading.Lock()


def resume_dir(job: JobRecord, attempt: AttemptRecord | None) -> str | None:
    """Where the job's checkpoints are looked for, as its latest attempt's plan says (``resume_dir``; plans of
    an earlier orch have only ``checkpoint_dir``)."""
    if attempt is None:
        return None
    return attempt.plan.get("resume_dir") or attempt.plan.get("checkpoint_dir")


def job_choice(store: Store, job_id: str, root: str, fmt: str, contents: bool) -> Choice:
    """:func:`orchestrator.checkpoints.integrity.choose` over ``root`` with the job's recorded manifests and
    bad tags: what ``orch status`` shows (``contents`` False) and what a resume starts from (True).

    Raises:
        ValueError: an unknown format name.
    """
    return choose(root, fmt, manifest=lambda tag: store.checkpoint_manifest(job_id, root, tag),
                  bad=store.bad_checkpoints(job_id, root), contents=contents)


def _pruned(store: Store, job_id: str) -> dict[str, Any] | None:
    """The sum of the job's ``checkpoints_pruned`` events (``supervision/pruning.py``), or None."""
    events = [e.data for e in store.events(job_id) if e.kind == "checkpoints_pruned"]
    if not events:
        return None
    return {"tags": sum(len(d.get("tags") or ()) for d in events),
            "bytes": sum(int(d.get("bytes") or 0) for d in events),
            "keep_last": events[-1].get("keep_last"), "keep_every": events[-1].get("keep_every")}


def checkpoints_view(store: Store, job: JobRecord, attempt: AttemptRecord | None) -> dict[str, Any] | None:
    """``{"format", "format_reason", "dir", "next_resume", "checkpoints": [{tag, step, complete, problems,
    notes, checked, recorded_files}], "pruned", ...}`` for the job, or None before its first attempt; ``pruned``:
    what the spec's checkpoint retention deleted in all (``{"tags", "bytes", "keep_last", "keep_every"}``, from
    the ``checkpoints_pruned`` events), or None.

    ``next_resume`` is the tag the next resume would start from (None: none is complete and
    undamaged by size); its files' contents are checked by the resume itself."""
    root = resume_dir(job, attempt)
    if root is None:
        return None
    key, now = (job.id, root), time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit and now - hit[0] < CACHE_S:
            return hit[1]
    fmt = (job.spec.get("resume") or {}).get("format", "auto")
    try:
        choice = job_choice(store, job.id, root, fmt, contents=False)
    except ValueError as err:
        return {"dir": root, "error": str(err), "checkpoints": [], "next_resume": None}
    recorded = store.manifest_tags(job.id, root)
    view = choice.to_dict()
    view["next_resume"] = choice.chosen.tag if choice.chosen else None
    for c in view["checkpoints"]:
        c["recorded_files"] = recorded.get(c["tag"], 0)
    view["pruned"] = _pruned(store, job.id)
    with _cache_lock:
        _cache[key] = (now, view)
    return view
