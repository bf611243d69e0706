"""A new ``orch server`` takes over the running attempts of one that died, without stopping a rank.

An ``orch server`` records itself as the owner of its jobs with ``reattach_s`` (its agents' window,
:attr:`~.settings.Timings.reattach_s`) and an alive file whose modification time it renews every
second (:class:`AliveFile`). When it dies (``kill -9``, a crash, the machine's OOM killer), the
agents of its RUNNING attempts keep their ranks running for ``reattach_s`` and listen for a new
controller (``agents.attach``). The next server's :func:`take_over` links to each of them
(:meth:`~.attempt.AttemptRun._reattach`): the attempt goes on as if nothing happened (events
``reattaching``, ``agent_reattached``, ``reattached``), and no step is lost. An agent that cannot be
reached fails the attempt with ``controller_lost``, which every restart policy retries.

Until an owner's window has passed, a command that finds its jobs orphaned leaves them alone
(:func:`awaiting_reattach`): their ranks still run, and a server may yet take them over.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import OrchError, PlanError
from ..provisioners import REATTACHING
from ..store import JobRecord, JobState, Store

if TYPE_CHECKING:  # (take_over imports them: a command that only asks awaiting_reattach loads none of them)
    from ..provisioners import Provisioner
    from ..spec import JobSpec
    from .attempt import AttemptRun, AttemptServices

__all__ = ["AliveFile", "awaiting_reattach", "take_over"]

#: Slack added to an owner's window for the agents' own clock and the alive file's last renewal (seconds).
SLACK_S = 2.0


class AliveFile:
    """``<state dir>/controller-<pid>.alive``: its mtime says when the controller was last alive.

    Args:
        state_dir: the controller's state directory.
        pid: the controller's process id.
    """

    def __init__(self, state_dir: Path, pid: int) -> None:
        self.path = Path(state_dir) / f"controller-{pid}.alive"
        self._touched = 0.0

    def touch(self, every_s: float = 1.0) -> None:
        """Renew the mtime (at most every ``every_s`` seconds; works on a full disk too)."""
        now = time.monotonic()
        if now - self._touched < every_s:
            return
        self._touched = now
        try:
            self.path.touch()
        except OSError:
            pass

    def remove(self) -> None:
        """The controller shuts down cleanly."""
        try:
            self.path.unlink()
        except OSError:
            pass


def last_alive(owner: dict[str, Any] | None) -> float | None:
    """When the owner was last alive (epoch seconds, from its alive file), or None if it has none."""
    path = (owner or {}).get("alive")
    if not path:
        return None
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def awaiting_reattach(job: JobRecord, now: float | None = None) -> float:
    """Seconds left in which a new server may still take over ``job``'s running ranks after its owner died
    (0: none: it was not RUNNING or PROVISIONING, its provisioner cannot re-attach, its owner gave no window,
    or it passed). PROVISIONING counts: the owner may have died after the ranks started, before it recorded so."""
    owner = job.owner or {}
    window = float(owner.get("reattach_s") or 0)
    seen = last_alive(owner)
    if job.state not in (JobState.RUNNING, JobState.PROVISIONING) or window <= 0 or seen is None \
            or (job.spec or {}).get("provisioner", "local") not in REATTACHING:
        return 0.0
    return max(0.0, seen + window + SLACK_S - (time.time() if now is None else now))


def take_over(store: Store, job: JobRecord, services: "AttemptServices", owner: dict[str, Any],
              provisioner_factory: "Callable[[str, JobSpec], Provisioner]") -> "AttemptRun | None":
    """Start supervising ``job``'s running attempt (its owner died) as ``owner``; None when it cannot be
    (its window passed, its plan or spec cannot be read: :func:`~.orphans.recover_orphans` then fails it).

    The master port's reservation is taken again (the dead owner's lock went with it); if another job took
    the port meanwhile, the attempt goes on without one and says so.
    """
    if awaiting_reattach(job) <= 0:
        return None
    from ..planning import JobPlan
    from ..spec import spec_from_dict
    from .attempt import AttemptRun
    from .ports import PortLease, default_lock_dir, reserve_port
    try:
        spec = spec_from_dict(job.spec, source=f"job {job.id}")
        plan = JobPlan.from_dict(store.get_attempt(job.id, job.attempt).plan)
        provisioner = provisioner_factory(spec.provisioner, spec)
    except (OrchError, KeyError, TypeError, ValueError):
        return None
    if not provisioner.reattaches:
        return None
    try:
        lease = reserve_port(default_lock_dir(), plan.master_port, check_bind=False)
    except (PlanError, OSError):
        lease = PortLease(plan.master_port)
        store.add_event(job.id, job.attempt, "warning", {"message": f"master port {plan.master_port} is reserved by "
                                                                   "another orch job now; the ranks keep using it"})
    store.set_owner(job.id, owner)
    store.add_event(job.id, job.attempt, "reattaching", {"server": owner.get("url"),
                                                         "previous_server": (job.owner or {}).get("url")})
    run = AttemptRun(services, spec, plan, lease, provisioner, adopt=True)
    run.previous_server = (job.owner or {}).get("url")
    return run
