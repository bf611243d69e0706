"""The controller: submit, supervise, cancel and resume jobs; the only writer of job state.

One :class:`Controller` runs embedded in ``orch run`` or as the service behind ``orch server``. It
plans each attempt (:mod:`.prepare`), starts it (:class:`~.attempt.AttemptRun`, one thread per
attempt), applies the job's restart policy when an attempt fails (:class:`~.restarts.Restarts`),
finds where a resume starts (:mod:`.resume`), and fails the jobs of controllers that died
(:mod:`.orphans`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from agents.ranks import private_files

from ..checkpoints import needs_universal
from ..checkpoints.integrity import Choice
from ..checkpoints.deepspeed_layout import read_latest
from ..errors import CheckpointError, OrchError, StateError
from ..observe import ControllerMetrics, TargetsWriter, default_targets_dir
from ..planning import JobPlan
from ..provisioners import Provisioner, get_provisioner
from ..spec import JobSpec, spec_from_dict
from ..spec.secrets import redact
from ..store import JobRecord, JobState, Store, open_state_dir
from .attempt import AttemptRun, AttemptServices
from .orphans import owner_alive, recover_orphans, sweep_attempt, waits_for_nodes
from .ports import PortLease
from .reattach import AliveFile, take_over
from .prepare import pool_of, prepare_plan, resume_dir_of
from .queued import QueuedAttempt, allocation_size
from .restarts import Restarts
from .warm import WARM_RECORD, WarmPool
from .resume import (check_fresh_start, check_reachable, check_world, convert, find_start, fresh_start_note,
                     mark_if_crashed_loading, rewrite_latest, tell_script)
from .settings import Timings, default_state_dir

__all__ = ["Controller", "default_state_dir", "new_job_id"]


def new_job_id(name: str) -> str:
    """``<name>-<6 hex digits>``."""
    return f"{name}-{secrets.token_hex(3)}"


class Controller:
    """Runs jobs: plans them, supervises their attempts, keeps their state in the store.

    Example::

        c = Controller("~/.orch")
        job = c.submit(load_spec("examples/quickstart.yaml"))
        job = c.wait(job.id)            # terminal, every process gone
        job.state                       # JobState.SUCCEEDED

    Args:
        state_dir: where the store, run directories and port locks live.
        clock: wall clock for the store (epoch seconds); injectable for tests.
        provisioner_factory: (name, spec) -> Provisioner (tests may replace it).
        heartbeat_s: how often agents send heartbeats and the controller pings them
            (default ``$ORCH_HEARTBEAT_S`` or 0.5 s).
        node_timeout_s: an agent's silence after which its node counts as lost
            (default ``$ORCH_NODE_TIMEOUT_S`` or 3 s).
        agent_lease_s: the controller's silence after which an agent stops its ranks
            (default ``$ORCH_AGENT_LEASE_S`` or 15 s). Agents also get
            ``$ORCH_PROVISION_TIMEOUT_S`` (default 120 s) to start and say hello, and
            ``$ORCH_PREFLIGHT_TIMEOUT_S`` (default 60 s) for their preflight checks.
        owner_url: the API URL of this controller, recorded as the owner of its jobs.
        recover_every_s: if > 0, look for orphaned jobs (see :func:`~.orphans.recover_orphans`) this often;
            ``orch server`` does, so a killed ``orch run`` is noticed.
        prometheus_targets: directory of the Prometheus file_sd files of running attempts
            (default ``$ORCH_PROMETHEUS_TARGETS`` or ``<state dir>/prometheus/targets``).
        share_warm_s: how long an ended job's agents (and fork-server templates) stay up for a later job on the
            same hosts (``orch server --keep-warm``; :class:`~.warm.WarmPool`); 0: they end with their job.
    """

    def __init__(self, state_dir: str | Path | None = None, *, clock: Callable[[], float] = time.time,
                 provisioner_factory: Callable[[str, JobSpec], Provisioner] = get_provisioner,
                 heartbeat_s: float | None = None, node_timeout_s: float | None = None,
                 agent_lease_s: float | None = None, owner_url: str | None = None,
                 recover_every_s: float = 0.0, prometheus_targets: str | Path | None = None,
                 share_warm_s: float = 0.0) -> None:
        private_files()  # orch's own files 0600, directories 0700; ranks keep the user's umask
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        open_state_dir(self.state_dir)
        self.store = Store(self.state_dir / "orch.db", clock)
        self.provisioner_factory = provisioner_factory
        self.timings = Timings.from_env(heartbeat_s, node_timeout_s, agent_lease_s)
        if not owner_url:  # no successor takes over an `orch run`'s attempts: its agents stop with it
            self.timings = dataclasses.replace(self.timings, reattach_s=0.0)
        proc = psutil.Process()
        self.alive = AliveFile(self.state_dir, proc.pid) if owner_url else None
        self.owner = {"pid": proc.pid, "host": socket.gethostname(), "create_time": proc.create_time(),
                      "url": owner_url, **({"reattach_s": self.timings.reattach_s, "alive": str(self.alive.path)}
                                           if self.alive else {})}
        self.recover_every_s = recover_every_s
        self.metrics = ControllerMetrics(self.store)
        self.targets = TargetsWriter(Path(prometheus_targets).expanduser() if prometheus_targets
                                     else default_targets_dir(self.state_dir))
        self.restarts = Restarts(self.store, self.owner, self._restart)
        # agents kept for a restart, or for later jobs (.warm)
        self.warm = WarmPool(share_warm_s, self.state_dir / WARM_RECORD, self.owner)
        self._runs: dict[str, AttemptRun] = {}
        self._queued: dict[str, QueuedAttempt] = {}  # job id -> its attempt waiting for a scheduler's nodes
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}  # idempotency key -> its submit's lock
        self._closed = threading.Event()
        self._services = AttemptServices(self.store, self.metrics, self.targets, self.timings, self._attempt_ended,
                                         self.warm)
        self._watcher = threading.Thread(target=self._watch_requests, name="cancel-watcher", daemon=True)
        self._watcher.start()

    # -- queries ------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        """The job (``job_id`` may be a unique prefix). Raises NotFoundError."""
        return self.store.get_job(job_id)

    def active_run(self, job_id: str) -> AttemptRun | None:
        """The attempt this controller is supervising for the job, if any."""
        with self._lock:
            run = self._runs.get(job_id)
        return run if run is not None and not run.done.is_set() else None

    # -- commands -----------------------------------------------------------------------------

    def submit(self, spec: JobSpec, key: str | None = None) -> JobRecord:
        """Plan the job's first attempt and start it.

        Planning happens before anything is stored or started, so a bad hostfile,
        filter or port raises here and leaves no trace. A provisioner whose nodes a scheduler
        grants (slurm from a login node: ``needs_allocation()``) has its request checked here;
        the job is then stored PENDING and planned once the nodes are granted (:mod:`.queued`).

        Args:
            key: an idempotency key: a submit with a key already used returns that job, starting nothing
                (a client's retry after a lost reply).

        Raises:
            OrchError: the job cannot be planned.
            StateError: ``key`` was used for a job with another spec.
        """
        if key is None:
            return self._submit(spec, None)
        with self._lock:
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:  # two requests with one key at once: the second waits and gets the first's job
            done = self.store.job_for_key(key)
            if done is None:
                try:
                    return self._submit(spec, key)
                finally:
                    with self._lock:
                        self._key_locks.pop(key, None)
            job = self.store.get_job(done)
            if job.spec != json.loads(json.dumps(spec.to_dict(), sort_keys=True)):
                raise StateError(f"Idempotency key {key!r} was used for job {job.id}, with another spec; give a new "
                                 "key for a new job.")
            return job

    def _submit(self, spec: JobSpec, key: str | None) -> JobRecord:
        job_id = new_job_id(spec.name)
        provisioner = self.provisioner_factory(spec.provisioner, spec)
        if provisioner.needs_allocation():  # planned once the scheduler grants the nodes
            size = self._allocation_size(spec, provisioner)
            self.store.create_job(job_id, spec.name, spec.to_dict(), owner=self.owner, key=key)
            self._queue(job_id, 1, spec, provisioner, size, lambda granted: self._start_planned(
                spec, *prepare_plan(spec, self.state_dir, job_id, provisioner=granted), granted))
            return self.store.get_job(job_id)
        plan, lease = prepare_plan(spec, self.state_dir, job_id)
        try:
            self.store.create_job(job_id, spec.name, spec.to_dict(), owner=self.owner, key=key)
        except BaseException:
            lease.release()
            raise
        self._start_attempt(spec, plan, lease, provisioner)
        return self.store.get_job(job_id)

    def _allocation_size(self, spec: JobSpec, provisioner: Provisioner) -> tuple[int, int, list[str] | None]:
        """What a queued attempt asks for (:func:`~.queued.allocation_size`), checked before anything is stored."""
        provisioner.check_allocation_request()  # type: ignore[attr-defined]
        return allocation_size(spec, lambda: [(h, len(slots)) for h, slots in pool_of(spec, provisioner).nodes])

    def _queue(self, job_id: str, number: int, spec: JobSpec, provisioner: Provisioner,
               size: tuple[int, int, list[str] | None], start: Callable[[Provisioner], None]) -> None:
        def start_then_check(granted: Provisioner) -> None:
            start(granted)
            run = self.active_run(job_id)
            if queued.cancel_event.is_set() and run is not None:  # cancelled while it was being planned
                run.cancel(queued.cancel_reason)

        run_dir = str(self.state_dir / "jobs" / job_id / f"attempt-{number}")
        queued = QueuedAttempt(self.store, job_id, number, spec, provisioner, size, run_dir, start_then_check)
        with self._lock:
            self._queued[job_id] = queued
        queued.start()

    def _start_planned(self, spec: JobSpec, plan: JobPlan, lease: PortLease, provisioner: Provisioner) -> None:
        """Start a queued attempt once planned (the lease released if it cannot start)."""
        try:
            self._start_attempt(spec, plan, lease, provisioner)
        except BaseException:
            lease.release()
            raise

    def resume(self, job_id: str, exclude_hosts: list[str] | None = None, automatic: bool = False,
               fresh: bool = False) -> JobRecord:
        """Start a new attempt of a FAILED or CANCELLED job from its last complete checkpoint.

        When the new attempt has another world size than the one that saved the checkpoint,
        the checkpoint is first converted to DeepSpeed's universal format here, on this
        controller's host (:func:`orchestrator.checkpoints.convert_to_universal`; event
        ``checkpoint_converted``), and the attempt starts from ``<tag>_universal`` with
        ``checkpoint.load_universal`` in its DeepSpeed config and ``ORCH_RESUME_UNIVERSAL=1``.
        Without a complete checkpoint the attempt starts from step 0 only where the job never
        checkpointed (see :func:`~.resume.check_fresh_start`) or ``fresh`` asks for it; a job that never
        had an attempt (cancelled while Slurm queued it) starts as submitted.

        Args:
            job_id: the job (or a unique prefix of its id).
            exclude_hosts: hostfile hosts to leave out from now on (e.g. a lost node); they
                join the spec's ``exclude_hosts`` and are removed from the hostfile before its
                filters and ``num_nodes``/``num_gpus`` apply, so a spare host can take the
                lost one's place.
            automatic: a restart by the job's restart policy (not by hand).
            fresh: start from step 0 whatever checkpoints there are (``orch resume --fresh``).

        Raises:
            NotFoundError: no such job.
            StateError: the job is not FAILED or CANCELLED, or its last attempt is still stopping.
            CheckpointError: no complete checkpoint where the job had checkpoints, or the
                conversion to the universal format failed.
            OrchError: the new attempt cannot be planned (the job stays as it was).
        """
        self.recover()
        job = self.store.get_job(job_id)
        if not automatic:
            self.restarts.call_off(job.id, "resumed by hand")
            self.warm.retire(job.id)
        self._check_resumable(job)
        spec = spec_from_dict(job.spec, source=f"job {job.id}")
        if exclude_hosts:
            spec = spec.model_copy(update={"exclude_hosts": list(dict.fromkeys([*spec.exclude_hosts, *exclude_hosts]))})
        number = job.attempt + 1
        never_ran = not self.store.attempts(job.id)  # cancelled while its nodes were to come: as submitted
        choice = None if fresh or never_ran else self._start_point(job, spec, automatic)
        provisioner = self.provisioner_factory(spec.provisioner, spec)
        if provisioner.needs_allocation():  # planned once the scheduler grants the nodes
            size = self._allocation_size(spec, provisioner)
            self._record_resume(job, spec, choice, fresh, automatic, exclude_hosts, None)
            self._queue(job.id, number, spec, provisioner, size, lambda granted: self._resume_planned(
                job, spec, number, choice, automatic, granted, None))
            return self.store.get_job(job.id)
        self._resume_planned(job, spec, number, choice, automatic, provisioner,
                             lambda plan: self._record_resume(job, spec, choice, fresh, automatic, exclude_hosts, plan))
        return self.store.get_job(job.id)

    def _resume_planned(self, job: JobRecord, spec: JobSpec, number: int, choice: Choice | None, automatic: bool,
                        provisioner: Provisioner, record: Callable[[JobPlan], None] | None) -> None:
        """Plan the resumed attempt (converting the checkpoint for a new world size), ``record`` it (the
        job's PENDING; None: recorded already, while queued), start it."""
        info = choice.chosen if choice else None
        args, env = tell_script(spec, choice) if choice else ((), {})
        plan, lease = prepare_plan(spec, self.state_dir, job.id, attempt=number, provisioner=provisioner,
                                   resume_tag=info.tag if info else None, resume_args=args, resume_env=env)
        if info is not None and info.format != "orch":
            try:
                check_world(info, plan.world_size)
            except CheckpointError:
                lease.release()
                raise
        if info is not None and info.format == "orch" and needs_universal(info, plan.world_size):
            lease.release()  # converting may take minutes; the port is reserved again below
            universal, event = convert(info, spec, plan.world_size)
            self.store.add_event(job.id, number, "checkpoint_converted", event)
            if automatic and record is not None and not self.restarts.is_pending(job.id):
                return  # cancelled (or resumed by hand) meanwhile
            plan, lease = prepare_plan(spec, self.state_dir, job.id, attempt=number, resume_tag=universal.tag,
                                       provisioner=provisioner, resume_universal_from=info.tag, resume_args=args,
                                       resume_env=env)
        try:
            if record is not None:
                record(plan)
        except BaseException:
            lease.release()
            raise
        self._start_planned(spec, plan, lease, provisioner)

    def _record_resume(self, job: JobRecord, spec: JobSpec, choice: Choice | None, fresh: bool, automatic: bool,
                       exclude_hosts: list[str] | None, plan: JobPlan | None) -> None:
        """The job is PENDING again: the resume's start point (``plan``: None while the nodes are to come)."""
        info = choice.chosen if choice else None
        args, _ = tell_script(spec, choice) if choice else ((), {})
        latest = rewrite_latest(spec, choice) if choice else None
        self.store.set_state(job.id, JobState.PENDING, data={
            "resume_tag": plan.resume_tag if plan else info.tag if info else None,
            "resume_universal_from": plan.resume_universal_from if plan else None,
            "fresh": fresh, "exclude_hosts": spec.exclude_hosts, "automatic": automatic,
            "checkpoint_format": choice.format if choice else None, "resume_args": list(args),
            "latest_rewritten": latest,
            "skipped_checkpoints": [{"tag": s.tag, "problems": list(s.problems)} for s in (choice.skipped if choice else [])]})
        note = fresh_start_note(spec, self.state_dir, job.id) if fresh else None
        if note:
            self.store.add_event(job.id, job.attempt + 1, "warning", {"message": note})
        if exclude_hosts:
            self.store.update_spec(job.id, spec.to_dict(), shown=redact(spec.to_dict(), spec.secret_env))
        self.store.set_owner(job.id, self.owner)

    def _start_point(self, job: JobRecord, spec: JobSpec, automatic: bool) -> Choice:
        """The checkpoint a resume starts from (:func:`~.resume.find_start`); with none, whether starting from
        step 0 is allowed.

        Raises:
            CheckpointError: no checkpoint, and the job had checkpoints (or their directory is gone).
        """
        choice = find_start(self.store, job.id, spec, self.state_dir)
        if choice.chosen is None:
            check_reachable(self.store, job.id, choice)
            check_fresh_start(job.id, [a.resume_tag for a in self.store.attempts(job.id) if a.resume_tag], spec,
                              choice.dir, choice.skipped, automatic, ever_saved=bool(choice.damaged))
        return choice

    def resume_preview(self, job_id: str, exclude_hosts: list[str] | None = None) -> dict[str, Any]:
        """What :meth:`resume` would start from, starting nothing (``orch resume --dry-run``): every
        checkpoint found (:class:`~orchestrator.checkpoints.integrity.Choice`, contents hashed against the
        manifest), the arguments and variables the script would get, and whether DeepSpeed's ``latest``
        would be rewritten. Any job can be previewed, whatever its state.

        Args:
            job_id: the job (or a unique prefix).
            exclude_hosts: as for :meth:`resume` (the new attempt's plan is made without them).

        Returns:
            ``{"job": id, "state", "checkpoints": Choice.to_dict(), "resume_tag", "resume_args",
            "resume_env", "latest": {"from", "to"} or None, "fresh_start": why or None, "world_size": the new
            attempt's or None, "refused": why the resume would be refused (its plan, the world size) or None}``.

        Raises:
            NotFoundError: no such job.
        """
        job = self.store.get_job(job_id)
        spec = spec_from_dict(job.spec, source=f"job {job.id}")
        if exclude_hosts:
            spec = spec.model_copy(update={"exclude_hosts": list(dict.fromkeys([*spec.exclude_hosts, *exclude_hosts]))})
        choice = find_start(self.store, job.id, spec, self.state_dir)
        args, env = tell_script(spec, choice)
        refused, world = None, None
        try:  # the new attempt's plan, looked at only (no port held, nothing joined)
            plan, _ = prepare_plan(spec, self.state_dir, job.id, attempt=job.attempt + 1, hold_port=False,
                                   resume_tag=choice.chosen.tag if choice.chosen else None)
            world = plan.world_size
            if choice.chosen is not None and choice.chosen.format != "orch":
                check_world(choice.chosen, world)
        except OrchError as err:
            refused = str(err)
        latest = None
        if choice.chosen is not None and spec.resume.rewrites_latest(choice.format):
            before = read_latest(choice.dir)
            latest = {"from": before, "to": choice.chosen.tag} if before != choice.chosen.tag else None
        fresh = None
        if choice.chosen is None:
            try:
                check_reachable(self.store, job.id, choice)
                check_fresh_start(job.id, [a.resume_tag for a in self.store.attempts(job.id) if a.resume_tag], spec,
                                  choice.dir, choice.skipped, False, ever_saved=bool(choice.damaged))
                fresh = "no checkpoint was ever saved: the attempt starts from step 0"
            except CheckpointError as err:
                fresh = str(err)
        return {"job": job.id, "state": job.state.value, "checkpoints": choice.to_dict(),
                "resume_tag": choice.chosen.tag if choice.chosen else None, "resume_args": list(args),
                "resume_env": env, "latest": latest, "fresh_start": fresh, "world_size": world, "refused": refused}

    def _check_resumable(self, job: JobRecord) -> None:
        """A job can be resumed once it is FAILED or CANCELLED and its last attempt has stopped (waited
        for when this controller runs it).

        Raises:
            StateError: it is not, or its attempt (run by another controller) is still stopping.
        """
        if not job.state.is_resumable():
            hint = (f" Cancel it first (orch cancel {job.id}) to resume it from its last checkpoint."
                    if not job.state.is_terminal() else "")
            raise StateError(f"Job {job.id} is {job.state.value}; only FAILED or CANCELLED jobs can be "
                             f"resumed.{hint}")
        run = self._runs.get(job.id)
        if run is not None:
            run.done.wait()
        elif job.attempt and self.store.get_attempt(job.id, job.attempt).stopped_at is None \
                and owner_alive(job.owner):
            raise StateError(f"Job {job.id}'s attempt {job.attempt} is still stopping; try again shortly.")

    def cancel(self, job_id: str, reason: str = "cancelled by the user") -> JobRecord:
        """Cancel a job: its ranks are stopped within the grace period.

        A job run by another controller is cancelled through the store (that controller
        polls for requests). A FAILED job waiting for an automatic restart keeps its state
        and is not restarted. Cancelling a job that already ended is otherwise a no-op.
        """
        job = self.store.get_job(job_id)
        if job.state.is_terminal():
            self.warm.retire(job.id)
            if not self.restarts.call_off(job.id, reason) and owner_alive(job.owner) \
                    and job.owner != self.owner:
                self.store.request_cancel(job.id)  # its controller may have a restart pending
            return self.store.get_job(job.id)
        run = self.active_run(job.id) or self._waiting(job.id)
        if run is not None:
            run.cancel(reason)
        elif owner_alive(job.owner):
            self.store.request_cancel(job.id)
        else:  # its controller is gone (and with it the agents): sweep, then record
            queued = waits_for_nodes(self.store, job)
            if job.attempt:  # (agents awaiting a new server, then their ranks)
                sweep_attempt(self.store, job.id, job.attempt)
            self.store.set_state(job.id, JobState.CANCELLED, queued=queued,
                                 cause={"kind": "cancelled", "message": "cancelled by the user"})
            if job.attempt and not queued:
                self.store.mark_stopped(job.id, job.attempt)
        return self.store.get_job(job.id)

    def stacks(self, job_id: str, rank: int | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """Every running rank's (or ``rank``'s) Python stacks now (``orch stacks``; the report:
        :meth:`~.attempt.AttemptRun.stack_report`). Raises NotFoundError (no such job or rank), StateError (this
        controller does not run it now)."""
        job = self.store.get_job(job_id)
        if (run := self.active_run(job.id)) is None or run.state != JobState.RUNNING:
            raise StateError(f"Job {job.id} is {job.state.value}, not running under this controller: there are no "
                             "stacks to dump (orch logs shows what its ranks printed).")
        return run.stack_report(rank, timeout)

    def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait until the job's current attempt ended, its processes are gone and no automatic
        restart is pending (a restart's attempt is waited for too)."""
        job = self.store.get_job(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy(job.id) and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)
        return self.store.get_job(job.id)

    def unrecorded(self, job_id: str) -> dict[str, Any] | None:
        """What this controller knows of a job that its store could not record (a full disk): ``{"state",
        "cause", "message"}`` of its attempt, or None when the store is up to date."""
        with self._lock:
            run = self._runs.get(job_id)
        if run is None or not run.unrecorded:
            return None
        return {"state": run.state.value, "cause": run.cause,
                "message": f"the state database cannot be written (disk full): {len(run.unrecorded)} change(s) of "
                           f"attempt {run.plan.attempt} are not recorded yet and are retried; it is {run.state.value}"}

    def busy(self, job_id: str) -> bool:
        """Whether this controller runs an attempt of the job or will restart it."""
        if self.restarts.is_pending(job_id):
            return True
        if self._waiting(job_id) is not None:
            return True
        with self._lock:
            return job_id in self._runs and not self._runs[job_id].done.is_set()

    def _waiting(self, job_id: str) -> QueuedAttempt | None:
        """The job's attempt this controller has waiting for its nodes, if it still waits."""
        with self._lock:
            queued = self._queued.get(job_id)
        return queued if queued is not None and not queued.done.is_set() else None

    # -- automatic restarts (the spec's restart policy: .restarts) -----------------------------

    def _attempt_ended(self, run: AttemptRun) -> None:
        """After an attempt stopped: mark its start checkpoint bad if a rank crashed loading it, then restart
        the job later if its policy says so."""
        try:
            mark_if_crashed_loading(self.store, run.plan, resume_dir_of(run.spec, self.state_dir, run.job_id))
        except Exception:  # noqa: BLE001 - the store is closing at shutdown: nothing to mark, the restart decides
            pass
        if self._closed.is_set() or not self.restarts.apply(run.job_id, run.spec, run.plan.attempt):
            self.warm.retire(run.job_id)  # no restart: the agents kept for one end now (or wait for other jobs)

    def _restart(self, job_id: str, exclude: list[str]) -> Any:
        """An automatic restart (the restart policy's): :meth:`resume`; the agents kept warm for it end if it
        cannot start."""
        try:
            return self.resume(job_id, exclude_hosts=exclude, automatic=True)
        except BaseException:
            self.warm.retire(job_id)
            raise

    def recover(self) -> list[str]:
        """Fail the jobs whose controller died while they ran (see :func:`recover_orphans`).

        An ``orch server`` (a controller with an ``owner_url``) then applies each such job's
        restart policy, as for any failed attempt (cause ``controller_lost``), when an orch
        server was running it: so a killed server's jobs continue from their last complete
        checkpoint once a server runs again. A killed ``orch run``'s job stays FAILED for
        ``orch resume``: nobody watches it any more. Returns the ids failed now.
        """
        if self.owner.get("url") and not self._closed.is_set():
            self._take_over()
        recovered = recover_orphans(self.store, patient=not self.owner.get("url"))
        if self.owner.get("url") and not self._closed.is_set():
            for job_id in self.restarts.lost_server_jobs(recovered):
                try:
                    job = self.store.get_job(job_id)
                    self.restarts.apply(job.id, spec_from_dict(job.spec, source=f"job {job.id}"), job.attempt)
                except OrchError as err:
                    self.restarts.log_failure(job_id, f"cannot decide on a restart: {err}")
        return recovered

    def _take_over(self) -> None:
        """Supervise, without stopping a rank, the RUNNING attempts of servers that died (:mod:`.reattach`)."""
        for job in self.store.active_jobs():
            if owner_alive(job.owner) or self.active_run(job.id) is not None:
                continue
            run = take_over(self.store, job, self._services, self.owner, self.provisioner_factory)
            if run is not None:
                with self._lock:
                    self._runs[job.id] = run
                run.start()

    def close(self, cancel: bool = True, timeout: float = 60.0,
              reason: str = "cancelled: the controller running it shut down") -> None:
        """Stop serving: cancel (or leave) every attempt this controller runs, wait for them."""
        self._closed.set()
        self.restarts.close()
        self.warm.close()
        with self._lock:
            queued = list(self._queued.values())
        for waiting in queued:  # first: a queued attempt granted meanwhile becomes a run
            if not waiting.done.is_set():
                waiting.cancel(reason)
        for waiting in queued:
            waiting.done.wait(timeout)
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            if cancel and not run.done.is_set():
                run.cancel(reason)
        for run in runs:
            run.done.wait(timeout)
        if self.alive is not None:
            self.alive.remove()
        self.store.close()

    # -- internals ----------------------------------------------------------------------------

    def _start_attempt(self, spec: JobSpec, plan: JobPlan, lease: PortLease, provisioner: Provisioner) -> None:
        os.makedirs(os.path.join(plan.run_dir, "logs"), exist_ok=True)
        if spec.deepspeed_config is not None or plan.deepspeed_config:  # or built from an Accelerate config
            with open(plan.deepspeed_config_path, "w") as f:
                json.dump(plan.deepspeed_config, f, indent=2)
        with open(os.path.join(plan.run_dir, "plan.json"), "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
        self.store.add_attempt(plan.job_id, plan.attempt, plan.to_dict(), plan.resume_tag)
        self.metrics.attempt_started(plan.attempt)
        run = AttemptRun(self._services, spec, plan, lease, provisioner)
        with self._lock:
            self._runs[plan.job_id] = run
        run.start()

    def _watch_requests(self) -> None:
        last_recover = time.monotonic()
        while not self._closed.wait(0.25):
            if self.alive is not None:
                self.alive.touch()
            if self.recover_every_s and time.monotonic() - last_recover > self.recover_every_s:
                last_recover = time.monotonic()
                try:
                    self.recover()
                except Exception:  # noqa: BLE001 - the store may be closing
                    pass
            with self._lock:
                runs = [r for r in [*self._runs.values(), *self._queued.values()] if not r.done.is_set()]
            for run in runs:
                try:
                    if self.store.get_job(run.job_id).cancel_requested:
                        run.cancel()
                except (OrchError, Exception):  # noqa: BLE001 - store closed at shutdown
                    continue
            for job_id in self.restarts.pending():
                try:
                    if self.store.get_job(job_id).cancel_requested:
                        self.restarts.call_off(job_id, "cancelled by the user")
                except (OrchError, Exception):  # noqa: BLE001 - store closed at shutdown
                    continue
