"""Kill what is left of an attempt on this machine: ``python -m agents.sweep ATTEMPT_ID``.

Run by a provisioner on each node once the attempt is over (the ssh provisioner runs it
over SSH): it SIGKILLs every process whose environment marks it as a rank of that attempt
(``ORCH_ATTEMPT_ID``) and, with ``--agents``, its agents (``ORCH_AGENT_ATTEMPT_ID``); with
``--node-rank N`` only that node's processes, and first every process of that node's cgroup
(``agents.cgroups``: what left the markers behind too); with ``--scratch DIR`` (and ``--monitor DIR``) the
nodes' scratch a killed agent left there (``agents.metrics.remove_scratch``). Prints the killed pids as a
JSON list.
:func:`sweep_attempt` is the same sweep for callers in this process (the local provisioner, orch commands
that find an attempt's controller gone).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable

from . import cgroups
from .attach import remove_points
from .ranks import kill_marked

__all__ = ["main", "sweep_attempt"]


def sweep_attempt(attempt_id: str, node_ranks: Iterable[int], node_rank: int | None = None,
                  agents: bool = True, scratch: str | None = None, monitor: str | None = None) -> list[int]:
    """SIGKILL what is left of the attempt on this machine: the cgroups of ``node_ranks`` (``agents.cgroups``),
    then, by their markers, its agents (unless ``agents`` is False) and its ranks (with ``node_rank``: only that
    node's); the sockets of those nodes' agents go too (``agents.attach``), and their scratch under ``scratch``
    (the plan's ``metrics_dir``, with DeepSpeed's ``monitor`` output: ``agents.metrics.remove_scratch``), whose
    agents are gone now. Returns the pids killed."""
    nodes = list(node_ranks)
    killed = cgroups.sweep(attempt_id, nodes)
    if agents:
        killed += kill_marked(attempt_id, node_rank=node_rank, key="ORCH_AGENT_ATTEMPT_ID",
                              node_key="ORCH_AGENT_NODE_RANK")
    killed += kill_marked(attempt_id, node_rank=node_rank)
    remove_points(attempt_id, nodes)
    from .metrics import remove_scratch  # (prometheus_client: not for `orch list`'s orphan check, which never gets here)
    remove_scratch(scratch, nodes, monitor)
    return killed


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0."""
    p = argparse.ArgumentParser(prog="python -m agents.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("attempt_id")
    p.add_argument("--agents", action="store_true", help="also kill the attempt's agents")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--scratch", default=None, help="the attempt's scratch directory: remove the node's part")
    p.add_argument("--monitor", default=None, help="DeepSpeed's monitor output under it, to remove too")
    args = p.parse_args(argv)
    killed = sweep_attempt(args.attempt_id, [] if args.node_rank is None else [args.node_rank],
                           node_rank=args.node_rank, agents=args.agents, scratch=args.scratch, monitor=args.monitor)
    print(json.dumps(killed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
