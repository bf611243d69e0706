"""``orch plan``'s tables of nodes and ranks, bounded for large plans.

A plan of up to :data:`SUMMARY_ABOVE_NODES` nodes is shown whole (its Nodes and Ranks tables up to
:data:`SHOWN_ROWS` rows each). A larger one is summarised unless ``--all``: the counts of nodes, ranks and
slots, the first and last :data:`ENDS` nodes, rank 0's environment in full, the first and last :data:`ENDS`
ranks with what differs from rank 0's, and the first and last :data:`ENDS` of the real tool's commands.
Every row it prints is computed from those nodes and ranks only, so printing costs the same for 64 nodes or
4,096. ``--output json`` is always the whole plan.
"""

from __future__ import annotations

import os
import shlex
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from rich.text import Text

from agents import devices

from .output import console

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["SUMMARY_ABOVE_NODES", "SHOWN_ROWS", "ENDS", "print_layout", "print_real_commands", "ends"]

#: plans of more nodes than this are summarised unless ``orch plan --all``
SUMMARY_ABOVE_NODES = 16
#: rows of the Nodes and Ranks tables of a plan that is not summarised (``--all``: every row)
SHOWN_ROWS = 64
#: nodes, ranks and real commands shown at each end of a summarised plan
ENDS = 3

_T = TypeVar("_T")
#: what ``bind_cores`` does on the nodes (agents/binding.py), as ``orch plan`` says it
_BIND_LINES = {
    "auto": "on nodes whose accelerator is cuda, each rank is pinned to physical cores of its GPU's NUMA node (sysfs), "
            "split evenly among the ranks whose GPUs are on that node; on other nodes, to the node's physical cores "
            "split evenly among its ranks (DeepSpeed's --bind_cores_to_rank); only CPUs the agent may use; "
            "OMP_NUM_THREADS = the rank's core count",
    "map": "each rank is pinned to its slot's CPUs (the Ranks table's slot column), less those the agent may not use; "
           "OMP_NUM_THREADS = their count"}


def ends(items: Sequence[_T], k: int) -> tuple[list[_T], int, list[_T]]:
    """``(the first k, how many are left out, the last k)`` of ``items``; nothing is left out of 2k or fewer."""
    if len(items) <= 2 * k:
        return list(items), 0, []
    return list(items[:k]), len(items) - 2 * k, list(items[-k:])


def _ranges(numbers: Any) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``: a node's slots or ranks, short however many."""
    out: list[str] = []
    for n in numbers:
        if out and int(out[-1].rsplit("-", 1)[-1]) == n - 1:
            first = out[-1].split("-", 1)[0]
            out[-1] = f"{first}-{n}"
        else:
            out.append(str(n))
    return ",".join(out)


def _as_run(env: dict, here: Any, host: str) -> dict:
    """A rank's planned variables as its agent gives them here: slot indices in CUDA_VISIBLE_DEVICES
    mapped to this machine's assigned devices (agents.devices)."""
    try:
        physical = devices.mapped(env, here, host)
    except ValueError:
        return env
    return {**env, devices.VAR: physical} if physical is not None else env


def _more(count: int, what: str) -> None:
    if count > SHOWN_ROWS:
        console.print(f"  ... and {count - SHOWN_ROWS} more {what} (orch plan --output json lists all {count})",
                      highlight=False)


def _gap(table: Table, left_out: int, what: str) -> None:
    if left_out:
        table.add_row("...", f"({left_out} {what} not shown)", *[""] * (len(table.columns) - 2))


def _counts_line(plan: Any) -> str:
    per_node = Counter(len(n.slots) for n in plan.nodes)
    slots = sum(count * n for count, n in per_node.items())
    shape = (f"{next(iter(per_node))} per node" if len(per_node) == 1 else
             f"{min(per_node)}-{max(per_node)} per node")
    return (f"Summary: {len(plan.nodes)} nodes, {plan.world_size} ranks, {slots} slots ({shape}); shown: the first "
            f"and last {ENDS} nodes and ranks, rank 0's environment in full (orch plan --all: every node and rank; "
            "--output json: the whole plan)")


def _nodes_table(plan: Any, interfaces: dict[int, str], nodes: Sequence[Any], left_out: int,
                 tail: Sequence[Any]) -> Table:
    from rich.table import Table  # here: orch plan --output json shows no table (~9 ms of imports)
    table = Table(title="Nodes", box=None, title_justify="left", pad_edge=False)
    for col in ("node rank", "host", "slots", "global ranks", "metrics", "collectives' interface"):
        table.add_column(col, overflow="fold")

    def row(n: Any) -> None:
        table.add_row(str(n.node_rank), n.host, _ranges(n.slots), _ranges([r.global_rank for r in n.ranks]),
                      f":{n.metrics_port}/metrics" if n.metrics_port else "-", interfaces.get(n.node_rank, "-"))
    for n in nodes:
        row(n)
    _gap(table, left_out, "nodes")
    for n in tail:
        row(n)
    return table


