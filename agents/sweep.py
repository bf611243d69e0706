"""Kill what is left of an attempt on this machine: ``python -m agents.sweep ATTEMPT_ID``.

Run by a provisioner on each node once the attempt is over (the ssh provisioner runs it
over SSH): it SIGKILLs every process whose environment marks it as a rank of that attempt
(``ORCH_ATTEMPT_ID``) and, with ``--agents``, its agents (``ORCH_AGENT_ATTEMPT_ID``); with
``--node-rank N`` only that node's processes, and first every process of that node's cgroup
(``agents.cgroups``: what left the markers behind too). Prints the killed pids as a JSON list.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cgroups
from .ranks import kill_marked

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0."""
    p = argparse.ArgumentParser(prog="python -m agents.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("attempt_id")
    p.add_argument("--agents", action="store_true", help="also kill the attempt's agents")
    p.add_argument("--node-rank", type=int, default=None)
    args = p.parse_args(argv)
    killed = []
    if args.node_rank is not None:
        killed += cgroups.sweep(args.attempt_id, [args.node_rank])
    if args.agents:
        killed += kill_marked(args.attempt_id, node_rank=args.node_rank, key="ORCH_AGENT_ATTEMPT_ID",
                              node_key="ORCH_AGENT_NODE_RANK")
    killed += kill_marked(args.attempt_id, node_rank=args.node_rank)
    print(json.dumps(killed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
