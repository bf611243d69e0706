"""What ``orch status``/``orch list``/``orch logs`` and the HTTP API show: built from the store.

The same functions serve the API and the CLI (which reads the store directly when no
server runs), so both print the same data. Rank status comes from the attempt's events;
training progress (step, loss) from the last lines of each rank's log that contain
``step=<int>`` and ``loss=<float>`` tokens (the form the example script prints; see
docs/contract.md). A job's own line (``orch list``, the job list) carries its step, loss,
steps/s and ETA from the attempt's progress row (:mod:`.progress`), never from its logs.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

from ..errors import NotFoundError
from ..spec.secrets import redact
from ..store import AttemptRecord, JobRecord, JobState, Store
from .checkpoints import checkpoints_view
from .goodput import compute_goodput
from .hints import next_steps
from .progress import progress_fields
from .stragglers import flagged_ranks

__all__ = ["job_summary", "job_list", "job_detail", "rank_rows", "node_rows", "read_log", "progress_of", "log_path",
           "ops_view", "ops_words", "goodput_view", "GOODPUT_CACHE_S"]

_STEP = re.compile(r"\bstep=(\d+)")
_LOSS = re.compile(r"\bloss=([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def job_summary(job: JobRecord, attempt: AttemptRecord | None = None, progress: dict[str, Any] | None = None,
                now: float | None = None, world: tuple[Any, list[str]] | None = None) -> dict[str, Any]:
    """One line's worth of a job: id, name, state, attempt, restarts, cause, times, world, and its current
    attempt's progress (``step``, ``loss``, ``steps_per_second``, ``eta_seconds``, ... from ``progress``, the
    attempt's progress row: :func:`.progress.progress_fields`; ``now``: the clock, default the time now).
    ``world``: the attempt's ``(world_size, hosts)`` (``Store.attempt_worlds``) in place of ``attempt``."""
    d = job.to_dict()
    d["restarts"] = max(0, job.attempt - 1)
    d["cause_message"] = (job.cause or {}).get("message")
    if attempt is not None:
        d["world_size"] = attempt.plan.get("world_size")
        d["nodes"] = [n["host"] for n in attempt.plan.get("nodes", [])]
    elif world is not None:
        d["world_size"], d["nodes"] = world[0], list(world[1])
    d.update(progress_fields(progress, job.state == JobState.RUNNING, time.time() if now is None else now))
    return d