def _ranks_table(rows: Sequence[tuple[Any, Any, dict]], common: dict, here: Any, left_out: int = 0,
                 split: int = 0) -> Table:
    """The Ranks table: ``rows`` of (node, rank, its environment as run), with ``left_out`` ranks not shown
    after the first ``split`` rows."""
    from rich.table import Table
    table = Table(title="Ranks", box=None, title_justify="left", pad_edge=False)
    for col in ("rank", "node", "local rank", "slot", "rank's own environment", "command line"):
        table.add_column(col, overflow="fold")
    for i, (n, r, env) in enumerate(rows):
        if left_out and i == split:
            _gap(table, left_out, "ranks")
        own = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if common.get(k) != v)
        physical = devices.describe(here, [r.slot])
        slot = f"{r.slot} (device {physical[0]})" if physical else str(r.slot)
        if isinstance(n.bind_cores, dict):  # bind_cores as a map: the slot's CPUs (agents.binding)
            slot += f", CPUs {n.bind_cores.get(r.slot, n.bind_cores.get(str(r.slot), 'none: not in bind_cores'))}"
        table.add_row(str(r.global_rank), f"{n.host} ({n.node_rank})", str(r.local_rank), slot, own,
                      shlex.join(r.argv))
    return table


def _print_env(title: str, env: dict) -> None:
    console.print(Text(title, style="bold"))
    for k in sorted(env):
        console.print(f"  {k}={shlex.quote(env[k])}", markup=False, highlight=False, soft_wrap=True)


def _print_from_files(plan: Any) -> None:
    from_files = plan.nodes[0].env_from_file if plan.nodes else {}
    if from_files:
        console.print("  read on each node when its ranks start (env_from_file; never stored): "
                      + ", ".join(f"{k} from {v}" for k, v in sorted(from_files.items())), markup=False,
                      highlight=False, soft_wrap=True)
    layers = dict(plan.nodes[0].accelerator_env) if plan.nodes else {}  # orchestrator.planning.node_layers
    cuda = layers.pop("cuda", None)
    if cuda:
        console.print("  on nodes whose accelerator is cuda, where the node's own environment lacks them (as "
                      "DeepSpeed's runner exports them from a GPU head node): "
                      + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cuda.items())),
                      markup=False, highlight=False, soft_wrap=True)
    if layers:
        console.print(f"  (and for nodes whose accelerator is {', '.join(layers)}: that accelerator's exports, "
                      "likewise; orch plan --output json lists them)", markup=False, highlight=False, soft_wrap=True)
    bind = plan.nodes[0].bind_cores if plan.nodes else "off"
    if bind != "off":
        kind = "auto" if bind == "auto" else "map"
        console.print(f"  bind_cores {kind}: {_BIND_LINES[kind]}", markup=False, highlight=False, soft_wrap=True)


def print_layout(plan: Any, interfaces: dict[int, str], summary: bool, every: bool) -> Any:
    """Print the Nodes table, the ranks' environment and the Ranks table of ``plan``: summarised (module
    docstring) when ``summary``; else every node and rank when ``every`` (``--all``), else up to
    :data:`SHOWN_ROWS` rows each. Returns the node environment the ranks were shown in (this process's for
    local agents, else empty), for the devices line."""
    here = os.environ if plan.provisioner == "local" else {}  # local agents' node environment is this one
    if summary:
        console.print(_counts_line(plan), markup=False, highlight=False, soft_wrap=True)
        head, left_out, tail = ends(plan.nodes, ENDS)
        console.print(_nodes_table(plan, interfaces, head, left_out, tail))
        pairs = plan.ranks()
        first, skipped, last = ends(pairs, ENDS)
        rows = [(n, r, _as_run(dict(r.env), here, n.host)) for n, r in first + last]
        rank0 = rows[0][2]
        _print_env("Environment of rank 0, in full (over its node's own; other ranks: what differs, below):", rank0)
        _print_from_files(plan)
        console.print(_ranks_table(rows, rank0, here, skipped, len(first)))
        return here
    shown = plan.nodes if every else plan.nodes[:SHOWN_ROWS]
    console.print(_nodes_table(plan, interfaces, shown, 0, ()))
    if not every:
        _more(len(plan.nodes), "nodes")
    pairs = plan.ranks()
    envs = [_as_run(dict(r.env), here, n.host) for n, r in pairs]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    _print_env("Environment of every rank (over its node's own):", common)
    _print_from_files(plan)
    rows = [(n, r, env) for (n, r), env in zip(pairs, envs)]
    console.print(_ranks_table(rows if every else rows[:SHOWN_ROWS], common, here))
    if not every:
        _more(len(pairs), "ranks")
    return here


def print_real_commands(plan: Any, summary: bool) -> None:
    """``What the real <launcher> launcher would run:`` and its commands (summarised: the first and last
    :data:`ENDS`, and how many are left out)."""
    console.print(Text(f"What the real {plan.launcher} launcher would run:", style="bold"))
    head, left_out, tail = ends(plan.real_commands, ENDS) if summary else (list(plan.real_commands), 0, [])

    def show(cmd: Any) -> None:
        where = f"on {cmd.where}" if cmd.where else "on the launching machine"
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        console.print(f"  {where}: {prefix + ' ' if prefix else ''}{shlex.join(cmd.argv)}", markup=False,
                      highlight=False, soft_wrap=True)
    for cmd in head:
        show(cmd)
    if left_out:
        console.print(f"  ... and {left_out} more commands (orch plan --all lists them)",
                      markup=False, highlight=False)
    for cmd in tail:
        show(cmd)
