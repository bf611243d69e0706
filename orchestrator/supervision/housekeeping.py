"""``orch gc``: find what the retention rule (docs/housekeeping.md) lets go, and remove it.

Always: what attempts that are over left behind, on this machine: the scratch of agents killed before their
teardown (``<run_dir>/scratch``; ``/tmp/orch-metrics/<attempt id>`` of orch before 0.x), their Unix sockets
and cgroups (``agents.attach``, ``agents.cgroups``, with any process still marked with the attempt), preflight
token directories in the checkpoint directory, Prometheus targets files, the alive files of controllers that
are gone, and sockets and cgroup records no agent owns any more. With ``older_than``: the run directories
(plans, configs, logs) of jobs finished that long ago, and their checkpoints under the state directory (a
FAILED or CANCELLED job keeps the one a resume would start from, unless ``drop_resume_checkpoints``).

A job that is not over is never touched: PENDING, PROVISIONING or RUNNING (its ranks may await a new server:
``supervision/reattach.py``), or ended while its controller still owns it (its ranks are still stopping, in their
grace period; or, FAILED, a restart is pending). Checkpoints in a
directory the spec names outside the state directory are the user's: listed as kept, never removed here (the
spec's ``checkpoints.keep_last`` prunes them while the job runs).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agents.attach import attach_dir, attach_path, node_key
from agents.cgroups import record_path

from ..checkpoints.deepspeed_layout import read_latest
from ..checkpoints.retention import remove, select, tree_bytes
from ..errors import OrchError
from ..observe import default_targets_dir
from ..observe.checkpoints import job_choice
from ..store import AttemptRecord, JobRecord, JobState, Store
from .orphans import owner_alive, recover_orphans, sweep_attempt
from .preflight import token_dir
from .reattach import awaiting_reattach
from .warm import WARM_RECORD

__all__ = ["Entry", "Kept", "GcResult", "collect", "run_gc", "LEGACY_SCRATCH"]

#: Where orch kept node scratch before it moved into the run directory (``<dir>/<attempt id>``).
LEGACY_SCRATCH = "/tmp/orch-metrics"
#: A socket or alive file younger than this is never taken for stale (seconds): its owner may be starting.
STALE_AFTER_S = 60.0


@dataclass(frozen=True)
class Entry:
    """One thing to remove.

    Attributes:
        path: the file or directory (for ``process``: the pid).
        what: ``scratch``, ``socket``, ``cgroup`` (a known attempt's record: its cgroup goes with the sweep),
            ``cgroup_record`` (a record whose cgroup is gone), ``process``, ``preflight``, ``targets``, ``alive``,
            ``run_dir``, ``checkpoints`` (a whole directory), ``checkpoint`` (one tag).
        bytes: its size (files under a directory included).
        job, attempt: whose it is (None: no known job's).
        why: why it may go, in words.
        tag: the checkpoint's tag (``checkpoint``), for the store's manifests.
    """

    path: str
    what: str
    bytes: int = 0
    job: str | None = None
    attempt: int | None = None
    why: str = ""
    tag: str | None = None


@dataclass(frozen=True)
class Kept:
    """Something ``orch gc`` was asked about and leaves: a job that is not over, a checkpoint a resume needs,
    checkpoints outside the state directory."""

    job: str | None
    why: str
    path: str | None = None


@dataclass
class GcResult:
    """What :func:`run_gc` found and did.

    Attributes:
        dry_run: nothing was removed.
        entries: what was removed (or would be).
        kept: what was left, and why.
        failed: path -> why it could not be removed.
        recovered: jobs whose controller had died, recorded as ended first (:func:`~.orphans.recover_orphans`).
        killed: pids of processes left by attempts that are over, killed.
    """

    dry_run: bool
    entries: list[Entry] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    recovered: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Bytes of every entry that was (or would be) removed."""
        return sum(e.bytes for e in self.entries if e.path not in self.failed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``orch gc --output json``)."""
        return {"dry_run": self.dry_run, "bytes": self.bytes, "removed": [asdict(e) for e in self.entries],
                "kept": [asdict(k) for k in self.kept], "failed": self.failed, "recovered": self.recovered,
                "killed": self.killed}


def _size(path: str) -> int:
    try:
        return tree_bytes(path) if os.path.isdir(path) else os.lstat(path).st_size
    except OSError:
        return 0


def _marked() -> dict[str, list[int]]:
    """attempt id -> pids of this user's processes marked with it (ranks and agents)."""
    out: dict[str, list[int]] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        for key in ("ORCH_ATTEMPT_ID", "ORCH_AGENT_ATTEMPT_ID"):
            if env.get(key):
                out.setdefault(env[key], []).append(proc.pid)
                break
    return out


def kept_pids(record: Path) -> set[int]:
    """The pids :class:`~.warm.WarmPool` lists in ``record`` while its controller (the record's ``owner``) runs: agents
    and templates kept for later jobs, and those a later job runs on now; an empty set without a record, or when
    its controller is gone."""
    try:
        data = json.loads(Path(record).read_text())
        return {int(p) for p in data["pids"]} if owner_alive(data.get("owner")) else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _live(job: JobRecord, dry_run: bool) -> str | None:
    """Why the job is not over (its files are left alone), or None. In a dry run a job whose controller died
    counts as over, as the real run first records it so (:func:`~.orphans.recover_orphans`)."""
    if job.state.is_terminal():  # its controller lets go of it (owner None) once its processes are gone
        if owner_alive(job.owner):
            return (f"{job.state.value}, and its controller is still at it (stopping its processes"
                    + (", or a restart pending)" if job.state == JobState.FAILED else ")"))
        return None
    if owner_alive(job.owner):
        return job.state.value
    if awaiting_reattach(job) > 0:
        return f"{job.state.value}: its server is gone and its ranks await a new one"
    return None if dry_run else job.state.value


def _attempt_leftovers(job: JobRecord, a: AttemptRecord, marked: dict[str, list[int]], targets: Path) -> list[Entry]:
    """What attempt ``a`` of a job that is over left on this machine."""
    attempt_id = f"{job.id}.{a.number}"
    nodes = a.plan.get("nodes") or []
    why = "the attempt is over"
    found: list[tuple[str, str]] = []
    run_dir = a.plan.get("run_dir")
    scratch = nodes[0].get("metrics_dir") if nodes else None
    scratch = scratch or (os.path.join(run_dir, "scratch") if run_dir else None)
    found += [(p, "scratch") for p in (scratch, os.path.join(LEGACY_SCRATCH, attempt_id)) if p and os.path.lexists(p)]
    for n in range(len(nodes)):
        found += [(attach_path(attempt_id, n), "socket")] if os.path.lexists(attach_path(attempt_id, n)) else []
        found += [(record_path(attempt_id, n), "cgroup")] if os.path.lexists(record_path(attempt_id, n)) else []
    if a.plan.get("checkpoint_dir"):
        tokens = token_dir(a.plan["checkpoint_dir"], attempt_id)
        found += [(tokens, "preflight")] if os.path.isdir(tokens) else []
    found += [(str(targets / f"{attempt_id}.json"), "targets")] if (targets / f"{attempt_id}.json").exists() else []
    out = [Entry(p, what, _size(p), job.id, a.number, why) for p, what in found]
    out += [Entry(str(pid), "process", 0, job.id, a.number, "still marked with the attempt, which is over")
            for pid in marked.get(attempt_id, [])]
    return out


def _stale_points(known: set[str], now: float) -> list[Entry]:
    """Sockets no agent listens on and cgroup records whose cgroup is gone, of attempts no job here knows."""
    out = []
    for path in sorted(glob.glob(os.path.join(attach_dir(), "*.sock"))):
        key = os.path.basename(path)[:-5]
        try:
            young = now - os.lstat(path).st_mtime < STALE_AFTER_S
        except OSError:
            continue  # gone meanwhile
        if key in known or young:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(path)
                continue  # an agent listens: not ours to judge
            except OSError as err:
                if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    continue
        out.append(Entry(path, "socket", 0, why="no agent listens on it"))
    for path in sorted(glob.glob(os.path.join(attach_dir(), "*.cgroup"))):
        try:
            recorded = Path(path).read_text().strip()
        except OSError:
            continue
        if os.path.basename(path)[:-7] not in known and not os.path.isdir(recorded):
            out.append(Entry(path, "cgroup_record", 0, why=f"its cgroup {recorded} is gone"))
    return out


def _alive_files(state_dir: Path, active: list[JobRecord], now: float) -> list[Entry]:
    """``controller-<pid>.alive`` files of controllers that are gone and that no job waits on."""
    used = {str((j.owner or {}).get("alive")) for j in active}
    out = []
    for path in sorted(state_dir.glob("controller-*.alive")):
        pid = path.stem.removeprefix("controller-")
        try:
            old = now - path.stat().st_mtime >= STALE_AFTER_S
        except OSError:
            continue
        if str(path) not in used and old and not (pid.isdigit() and psutil.pid_exists(int(pid))):
            out.append(Entry(str(path), "alive", 0, why="its controller is gone"))
    return out


def _old_job(store: Store, state_dir: Path, job: JobRecord, attempts: list[AttemptRecord], keep_checkpoints: bool,
             drop_resume: bool) -> tuple[list[Entry], list[Kept]]:
    """The run directories and checkpoints of a job finished long enough ago."""
    job_dir = (state_dir / "jobs" / job.id).resolve()
    age = f"finished {time.strftime('%Y-%m-%d %H:%M', time.localtime(job.updated_at))}"
    out = [Entry(str(p), "run_dir", _size(str(p)), job.id, None, age) for p in sorted(job_dir.glob("attempt-*"))
           if p.is_dir()]
    kept: list[Kept] = []
    last = attempts[-1].plan if attempts else {}
    roots = dict.fromkeys(r for r in (last.get("resume_dir"), last.get("checkpoint_dir")) if r)
    for root in roots:
        if not os.path.isdir(root):
            continue
        if not Path(root).resolve().is_relative_to(job_dir):
            kept.append(Kept(job.id, "checkpoints in a directory the spec names, outside the state dir, are the "
                             "user's (the spec's checkpoints.keep_last prunes them while the job runs)", root))
        elif keep_checkpoints:
            kept.append(Kept(job.id, "checkpoints (--keep-checkpoints)", root))
        elif job.state.is_resumable() and not drop_resume:
            out += _all_but_resume(store, job, root, age, kept)
        else:
            out.append(Entry(root, "checkpoints", _size(root), job.id, None, age))
    return out, kept


def _all_but_resume(store: Store, job: JobRecord, root: str, age: str, kept: list[Kept]) -> list[Entry]:
    """The checkpoints of a resumable job but the one its resume would start from (and what ``latest`` names)."""
    try:
        choice = job_choice(store, job.id, root, (job.spec.get("resume") or {}).get("format", "auto"), contents=False)
    except (OSError, ValueError):
        kept.append(Kept(job.id, "checkpoints that cannot be read as the spec's format", root))
        return []
    if choice.chosen is None:
        return [Entry(root, "checkpoints", _size(root), job.id, None, f"{age}; none is complete")]
    latest = read_latest(root)
    protect = {choice.chosen.tag: "resume", **({latest: "latest"} if latest else {})}
    kept.append(Kept(job.id, f"checkpoint {choice.chosen.tag}: a resume would start from it "
                     "(--drop-resume-checkpoints removes it)", choice.chosen.path))
    pruning = select(choice.checkpoints, 1, None, protect)
    return ([Entry(i.path, "checkpoint", _size(i.path), job.id, None, age, i.tag) for i in pruning.delete]
            + [Entry(p, "checkpoint", _size(p), job.id, None, age) for p in pruning.also])


def collect(store: Store | None, state_dir: str | Path, *, older_than_s: float | None = None,
            keep_checkpoints: bool = False, drop_resume_checkpoints: bool = False, dry_run: bool = True,
            now: float | None = None, finished: dict[str, float] | None = None) -> tuple[list[Entry], list[Kept]]:
    """Everything the rule lets go now (see the module docstring); removes nothing. A job whose agents an ``orch
    server --keep-warm`` keeps for later jobs (:func:`kept_pids`) is left alone as not over, until they end.

    Args:
        store: the state dir's store (None: it has none, only stale sockets are looked for).
        state_dir: orch's state directory.
        older_than_s: also the run directories and checkpoints of jobs finished at least this many seconds ago.
        keep_checkpoints: with ``older_than_s``, leave their checkpoints.
        drop_resume_checkpoints: with ``older_than_s``, remove the checkpoint a FAILED/CANCELLED job would resume from.
        dry_run: count a job whose controller died as over (the real run records it so first).
        now: epoch seconds (default: the clock).
        finished: job id -> when it last changed (default: its ``updated_at``), as seen before jobs whose
            controller died were recorded as ended (which makes them change now).

    Returns:
        ``(entries, kept)``; no entry lies inside another.
    """
    state_dir = Path(state_dir)
    now = time.time() if now is None else now
    jobs = store.list_jobs(1 << 62) if store else []
    marked, targets = _marked(), default_targets_dir(state_dir)
    warm = kept_pids(state_dir / WARM_RECORD)  # an orch server's agents kept for later jobs (.warm)
    entries: list[Entry] = []
    kept: list[Kept] = []
    known: set[str] = set()
    for job in jobs:
        attempts = store.attempts(job.id) if store else []
        known |= {node_key(f"{job.id}.{a.number}", n) for a in attempts for n in range(len(a.plan.get("nodes") or []))}
        why = _live(job, dry_run)
        if not why and any(pid in warm for a in attempts for pid in marked.get(f"{job.id}.{a.number}", ())):
            why = "its agents are kept warm for later jobs, or one runs on them now (orch server --keep-warm)"
        if why:
            kept.append(Kept(job.id, f"not over: {why}"))
            continue
        for a in attempts:
            entries += _attempt_leftovers(job, a, marked, targets)
        if older_than_s is not None and (finished or {}).get(job.id, job.updated_at) <= now - older_than_s:
            more, also = _old_job(store, state_dir, job, attempts, keep_checkpoints, drop_resume_checkpoints)
            entries += more
            kept += also
    entries += _stale_points(known, now)
    entries += _alive_files(state_dir, [j for j in jobs if not j.state.is_terminal()], now)
    return _outermost(entries), kept


def _outermost(entries: list[Entry]) -> list[Entry]:
    """Drop entries inside another entry's directory (a scratch inside a run directory that goes)."""
    dirs = [e.path.rstrip("/") + "/" for e in entries if e.what != "process"]
    return [e for e in entries if e.what == "process" or not any(e.path.startswith(d) for d in dirs)]


def run_gc(state_dir: str | Path, *, dry_run: bool, older_than_s: float | None = None,
           keep_checkpoints: bool = False, drop_resume_checkpoints: bool = False) -> GcResult:
    """Collect (:func:`collect`) and, unless ``dry_run``, remove: jobs whose controller died are recorded as ended
    first, attempts with leftovers are swept (:func:`~.orphans.sweep_attempt`: their processes killed, cgroups,
    sockets and scratch removed), then every entry goes; each job's removals are recorded as its event ``gc``
    (``{"paths", "bytes"}``), and the manifests of removed checkpoints leave the store.

    Raises:
        StateError: the store cannot be used.
    """
    state_dir = Path(state_dir)
    store = Store(state_dir / "orch.db") if (state_dir / "orch.db").is_file() else None
    result = GcResult(dry_run)
    try:
        finished = {j.id: j.updated_at for j in store.list_jobs(1 << 62)} if store else {}
        if store is not None and not dry_run:
            result.recovered = recover_orphans(store)
        result.entries, result.kept = collect(store, state_dir, older_than_s=older_than_s, dry_run=dry_run,
                                              keep_checkpoints=keep_checkpoints, finished=finished,
                                              drop_resume_checkpoints=drop_resume_checkpoints)
        if not dry_run:
            _remove(store, result)
    finally:
        if store is not None:
            store.close()
    return result


def _remove(store: Store | None, result: GcResult) -> None:
    swept = {(e.job, e.attempt) for e in result.entries if e.attempt is not None
             and e.what in ("socket", "cgroup", "process", "scratch")}
    for job_id, number in sorted(swept):
        result.killed += sweep_attempt(store, job_id, number) if store else []
    paths = [e.path for e in result.entries if e.what not in ("process", "cgroup")]
    _, result.failed = remove(paths)
    try:
        os.rmdir(LEGACY_SCRATCH)
    except OSError:
        pass
    if store is None:
        return
    for job_id in dict.fromkeys(e.job for e in result.entries if e.job):
        mine = [e for e in result.entries if e.job == job_id and e.path not in result.failed]
        _forget_checkpoints(store, job_id, mine)
        try:
            job_dir = Path(store.path).parent / "jobs" / job_id
            if job_dir.is_dir() and not any(job_dir.iterdir()):
                job_dir.rmdir()
            store.add_event(job_id, None, "gc", {"paths": [e.path for e in mine], "bytes": sum(e.bytes for e in mine)})
        except (OSError, OrchError):
            pass


def _forget_checkpoints(store: Store, job_id: str, removed: list[Entry]) -> None:
    """The manifests of removed checkpoints leave the store (a whole directory: every tag recorded in it)."""
    for e in removed:
        if e.what == "checkpoint" and e.tag:
            store.forget_checkpoint_tags(job_id, os.path.dirname(e.path), [e.tag])
        elif e.what == "checkpoints":
            store.forget_checkpoint_tags(job_id, e.path, list(store.manifest_tags(job_id, e.path)))