def job_list(store: Store, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` jobs' summaries (:func:`job_summary`), newest first, with their progress: the
    page's progress rows and its attempts' world sizes and hosts are read in one query each (a few for a page
    over 400 jobs), not each attempt's whole plan."""
    jobs = store.list_jobs(limit)
    keys = [(j.id, j.attempt) for j in jobs if j.attempt]
    progress = store.progress_summaries(keys)
    worlds = store.attempt_worlds(keys)
    now = store.clock()  # the clock the progress rows were recorded on (the controller's)
    return [job_summary(j, None, progress.get((j.id, j.attempt)), now, worlds.get((j.id, j.attempt)) if j.attempt
                        else None) for j in jobs]


def log_path(plan: dict, global_rank: int) -> Path:
    """The log file of a rank in an attempt's plan."""
    return Path(plan["nodes"][0]["log_dir"]) / f"rank-{global_rank}.log"


def _tail_bytes(path: Path, nbytes: int = 16384) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def progress_of(lines: list[str]) -> dict[str, Any]:
    """The latest ``step`` and ``loss`` found in ``lines`` (newest last), and the last line."""
    out: dict[str, Any] = {"step": None, "loss": None, "last_line": lines[-1] if lines else None}
    for line in reversed(lines):
        m = _STEP.search(line)
        if m:
            out["step"] = int(m.group(1))
            lm = _LOSS.search(line)
            out["loss"] = float(lm.group(1)) if lm else None
            break
    return out


def rank_rows(store: Store, attempt: AttemptRecord) -> list[dict[str, Any]]:
    """Every rank of an attempt with its node, pid, state, exit and progress.

    A rank's state is ``pending``, ``running``, ``exited`` (status 0), ``failed`` (ended
    by itself with another status), ``stopped`` (ended because orch stopped the attempt)
    or ``not started``. Progress (``step``, ``loss``) is the newer of the rank's last
    ``[train]``-style log line and its last reported step (agents.report, or DeepSpeed's
    monitor for rank 0); ``progress_source`` says where reported metrics come from
    (``report``, ``deepspeed``), else ``log`` when only the log has steps; ``lr``,
    ``samples_per_second``, ``tokens_per_second``, ``step_seconds`` and ``reported_at`` come
    from reports only; ``started_at`` is when the rank started and ``progress_at`` when it last made
    progress (its last step, or its start before the first; Unix times, None before it started);
    ``straggler``: the data of the rank's ``straggler`` event while it is flagged as one, else None.
    """
    rows: dict[int, dict[str, Any]] = {}
    for node in attempt.plan.get("nodes", []):
        for r in node["ranks"]:
            rows[r["global_rank"]] = {"global_rank": r["global_rank"], "local_rank": r["local_rank"],
                                      "node_rank": node["node_rank"], "host": node["host"], "slot": r["slot"],
                                      "pid": None, "state": "pending", "returncode": None, "how": None,
                                      "started_at": None}
    for ev in store.events(attempt.job_id):
        if ev.attempt != attempt.number:
            continue
        if ev.kind == "ranks_started":
            for r in ev.data.get("ranks", []):
                row = rows.get(r["global_rank"])
                if row is not None:
                    row.update(pid=r.get("pid"), state="running", started_at=ev.at)
        elif ev.kind == "rank_exit":
            row = rows.get(ev.data["global_rank"])
            if row is not None and row["returncode"] is None:
                code = ev.data["returncode"]
                state = "exited" if code == 0 else "stopped" if ev.data.get("during_teardown") else "failed"
                row.update(state=state, returncode=code, how=ev.data.get("how"))
    if attempt.stopped_at is not None:
        for row in rows.values():
            if row["state"] in ("running", "pending"):
                row["state"] = "stopped" if row["state"] == "running" else "not started"
    reported = store.latest_progress(attempt.job_id, attempt.number)
    for rank, row in rows.items():
        row.update(progress_of(_tail_bytes(log_path(attempt.plan, rank))))
        row["loss"] = _float(row["loss"])
        row["progress_source"] = "log" if row["step"] is not None else None
        point = reported.get(rank)
        if point is not None:  # reported metrics (sent about once a second) name the source
            row["progress_source"] = point.get("source", "report")
            if row["step"] is None or point["step"] >= row["step"]:  # else the log line is newer
                row["step"] = point["step"]
                if point.get("loss") is not None:
                    row["loss"] = _float(point["loss"])
        row["reported_at"] = point["at"] if point else None
        row["progress_at"] = _progress_at(row, log_path(attempt.plan, rank))
        for key in ("lr", "samples_per_second", "tokens_per_second", "step_seconds"):
            row[key] = _float(point.get(key)) if point else None
    flagged = flagged_ranks(store.events(attempt.job_id), attempt.number)
    for rank, row in rows.items():
        row["straggler"] = flagged.get(rank)
    return [rows[k] for k in sorted(rows)]


def _progress_at(row: dict[str, Any], log: str) -> float | None:
    """When the rank last made progress (Unix time): its last reported step; for steps read from its log,
    the log's last write; with no step yet, when it started. None before it started."""
    if row["reported_at"] is not None:
        return row["reported_at"]
    if row["progress_source"] == "log":
        try:
            return os.path.getmtime(log)
        except OSError:
            return None
    return row.get("started_at")


def _float(value: Any) -> float | str | None:
    """A number for JSON: finite floats as they are, NaN and infinities as the strings "nan",
    "inf", "-inf" (JSON has no such numbers; a diverged loss must not read as missing)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


def node_rows(store: Store, attempt: AttemptRecord, cause: dict | None) -> list[dict[str, Any]]:
    """Every node of an attempt: host, node rank, agent state and its metrics port.

    The state is ``starting`` (agent not up yet), ``up`` (agent said hello, or was kept warm from the attempt
    before), ``running``
    (its ranks started), ``lost`` (named by a node-loss cause of the attempt),
    ``preflight_failed`` (named by a preflight failure of the attempt), or, once the attempt
    has stopped, ``ended``.
    """
    rows = {n["node_rank"]: {"node_rank": n["node_rank"], "host": n["host"], "state": "starting",
                             "ranks": [r["global_rank"] for r in n["ranks"]], "metrics_port": None}
            for n in attempt.plan.get("nodes", [])}
    for ev in store.events(attempt.job_id):
        if ev.attempt != attempt.number or ev.data.get("node_rank") not in rows:
            continue
        row = rows[ev.data["node_rank"]]
        if ev.kind in ("agent_up", "agent_kept"):  # started for it, or kept from the attempt before (warm)
            row["state"] = "up"
        elif ev.kind == "ranks_started":
            row.update(state="running", metrics_port=ev.data.get("metrics_port"))
    lost = set()
    for c in (cause or {}, (cause or {}).get("first_symptom") or {}):
        if c.get("kind") in ("node_lost", "gpu_fault"):  # a GPU's fatal error: the node is out, as a lost one
            lost.update(h for h in [c.get("node"), *(c.get("nodes") or [])] if h)
    unfit = set((cause or {}).get("nodes") or []) if (cause or {}).get("kind") == "preflight_failed" else set()
    for row in rows.values():
        if row["host"] in lost:
            row["state"] = "lost"
        elif row["host"] in unfit:
            row["state"] = "preflight_failed"
        elif attempt.stopped_at is not None:
            row["state"] = "ended"
    return [rows[k] for k in sorted(rows)]


def job_detail(store: Store, job_id: str) -> dict[str, Any]:
    """A job with all its attempts and, for the latest, every rank's status and progress.

    Raises:
        NotFoundError: no such job.
    """
    job = store.get_job(job_id)
    attempts = store.attempts(job.id)
    current = attempts[-1] if attempts else None
    d = job_summary(job, current, store.progress_summaries([(job.id, job.attempt)]).get((job.id, job.attempt)),
                    store.clock())
    d["spec"] = job.spec
    d["attempts"] = [a.to_dict() for a in attempts]
    if current is not None:
        d["master_addr"] = current.plan.get("master_addr")
        d["master_port"] = current.plan.get("master_port")
        d["run_dir"] = current.plan.get("run_dir")
        d["checkpoint_dir"] = current.plan.get("checkpoint_dir")
        d["ranks"] = rank_rows(store, current)
        d["node_states"] = node_rows(store, current, current.cause)
        d["checkpoints"] = checkpoints_view(store, job, current)
    else:
        d["ranks"] = []
        d["node_states"] = []
    d["goodput"] = goodput_view(store, job, attempts)
    d["allocation"] = allocation_view(store, job.id)
    d["ops"] = ops_view(store, job.id, job.attempt)
    d["agents_kept"] = kept_view(store, job.id, job.attempt)
    d["next_steps"] = next_steps(d)
    return redact(d, (job.spec or {}).get("secret_env") or ())  # secret-looking values: **** (docs/security.md)


#: Seconds a job's goodput is reused while the job is not terminal (``orch follow`` and the dashboard redraw it
#: every second); a terminal job's is kept until the job changes again.
GOODPUT_CACHE_S = 5.0
_goodput_cache: dict[tuple[str, str], tuple[float, float, dict[str, Any]]] = {}


def goodput_view(store: Store, job: JobRecord, attempts: list[AttemptRecord] | None = None) -> dict[str, Any]:
    """The job's goodput (:func:`.goodput.compute_goodput`, ``Goodput.to_dict``) from the store: every attempt's
    reported points and the modification times of the checkpoint files the ledger recorded for the job (in the
    directories its plans watch). Reused for :data:`GOODPUT_CACHE_S` seconds, a terminal job's while its
    ``updated_at`` stays the same."""
    now = store.clock()
    key = (str(store.path), job.id)
    hit = _goodput_cache.get(key)
    if hit is not None and hit[0] == job.updated_at and (job.state.is_terminal() or now - hit[1] < GOODPUT_CACHE_S):
        return hit[2]
    attempts = store.attempts(job.id) if attempts is None else attempts
    points = {a.number: _all_points(store, job.id, a.number) for a in attempts}
    view = compute_goodput(job, attempts, points, _write_times(store, job.id, attempts), now).to_dict()
    if len(_goodput_cache) > 256:
        _goodput_cache.clear()
    _goodput_cache[key] = (job.updated_at, now, view)
    return view


def _all_points(store: Store, job_id: str, attempt: int) -> list[dict[str, Any]]:
    """Every recorded point of an attempt (``Store.progress``, read a page at a time)."""
    out: list[dict[str, Any]] = []
    while True:
        page = store.progress(job_id, attempt, out[-1]["id"] if out else 0)
        out.extend(page)
        if len(page) < 100_000:
            return out


def _write_times(store: Store, job_id: str, attempts: list[AttemptRecord]) -> list[float]:
    """Modification times (epoch seconds) of the checkpoint files the ledger recorded for the job, in every
    directory its attempts' plans name (``checkpoint_dir``, ``resume_dir``, each node's ``checkpoint_watch``)."""
    dirs: set[str] = set()
    for a in attempts:
        dirs.update(d for d in (a.plan.get("checkpoint_dir"), a.plan.get("resume_dir")) if d)
        dirs.update(w["dir"] for w in [a.plan.get("checkpoint_watch"), *(n.get("checkpoint_watch") for n in
                                                                         a.plan.get("nodes", []))]
                    if isinstance(w, dict) and w.get("dir"))
    return [f["mtime_ns"] / 1e9 for d in sorted(dirs) for tag in store.manifest_tags(job_id, d)
            for f in store.checkpoint_manifest(job_id, d, tag).values()]


def allocation_view(store: Store, job_id: str) -> dict[str, Any] | None:
    """What a scheduler last said of the job's allocation (the slurm provisioner from a login node): the
    newest ``allocation`` event's data (``slurm_job``, ``state``, ``reason``, ``message``, ``attempt``), or None."""
    last = None
    for ev in store.events(job_id):
        if ev.kind == "allocation":
            last = {**ev.data, "attempt": ev.attempt}
    return last


def ops_view(store: Store, job_id: str, attempt: int) -> list[dict[str, Any]] | None:
    """The DeepSpeed ops the attempt's preflight built or found built (its ``preflight`` event's ``ops``:
    ``[{"name", "built", "cached", "not_needed", "failed": node counts, "seconds"}]``), or None (no preflight
    recorded)."""
    found = None
    for ev in store.events(job_id):
        if ev.kind == "preflight" and ev.attempt == attempt:
            found = list(ev.data.get("ops") or [])
    return found


def kept_view(store: Store, job_id: str, attempt: int) -> list[dict[str, Any]]:
    """The nodes of the attempt that took an agent kept warm instead of starting one (its ``agent_kept`` events):
    ``[{"host", "from_job" (None: the job's own earlier attempt), "from_attempt"}]``, in node order."""
    return [{"host": ev.data.get("host"), "from_job": ev.data.get("from_job"),
             "from_attempt": ev.data.get("from_attempt")}
            for ev in store.events(job_id) if ev.kind == "agent_kept" and ev.attempt == attempt]


def kept_words(kept: list[dict[str, Any]] | None) -> str | None:
    """One line for people: ``agents kept warm on node-0, node-1 (from job J): no agent start, no import``; None
    when no node took one."""
    if not kept:
        return None
    sources = sorted({f"job {k['from_job']}" if k.get("from_job") else "the attempt before" for k in kept})
    return (f"agents kept warm on {', '.join(str(k['host']) for k in kept)} (from {', '.join(sources)}): no agent "
            "start, no import again")


def ops_words(ops: list[dict[str, Any]] | None) -> str | None:
    """One line for people: ``deepspeed_shm_comm built on 2 node(s) (31.2 s), fused_adam loaded from cache on
    2 node(s)``; None when no op was asked for."""
    if not ops:
        return None
    words = {"built": "built", "cached": "loaded from cache", "not_needed": "not needed", "failed": "failed"}
    parts = []
    for op in ops:
        said = [f"{words[k]} on {op[k]} node(s)" + (f" ({op.get('seconds', 0):.1f} s)" if k == "built" else "")
                for k in words if op.get(k)]
        parts.append(f"{op['name']} " + ", ".join(said or ["not reported"]))
    return "; ".join(parts)


#: The most bytes of a log one read returns (a larger ``limit`` is cut to it).
MAX_LOG_READ = 8 << 20


def read_log(store: Store, job_id: str, rank: int, attempt: int | None = None, offset: int = 0,
             limit: int = 1 << 20) -> dict[str, Any]:
    """Read a rank's log from byte ``offset``: ``{"data", "offset", "eof", "path"}``.

    ``offset`` -1 means "the last ``limit`` bytes"; ``limit`` is at most :data:`MAX_LOG_READ` (8 MiB).
    ``eof`` is true when the attempt has stopped and everything was read (a follower can stop).

    Raises:
        NotFoundError: no such job, attempt or rank.
    """
    limit = max(1, min(int(limit), MAX_LOG_READ))  # (a huge limit would read a whole file into memory)
    job = store.get_job(job_id)
    rec = store.get_attempt(job.id, attempt or job.attempt)
    if not any(r["global_rank"] == rank for n in rec.plan["nodes"] for r in n["ranks"]):
        raise NotFoundError(f"Job {job.id} attempt {rec.number} has no rank {rank} "
                         f"(world size {rec.plan['world_size']}).")
    path = log_path(rec.plan, rank)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    if offset < 0:
        offset = max(0, size - limit)
    data = b""
    if size > offset:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    new_offset = offset + len(data)
    return {"data": data.decode("utf-8", "replace"), "offset": new_offset, "path": str(path),
            "eof": rec.stopped_at is not None and new_offset >= size}
