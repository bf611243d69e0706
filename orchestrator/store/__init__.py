"""Durable job state: the job states and their one transition table, the SQLite store.

May import: ``orchestrator.errors``.
"""

from .private import make_private, open_state_dir
from .sqlite import AttemptRecord, EventRecord, JobRecord, Store
from .states import TRANSITIONS, JobState, can_transition, check_transition

__all__ = ["JobState", "TRANSITIONS", "check_transition", "can_transition", "Store", "JobRecord", "AttemptRecord",
           "EventRecord", "make_private", "open_state_dir"]
