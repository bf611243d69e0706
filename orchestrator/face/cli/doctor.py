"""``orch doctor SPEC|HOSTFILE``: check every node of a job's plan before running it (its Python, torch,
CUDA, NCCL and DeepSpeed, that they agree across nodes, DeepSpeed's op compatibility, GPUs, free disk and
memory, clock skew, the master port reachable from every node, an all-reduce and the links between pairs
of nodes, and the preflight checks), in parallel, through the agents the job's provisioner starts
(:mod:`orchestrator.supervision.doctor`).

A table of node x check (with a live progress line while the nodes answer), or ``--output json``: one
object ``{"nodes", "checks", "failures", "warnings", "backend", "links", "links_scope", "slowest_link",
"passed"}``. Exit status 0 when every check passed, 1 when
any failed, 2 for bad input (a spec, hostfile or filter that cannot be used).

Its options are parsed with every command's, so this module imports little at the top; the rest when
the command runs.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from rich.text import Text

from ...errors import HostfileError
from .output import UsageError, console, err_console, print_json, printable

__all__ = ["cmd_doctor", "doctor_options"]

_STATUS_STYLE = {"passed": "green", "failed": "bold red", "skipped": "dim", "warning": "yellow"}
_MARK = {"passed": "ok", "failed": "FAIL", "skipped": "-", "warning": "warn"}
#: The slowest links the table's summary lists (JSON has every one).
_LINKS_SHOWN = 5


def doctor_options(sp: argparse.ArgumentParser) -> None:
    """``orch doctor``'s arguments and options."""
    sp.add_argument("target", metavar="SPEC|HOSTFILE", help="a job spec (YAML), or a DeepSpeed hostfile alone "
                    "(then the nodes are reached as a spec with that hostfile would reach them: --provisioner)")
    sp.add_argument("--include", default=None, help="DeepSpeed --include filter, e.g. 'worker-0@worker-1:0,1'")
    sp.add_argument("--exclude", default=None, help="DeepSpeed --exclude filter")
    sp.add_argument("--provisioner", choices=("local", "ssh"), default=None,
                    help="with a hostfile alone: how its hosts are reached (default local; a spec names its own)")
    sp.add_argument("--timeout", type=_positive_seconds, default=120.0, metavar="SECONDS",
                    help="deadline of each phase (starting the agents, the checks, the master port); a node "
                    "that has not answered by then fails, named (default 120)")
    sp.add_argument("--max-skew", type=_positive_seconds, default=2.0, metavar="SECONDS",
                    help="largest clock difference between a node and this machine (default 2)")
    sp.add_argument("--min-bandwidth", type=_positive_gbps, default=None, metavar="GBPS",
                    help="fail every link between two nodes that carries fewer GB/s (10^9 bytes/s each way) in the "
                    "link tests, naming both nodes (default: none; the slowest link is named all the same)")


def _positive(what: str) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > 0, else an error saying ``expected <what> > 0``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {text!r}")
        return value
    return parse


_positive_seconds = _positive("a number of seconds")
_positive_gbps = _positive("a bandwidth in GB/s")


def _is_spec(path: Path) -> bool:
    """A YAML mapping (a job spec) rather than a hostfile's ``host slots=N`` lines."""
    import yaml
    if path.suffix in (".yaml", ".yml"):
        return True
    try:
        data = yaml.safe_load(path.read_text(errors="replace"))
    except (yaml.YAMLError, OSError):
        return False
    return isinstance(data, dict)


def load_target(args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    """The spec to check and the checks that do not apply to it (``entrypoint`` for a hostfile alone).

    Raises:
        HostfileError: the file does not exist or cannot be read.
        SpecError: the spec (or the spec made of the hostfile and options) has problems.
    """
    from ...spec import load_spec, spec_from_dict
    path = Path(os.path.expanduser(args.target))
    if not path.exists():
        raise HostfileError(f"orch doctor: {args.target}: no such file (give a job spec or a hostfile)",
                            path=str(args.target))
    if path.is_dir():
        raise HostfileError(f"orch doctor: {args.target} is a directory, not a job spec or hostfile",
                            path=str(args.target))
    filters = {k: getattr(args, k) for k in ("include", "exclude") if getattr(args, k) is not None}
    if _is_spec(path):
        if args.provisioner is not None:
            raise UsageError(f"--provisioner is for a hostfile alone; the spec {args.target} names its own")
        return load_spec(path, overrides=filters or None), {}
    data = {"name": "doctor", "hostfile": str(path.resolve()), "provisioner": args.provisioner or "local",
            "module": True, "entrypoint": "json", "workdir": os.getcwd(), **filters}
    spec = spec_from_dict(data, os.getcwd(), source=f"(orch doctor {args.target})")
    return spec, {"entrypoint": "a hostfile alone names no entrypoint"}


def cmd_doctor(args: argparse.Namespace) -> int:
    """``orch doctor``: check every node; exit 0 if every check passed, 1 if any failed."""
    from ...provisioners import get_provisioner
    from ...supervision.doctor import DoctorRun
    from ...supervision.doctor_verdict import Limits
    from ...supervision.prepare import prepare_plan
    from .backends import state_dir_of
    spec, skip = load_target(args)
    state_dir = state_dir_of(args)
    job_id = f"doctor-{secrets.token_hex(4)}"
    if spec.provisioner == "ssh" and spec.ssh.connect_timeout > args.timeout:  # every phase within --timeout
        spec = spec.model_copy(update={"ssh": spec.ssh.model_copy(update={"connect_timeout": args.timeout})})
    provisioner = get_provisioner(spec.provisioner, spec)
    plan, lease = prepare_plan(spec, state_dir, job_id, provisioner=provisioner)
    table = args.output != "json"
    try:
        if table:
            console.print(f"orch doctor: {len(plan.nodes)} node(s) through the {plan.provisioner} provisioner, "
                          f"master {plan.master_addr}:{plan.master_port}", markup=False, highlight=False)
        with err_console.status("starting agents", spinner="dots") if table and err_console.is_terminal \
                else _Nothing() as status:
            limits = Limits(max_skew_s=args.max_skew, min_link_gbps=args.min_bandwidth)
            run = DoctorRun(spec, plan, provisioner, timeout_s=args.timeout, limits=limits,
                            skip=skip, progress=_progress_printer(status, table))
            verdict = run.run()
    finally:
        lease.release()
        _remove_run_dir(state_dir, job_id)
    if not table:
        print_json({k: verdict[k] for k in ("nodes", "checks", "failures", "warnings", "backend", "links",
                                            "links_scope", "slowest_link", "passed")})
    else:
        _print_table(verdict)
    return 0 if verdict["passed"] else 1


class _Nothing:
    """A stand-in for rich's status when there is no terminal to show it on."""

    def __enter__(self) -> "_Nothing":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, _text: str) -> None:
        return None


