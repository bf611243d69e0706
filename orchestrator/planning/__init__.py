"""Where every rank runs: DeepSpeed hostfiles and filters, the resource pool, the job plan (pure).

May import: ``orchestrator.errors``, ``orchestrator.launchers``, ``orchestrator.spec``. No I/O but
reading a hostfile; no processes, sockets or locks (the controller gathers those inputs:
``orchestrator.supervision.prepare``).
"""

from .hostfile import Hostfile, load_hostfile, parse_hostfile
from .plan import JobPlan, NodePlan, PlanInputs, RankPlan, make_plan, orch_env
from .pool import ResourcePool, parse_filter, resolve_pool

__all__ = ["Hostfile", "ResourcePool", "load_hostfile", "parse_hostfile", "parse_filter", "resolve_pool",
           "PlanInputs", "RankPlan", "NodePlan", "JobPlan", "make_plan", "orch_env"]
