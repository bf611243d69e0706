"""Job states and the one function that moves a job between them.

A job moves through its states as a unit; each move is a row in the transition table
below, and :func:`check_transition` is the only place that decides whether a move is
legal (the store calls it on every state write)::

    PENDING ──► PROVISIONING ──► RUNNING ──► SUCCEEDED
       │             │              │
       │             ├──────────────┴──► FAILED ─────┐
       └─────────────┴──────────────┴──► CANCELLED ──┤
                                                     │ orch resume: a new attempt
    PENDING ◄────────────────────────────────────────┘

* PENDING: accepted and stored; its next attempt is planned but not started.
* PROVISIONING: agents are being started on the attempt's nodes and start their ranks.
* RUNNING: every agent reported its ranks started.
* SUCCEEDED: every rank of the attempt exited with status 0. Terminal.
* FAILED: the attempt ended with a cause (a rank's exit, a node lost, provisioning
  failed). Terminal for the attempt; ``orch resume`` moves the job back to PENDING with
  a new attempt that starts from the last complete checkpoint.
* CANCELLED: a user cancelled it. Like FAILED, it may be resumed.

The attempt a state belongs to is recorded beside it in the store; moving to a
terminal state does not wait for the attempt's processes to be stopped (that is the
attempt's ``stopped_at``), so failure detection time is not hidden behind teardown.
"""

from __future__ import annotations

from enum import Enum

from ..errors import StateError

__all__ = ["JobState", "TRANSITIONS", "check_transition", "can_transition"]


class JobState(str, Enum):
    """The state of a job (and of its current attempt)."""

    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        """True for states in which no attempt runs (SUCCEEDED, FAILED, CANCELLED)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    def is_resumable(self) -> bool:
        """True for states ``orch resume`` may leave (FAILED, CANCELLED)."""
        return self in (JobState.FAILED, JobState.CANCELLED)


#: Every legal move: ``TRANSITIONS[current]`` is the set of states a job may enter next.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PROVISIONING, JobState.FAILED, JobState.CANCELLED}),
    JobState.PROVISIONING: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset({JobState.PENDING}),
    JobState.CANCELLED: frozenset({JobState.PENDING}),
}


def can_transition(current: JobState, new: JobState) -> bool:
    """Return whether a job in ``current`` may move to ``new`` (see :data:`TRANSITIONS`)."""
    return new in TRANSITIONS[JobState(current)]


def check_transition(job_id: str, current: JobState, new: JobState) -> None:
    """Refuse an illegal move.

    Raises:
        StateError: ``new`` is not in ``TRANSITIONS[current]``; the message names the job,
            both states and the states that are allowed from ``current``.
    """
    current, new = JobState(current), JobState(new)
    if can_transition(current, new):
        return
    allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (terminal)"
    raise StateError(f"Job {job_id} cannot move from {current.value} to {new.value}; "
                     f"from {current.value} it may move to: {allowed}.")