def _progress_printer(status: Any, table: bool) -> Any:
    """The progress callback: rich's live status line on a terminal; else, for the table, one line per
    phase on stderr; nothing for JSON."""
    said: set[str] = set()

    def show(c: dict[str, Any]) -> None:
        line = (f"{c['phase']}: {c['up']}/{c['nodes']} agents up, preflight {c['preflight']}/{c['up']}, reports "
                f"{c['reports']}/{c['up']}, master port {c['port']}, clocks {c['clock']}/{c['up']}, all-reduce "
                f"{c['allreduce']}/{c['up']}")  # the all-reduce's answer carries the link tests
        status.update(line)
        if table and not err_console.is_terminal and c["phase"] not in said:
            said.add(c["phase"])
            err_console.print(f"doctor: {c['phase']}", markup=False, highlight=False)
    return show


def _remove_run_dir(state_dir: Path, job_id: str) -> None:
    """The doctor's run directory (agent logs) goes with it: nothing of it is kept."""
    import shutil
    shutil.rmtree(state_dir / "jobs" / job_id, ignore_errors=True)


def _print_links(verdict: dict[str, Any]) -> None:
    """The all-reduce's backend, the links tested (which pairs) and the slowest few, the slowest named."""
    if verdict.get("backend"):
        console.print(f"all-reduce and link tests: {verdict['backend']}", markup=False, highlight=False)
    measured = sorted((link for link in verdict.get("links") or [] if link.get("gbps") is not None),
                      key=lambda link: link["gbps"])
    if not measured:
        return
    shown = ", ".join(f"{link['a']} <-> {link['b']} {link['gbps']:.3g} GB/s" for link in measured[:_LINKS_SHOWN])
    more = f" (the slowest {_LINKS_SHOWN} of {len(measured)})" if len(measured) > _LINKS_SHOWN else ""
    console.print(printable(f"links ({verdict.get('links_scope')}): {shown}{more}"), markup=False, highlight=False,
                  soft_wrap=True)
    low = verdict.get("slowest_link")
    if low:
        console.print(printable(f"slowest link: {low['a']} <-> {low['b']} ({low['gbps']:.3g} GB/s)"), markup=False,
                      highlight=False, soft_wrap=True)


def _print_table(verdict: dict[str, Any]) -> None:
    """Node x check, each cell the status; then every failure on a line of its own, with its detail."""
    from rich.table import Table
    t = Table(show_lines=False, title="orch doctor")
    t.add_column("node")
    shown = [name for name in verdict["checks"]  # a check skipped on every node is left out (JSON has it)
             if any(c["name"] == name and c["status"] != "skipped" for n in verdict["nodes"] for c in n["checks"])]
    for name in shown:
        t.add_column(name.replace("_", " "), justify="center")
    for node in verdict["nodes"]:
        by_name = {c["name"]: c for c in node["checks"]}
        cells = [Text(printable(f"{node['host']} ({node['node_rank']})"))]
        for name in shown:
            c = by_name.get(name)
            status = c["status"] if c else "skipped"
            cells.append(Text(_MARK.get(status, status), style=_STATUS_STYLE.get(status, "")))
        t.add_row(*cells)
    console.print(t)
    for node in verdict["nodes"]:
        env = (node.get("report") or {})
        if env.get("python"):
            cuda = (f"CUDA {env['cuda']}" + (f", NCCL {env['nccl']}" if env.get("nccl") else "")) if env.get("cuda") \
                else "no CUDA"
            console.print(printable(f"{node['host']}: python {env.get('python')}, torch {env.get('torch')} ({cuda}), "
                                    f"deepspeed {env.get('deepspeed') or 'not found'}, accelerator "
                                    f"{env.get('accelerator') or 'unknown'}, {env.get('gpus') or 0} GPU(s) visible"),
                          markup=False, highlight=False, soft_wrap=True)
    _print_links(verdict)
    for w in verdict.get("warnings") or []:
        console.print(Text(printable(f"WARNING {w['text']}"), style="yellow"), soft_wrap=True)
    for f in verdict["failures"]:
        console.print(Text(printable(f"FAILED {f['text']}"), style="red"), soft_wrap=True)
    passed = sum(1 for n in verdict["nodes"] for c in n["checks"] if c["status"] == "passed")
    words = "every check passed" if verdict["passed"] else f"{len(verdict['failures'])} check(s) failed"
    if verdict.get("warnings"):
        words += f", {len(verdict['warnings'])} warning(s)"
    console.print(Text(f"{words} ({passed} passed) on {len(verdict['nodes'])} node(s)",
                       style="green" if verdict["passed"] else "bold red"))
