"""Running jobs: the controller (submit, cancel, resume, restart policy, orphans) and the supervision of
one attempt (provisioning, preflight, messages, watches, teardown).

May import: every package before it (``errors``, ``launchers``, ``spec``, ``planning``, ``checkpoints``,
``store``, ``observe``, ``provisioners``) and ``agents``; nothing of ``orchestrator.face``.

Modules, in the order a job meets them: :mod:`.controller` (jobs), :mod:`.prepare` (the I/O part of
planning an attempt), :mod:`.ports` (master ports), :mod:`.attempt` (one attempt's lifecycle),
:mod:`.messages` (what each agent message does: the one table of handlers), :mod:`.provisioning`,
:mod:`.preflight`, :mod:`.watches` (node silence, hangs), :mod:`.teardown`, :mod:`.restarts` (the
restart policy), :mod:`.resume` (where a resume starts), :mod:`.orphans` (jobs whose controller died),
:mod:`.settings` (deadlines), :mod:`.pruning` (the spec's checkpoint retention), :mod:`.housekeeping` (``orch gc``).
"""

from typing import TYPE_CHECKING

from .. import lazy_names

#: Where each name lives; imported on first use (PEP 562): ``orch list`` needs the orphan check, not the
#: controller, its provisioners and the planner.
_WHERE = {"AttemptRun": "attempt", "Controller": "controller", "default_state_dir": "settings",
          "new_job_id": "controller", "rank_log_tail": "messages", "recover_orphans": "orphans",
          "prepare_plan": "prepare"}

if TYPE_CHECKING:
    from .attempt import AttemptRun
    from .controller import Controller, new_job_id
    from .settings import default_state_dir
    from .messages import rank_log_tail
    from .orphans import recover_orphans
    from .prepare import prepare_plan


__getattr__ = lazy_names(__name__, _WHERE)

__all__ = ["Controller", "AttemptRun", "prepare_plan", "recover_orphans", "default_state_dir", "new_job_id",
           "rank_log_tail"]
