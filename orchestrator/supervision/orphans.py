"""Jobs whose controller died: found by their owner record, failed with cause ``controller_lost``.

A controller records itself (pid, host, process start time, API URL) as the owner of the jobs it
runs. When that process is gone, the job's agents have stopped its ranks (their link closed, or
the lease ran out); :func:`recover_orphans` sweeps anything still marked with the attempt and
records the end, so ``orch resume`` can continue the job.
"""

from __future__ import annotations

import socket
from typing import Any

import psutil

from agents.attach import read_outcomes
from agents.ranks import describe_returncode
from agents.sweep import sweep_attempt as sweep_here

from ..errors import OrchError, StateError
from ..store import JobState, Store
from .reattach import awaiting_reattach

__all__ = ["recover_orphans", "owner_alive", "waits_for_nodes", "sweep_attempt"]


def recover_orphans(store: Store, patient: bool = True) -> list[str]:
    """Fail every job whose controller died while it ran; return their ids.

    A job is orphaned when it is not terminal and the controller recorded as its owner is
    no longer running on this host. Its local agents stopped their ranks when their link
    to that controller closed (or when its lease ran out); any process still marked with
    the attempt's id is killed here. The job becomes FAILED with cause ``controller_lost``,
    so ``orch resume`` can continue it; unless every rank ended while no controller listened,
    whose exits the agents recorded (:func:`_record_outcome`): then it ends as they did.
    Called by ``orch server`` at start and every few
    seconds, and by CLI commands that work on the state directory without a server.

    ``patient``: leave alone a job whose ranks may still be taken over by a new server
    (:func:`~.reattach.awaiting_reattach`); a server that just took over what it could is not.
    """
    recovered = []
    for job in store.active_jobs():
        if owner_alive(job.owner) or (patient and awaiting_reattach(job) > 0):
            continue
        if job.attempt:
            sweep_attempt(store, job.id, job.attempt)
            if _record_outcome(store, job):
                recovered.append(job.id)
                continue
        server = (job.owner or {}).get("url")
        cause = {"kind": "controller_lost", "server": server,
                 "message": f"the controller running this job ({'orch server at ' + server if server else 'orch run'}) "
                 "went away; its agents stopped the ranks. Continue with: "
                 f"orch resume {job.id} (orch resume {job.id} --dry-run says which checkpoint it would start from)" + (" (an orch server started on this state dir restarts it from there: the controller's "
                                            "death is orch's own trouble, restarted whatever the restart policy says)"
                                            if server else "")}
        queued = waits_for_nodes(store, job)
        try:
            store.set_state(job.id, JobState.FAILED, cause=cause, queued=queued)
        except StateError:  # someone else recorded an end meanwhile
            continue
        if job.attempt and not queued:
            store.mark_stopped(job.id, job.attempt)
        store.set_owner(job.id, None)
        recovered.append(job.id)
    return recovered


def _record_outcome(store: Store, job: Any) -> bool:
    """Record the end the agents left (``agents.attach.write_outcome``) when every rank of the attempt ended
    while no controller listened: SUCCEEDED if each exited 0, else FAILED naming the first rank that failed
    by itself (a rank its agent stopped after that failure shows a signal). False when they left none."""
    try:
        plan = store.get_attempt(job.id, job.attempt).plan
    except OrchError:
        return False
    exits = read_outcomes(plan)
    if exits is None:
        return False
    hosts = {r["global_rank"]: (n["host"], n["node_rank"]) for n in plan["nodes"] for r in n["ranks"]}
    for rank, code in sorted(exits.items()):
        store.add_event(job.id, job.attempt, "rank_exit", {"global_rank": rank, "node_rank": hosts[rank][1],
                        "host": hosts[rank][0], "returncode": code, "how": describe_returncode(code),
                        "during_teardown": False, "while_no_controller": True})
    failed = sorted(exits.items(), key=lambda kv: (kv[1] <= 0, kv[0]))
    rank, code = failed[0]
    try:
        if code == 0:
            store.set_state(job.id, JobState.SUCCEEDED)
        else:
            store.set_state(job.id, JobState.FAILED, cause={
                "kind": "rank_exit", "global_rank": rank, "node": hosts[rank][0], "node_rank": hosts[rank][1],
                "returncode": code, "message": f"rank {rank} on {hosts[rank][0]} (node {hosts[rank][1]}) exited with "
                f"{describe_returncode(code)} while no controller ran (its server had died; its agents recorded it)"})
    except StateError:
        return True  # someone else recorded an end meanwhile
    store.mark_stopped(job.id, job.attempt)
    store.set_owner(job.id, None)
    return True


def sweep_attempt(store: Store, job_id: str, attempt: int) -> list[int]:
    """Kill what is left of the attempt on this machine: its nodes' cgroups (``agents.cgroups``), its agents
    (which may be awaiting a new server) and its ranks, by their markers; then remove the scratch they left
    (``agents.metrics.remove_scratch``)."""
    attempt_id = f"{job_id}.{attempt}"
    try:
        nodes = store.get_attempt(job_id, attempt).plan.get("nodes") or []
    except OrchError:
        nodes = []
    monitor = next((n.get("deepspeed_monitor_dir") for n in nodes if n.get("deepspeed_monitor_dir")), None)
    return sweep_here(attempt_id, range(len(nodes)), scratch=nodes[0].get("metrics_dir") if nodes else None,
                      monitor=monitor)


def waits_for_nodes(store: Store, job: Any) -> bool:
    """The job is PENDING with an attempt still waiting for a scheduler's nodes (no attempt record yet:
    its last one has ended), as a queued attempt leaves it (``supervision/queued.py``)."""
    if job.state != JobState.PENDING:
        return False
    return not job.attempt or store.get_attempt(job.id, job.attempt).ended_at is not None


def owner_alive(owner: dict[str, Any] | None) -> bool:
    """True if the controller recorded as ``owner`` still runs (or runs on another host, which
    cannot be checked from here)."""
    if not owner:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        proc = psutil.Process(int(owner["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:  # dead, only not reaped by its parent yet
            return False
        return abs(proc.create_time() - float(owner.get("create_time", proc.create_time()))) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError, TypeError):
        return False
