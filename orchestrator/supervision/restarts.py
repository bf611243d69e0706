"""The spec's restart policy, applied after each failed attempt: a restart is scheduled after the
policy's backoff and runs as an automatic resume, unless it is called off first (a cancel, a resume by
hand, the controller shutting down).

A node lost (``exclude_failed_nodes``) or a straggler's (``straggler.on_straggler: exclude_on_restart``) is left
out of the restart. Every decision is an event: ``restart_scheduled`` (restart number, wait, hosts left out), a
``warning`` when ``max_restarts`` is used up, ``restart_called_off``, ``restart_failed``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import OrchError
from ..observe.stragglers import flagged_ranks
from ..spec import JobSpec
from ..spec.restart import CONTROLLER_CAUSES, CONTROLLER_RESTARTS
from ..store import JobState, Store

__all__ = ["Restarts", "NODE_CAUSES", "straggler_hosts"]

#: Causes that are a node's, not the job's: ``exclude_failed_nodes`` leaves the node out of the restart. A
#: ``gpu_fault`` (a GPU of the node reported a fatal Xid or a double-bit ECC error, agents/gpu.py) is a node
#: lost to its hardware (restarted when ``retry_on`` has ``gpu_fault``, as by default).
NODE_CAUSES = ("node_lost", "gpu_fault")


def straggler_hosts(store: Store, job_id: str, attempt: int, spec: JobSpec, already: list[str]) -> list[str]:
    """The hosts of the ranks flagged as stragglers in attempt ``attempt`` when it ended (``straggler`` events
    not cleared), which ``straggler.on_straggler: exclude_on_restart`` leaves out of the restart; empty under
    ``warn``. Hosts in ``already`` are not repeated."""
    if spec.straggler.on_straggler != "exclude_on_restart":
        return []
    hosts = [d.get("node") for d in flagged_ranks(store.events(job_id), attempt).values()]
    return sorted({h for h in hosts if h and h not in already})


class Restarts:
    """Pending automatic restarts of one controller's jobs.

    Args:
        store: the job store.
        owner: the controller's owner record, set on a job while its restart is pending (so that
            ``orch cancel`` elsewhere reaches this controller).
        resume: ``resume(job_id, exclude_hosts)``: starts the restart's attempt (an automatic
            :meth:`~orchestrator.supervision.Controller.resume`); raises OrchError when it cannot.
    """

    def __init__(self, store: Store, owner: dict[str, Any], resume: Callable[[str, list[str]], Any]) -> None:
        self.store = store
        self.owner = owner
        self.resume = resume
        self._pending: dict[str, threading.Event] = {}  # job id -> set to call its restart off
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._scanned_lost = False  # looked for FAILED jobs of a dead server (lost_server_jobs)

    def is_pending(self, job_id: str) -> bool:
        """Whether a restart of the job is scheduled and has not started its attempt yet."""
        with self._lock:
            return job_id in self._pending

    def pending(self) -> list[str]:
        """The jobs with a restart pending."""
        with self._lock:
            return list(self._pending)

    def apply(self, job_id: str, spec: JobSpec, attempt: int) -> bool:
        """Schedule an automatic restart of a FAILED job whose last attempt is ``attempt``, if
        ``spec.restart`` retries its cause and restarts are left; returns whether it did."""
        try:
            job = self.store.get_job(job_id)
            policy = spec.restart
            if job.state != JobState.FAILED or job.attempt != attempt:
                return False
            cause = job.cause or {}
            scheduled = [e.data for e in self.store.events(job.id) if e.kind == "restart_scheduled"]
            ours = cause.get("kind") in CONTROLLER_CAUSES  # orch's trouble: restarted whatever the policy
            done = sum(1 for d in scheduled if not d.get("controller_fault"))
            if ours:
                in_row = next((i for i, d in enumerate(reversed(scheduled)) if not d.get("controller_fault")),
                              len(scheduled))
                if in_row >= CONTROLLER_RESTARTS:
                    self.store.add_event(job.id, job.attempt, "warning", {
                        "message": f"no automatic restart: the controller's own trouble ({cause.get('kind')}) "
                                   f"ended {in_row + 1} attempts in a row; look at the machine orch runs on"})
                    return False
                delay = min(policy.backoff(0), 5.0)
            else:
                if policy.max_restarts == 0 or not policy.retries(cause):
                    return False
                if done >= policy.max_restarts:
                    self.store.add_event(job.id, job.attempt, "warning", {
                        "message": f"no automatic restart: the job was restarted {done} time(s), its max_restarts"})
                    return False
                delay = policy.backoff(done)
            exclude = (cause.get("nodes") or [cause["node"]]) if policy.exclude_failed_nodes \
                and cause.get("kind") in NODE_CAUSES and cause.get("node") else []
            exclude = [*exclude, *straggler_hosts(self.store, job.id, attempt, spec, exclude)]
            self.store.add_event(job.id, job.attempt, "restart_scheduled", {
                "restart": len(scheduled) + 1, "max_restarts": policy.max_restarts, "in_seconds": delay,
                "exclude_hosts": exclude, "cause_kind": cause.get("kind"),
                **({"controller_fault": True} if ours else {})})
        except OrchError as err:
            self.log_failure(job_id, f"cannot decide on a restart: {err}")
            return False
        called_off = threading.Event()
        with self._lock:
            self._pending[job.id] = called_off
        self.store.set_owner(job.id, self.owner)
        threading.Thread(target=self._restart_later, args=(job.id, delay, exclude, called_off),
                         name=f"restart-{job.id}", daemon=True).start()
        return True

    def call_off(self, job_id: str, reason: str) -> bool:
        """Call a pending restart of the job off (event ``restart_called_off``); False when none was."""
        with self._lock:
            called_off = self._pending.pop(job_id, None)
        if called_off is None:
            return False
        called_off.set()
        self.store.add_event(job_id, None, "restart_called_off", {"reason": reason})
        return True

    def close(self) -> None:
        """Call every pending restart off; none is scheduled from now on."""
        self._closed.set()
        for job_id in self.pending():
            self.call_off(job_id, "the controller shut down")

    def log_failure(self, job_id: str, message: str) -> None:
        """Record that an automatic restart failed (events ``restart_failed`` and ``warning``)."""
        try:
            self.store.add_event(job_id, None, "restart_failed", {"message": message})
            self.store.add_event(job_id, None, "warning", {"message": f"automatic restart failed: {message}"})
        except Exception:  # noqa: BLE001 - the store may be closing
            pass

    def lost_server_jobs(self, recovered: list[str]) -> list[str]:
        """Jobs whose restart policy a server is to apply after a server died: the ones just recovered,
        and (once, at the server's start) FAILED ones whose server died and whose restart nobody decided
        yet (another command may have noticed the death first); only jobs an orch server ran."""
        ids = list(recovered)
        if not self._scanned_lost:
            self._scanned_lost = True
            for job in self.store.list_jobs(limit=10_000):
                cause = job.cause or {}
                if job.state != JobState.FAILED or cause.get("kind") != "controller_lost" or job.id in ids \
                        or job.owner or self.is_pending(job.id):
                    continue
                later = [e.kind for e in self.store.events(job.id) if e.attempt == job.attempt]
                if "restart_scheduled" not in later and "restart_failed" not in later:
                    ids.append(job.id)
        return [j for j in ids if (self.store.get_job(j).cause or {}).get("server")]

    def _restart_later(self, job_id: str, delay: float, exclude: list[str], called_off: threading.Event) -> None:
        try:
            if called_off.wait(delay) or self._closed.is_set():
                return
            try:
                self.resume(job_id, exclude)
            except OrchError as err:
                self.log_failure(job_id, str(err))
            except Exception as err:  # noqa: BLE001 - an orch bug: say so, never die silently
                self.log_failure(job_id, f"orch internal error: {err!r}")
        finally:
            with self._lock:
                if self._pending.get(job_id) is called_off:
                    del self._pending[job_id]
            try:
                job = self.store.get_job(job_id)
                if job.state.is_terminal() and job.owner == self.owner:
                    self.store.set_owner(job_id, None)  # no restart came of it
            except Exception:  # noqa: BLE001 - the store may be closing
                pass
