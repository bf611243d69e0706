"""Running jobs: the controller (submit, cancel, resume, restart policy, orphans) and the supervision of
one attempt (provisioning, preflight, messages, watches, teardown).

May import: every package above it (``errors``, ``launchers``, ``spec``, ``planning``, ``checkpoints``,
``store``, ``observe``, ``provisioners``) and ``agents``; nothing of ``orchestrator.face``.
"""

from .controller import AttemptRun, Controller, default_state_dir, new_job_id, prepare_plan, rank_log_tail, recover_orphans

__all__ = ["Controller", "AttemptRun", "prepare_plan", "recover_orphans", "default_state_dir", "new_job_id",
           "rank_log_tail"]
