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
import os
import sys
from typing import Iterable

from . import cgroups
from .attach import attach_dir, node_key, private_dir, remove_points
from .ranks import kill_marked

__all__ = ["main", "sweep_attempt", "carry_record"]


def sweep_attempt(attempt_id: str, node_ranks: Iterable[int], node_rank: int | None = None,
                  agents: bool = True, scratch: str | None = None, monitor: str | None = None,
                  spare: Iterable[int] = ()) -> list[int]:
    """SIGKILL what is left of the attempt on this machine: the cgroups of ``node_ranks`` (``agents.cgroups``),
    then, by their markers, its agents (unless ``agents`` is False) and its ranks (with ``node_rank``: only that
    node's); the sockets of those nodes' agents go too (``agents.attach``), and their scratch under ``scratch``
    (the plan's ``metrics_dir``, with DeepSpeed's ``monitor`` output: ``agents.metrics.remove_scratch``), whose
    agents are gone now. ``spare``: pids left alive (agents kept warm for the next attempt, and their templates;
    ``orchestrator.supervision.warm``), and a warm agent's record of this attempt (:func:`carry_record`) is
    kept for them. Returns the pids killed."""
    nodes = list(node_ranks)
    spared = set(spare)
    killed = cgroups.sweep(attempt_id, nodes)
    if agents:
        killed += _kill_carried(attempt_id, nodes, spared)
        killed += kill_marked(attempt_id, node_rank=node_rank, key="ORCH_AGENT_ATTEMPT_ID",
                              node_key="ORCH_AGENT_NODE_RANK", exclude_pids=list(spared))
    killed += kill_marked(attempt_id, node_rank=node_rank, exclude_pids=list(spared))
    remove_points(attempt_id, nodes)
    from .metrics import remove_scratch  # (prometheus_client: not for `orch list`'s orphan check, which never gets here)
    remove_scratch(scratch, nodes, monitor)
    return killed


def _record(attempt_id: str, node_rank: int) -> str:
    return os.path.join(attach_dir(), f"{node_key(attempt_id, node_rank)}.agent")


def carry_record(attempt_id: str, node_rank: int) -> None:
    """Note that this process, an agent kept warm from an earlier attempt (and so marked with that attempt's
    ``ORCH_AGENT_ATTEMPT_ID``), now serves node ``node_rank`` of ``attempt_id``: the sweep of that attempt
    finds it by this record (its pid and start time). Best effort: without it, the agent still ends with its
    link or its lease."""
    try:
        import psutil
        private_dir(attach_dir())
        with open(_record(attempt_id, node_rank), "w") as f:
            f.write(f"{os.getpid()} {psutil.Process().create_time()}")
    except OSError:
        pass


def _kill_carried(attempt_id: str, node_ranks: list[int], spare: set[int]) -> list[int]:
    """SIGKILL the warm agents that :func:`carry_record` recorded for these nodes of the attempt (if the pid is
    still that process and not in ``spare``); the records go."""
    import psutil
    killed = []
    for node_rank in node_ranks:
        path = _record(attempt_id, node_rank)
        try:
            with open(path) as f:
                pid, started = f.read().split()
            if int(pid) in spare:
                continue
            os.unlink(path)
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - float(started)) < 0.01 and proc.pid != os.getpid():
                proc.kill()
                killed.append(proc.pid)
        except (OSError, ValueError, psutil.Error):
            continue
    return killed


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0."""
    p = argparse.ArgumentParser(prog="python -m agents.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("attempt_id")
    p.add_argument("--agents", action="store_true", help="also kill the attempt's agents")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--scratch", default=None, help="the attempt's scratch directory: remove the node's part")
    p.add_argument("--monitor", default=None, help="DeepSpeed's monitor output under it, to remove too")
    p.add_argument("--spare", type=int, action="append", default=[],
                   help="a pid to leave alive (an agent kept warm for the next attempt); repeatable")
    args = p.parse_args(argv)
    killed = sweep_attempt(args.attempt_id, [] if args.node_rank is None else [args.node_rank],
                           node_rank=args.node_rank, agents=args.agents, scratch=args.scratch, monitor=args.monitor,
                           spare=args.spare)
    print(json.dumps(killed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
