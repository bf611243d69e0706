"""The commands that show jobs: ``list``, ``status``, ``logs``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.table import Table
from rich.text import Text

from ...errors import OrchError
from ...observe.views import kept_words, ops_words
from .backends import pick_backend
from ..limits import MAX_LIST_JOBS
from .output import ago, console, err_console, print_json, printable, styled
from .render import RanksTable, cause_lines, checkpoint_lines, header_line, jobs_table, queue_line, start_checkpoint


def cmd_list(args: argparse.Namespace) -> int:
    """The newest ``--limit`` jobs (``--all``: every one), with each one's step, loss, steps/s and ETA
    (``orchestrator.observe.progress``); says so when there are more."""
    limit = MAX_LIST_JOBS if args.all else args.limit  # --all: every job (the API's cap on one page)
    jobs = pick_backend(args).list(limit + 1)
    cut = len(jobs) > limit
    jobs = jobs[:limit]
    if args.output == "json":
        print_json(jobs)
        if cut:
            err_console.print(f"(the newest {limit} jobs; there are more: --limit N or --all)", highlight=False)
        return 0
    if not jobs:
        console.print("No jobs yet. Run one with `orch run job.yaml`.")
        return 0
    console.print(jobs_table(jobs))
    if cut:
        console.print(f"(the newest {limit} jobs; there are more: --limit N or --all)", highlight=False)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    detail = pick_backend(args).detail(args.job)
    if args.output == "json":
        print_json(detail)
        return 0
    c = console
    c.print(header_line(detail))
    waiting = queue_line(detail)
    if waiting:
        c.print(waiting, markup=False, highlight=False, style="yellow")
    attempts = Table(title="Attempts", box=None, title_justify="left", pad_edge=False)
    for col in ("#", "state", "nodes", "world", "start checkpoint", "started", "cause"):
        attempts.add_column(col, overflow="fold")
    for a in detail["attempts"]:
        attempts.add_row(str(a["number"]), styled(a["state"]), ",".join(a["nodes"]), str(a["world_size"]),
                         start_checkpoint(a), ago(a["created_at"]), (a.get("cause") or {}).get("message") or "")
    c.print(attempts)
    c.print(Text(f"Ranks of attempt {detail['attempt']}", style="bold"))
    c.print(RanksTable(detail))
    for line in stuck_lines(args, detail):
        c.print(line, markup=False, highlight=False, style="yellow")
    for line in cause_lines(detail)[1:]:
        c.print(line, markup=False, highlight=False)
    kept = kept_words(detail.get("agents_kept"))
    if kept:
        c.print(kept, markup=False, highlight=False)
    ops = ops_words(detail.get("ops"))
    if ops:
        c.print(f"DeepSpeed ops (preflight of attempt {detail['attempt']}): {ops}", markup=False, highlight=False)
    for line in checkpoint_lines(detail.get("checkpoints")):
        c.print(line, markup=False, highlight=False)
    for line in goodput_lines(detail.get("goodput")):
        c.print(line, markup=False, highlight=False)
    for step in detail.get("next_steps") or []:
        c.print(f"next: {step}", markup=False, highlight=False)
    return 0


def goodput_lines(goodput: dict | None) -> list[str]:
    """``Goodput`` (docs/goodput.md): one line per category with its seconds and share of the wall time, then
    the effective training time ratio and the lost steps. Empty without a goodput."""
    if not goodput:
        return []
    wall = goodput["wall_seconds"]
    lines = [f"Goodput over {wall:.1f} s of wall time" + (" (so far)" if goodput.get("running") else "") + ":"]
    for category, seconds in goodput["seconds"].items():
        lines.append(f"  {category:<18} {seconds:10.1f} s {goodput['percent'][category]:6.1f} %")
    lines.append(f"  effective training time ratio {goodput['effective_ratio']:.3f}; lost steps "
                 f"{goodput['lost_steps']}")
    return lines


def stuck_lines(args: argparse.Namespace, detail: dict) -> list[str]:
    """For a RUNNING job, each running rank with no progress for ``args.stuck_after`` seconds (no step since
    then, or none since it started) and where it is now: the innermost frame of its main thread, dumped as
    ``orch stacks`` dumps it. Empty when every rank moves (or ``--stuck-after 0``)."""
    if detail["state"] != "RUNNING" or not getattr(args, "stuck_after", 0):
        return []
    now = time.time()
    quiet = {r["global_rank"]: now - r["progress_at"] for r in detail["ranks"]
             if r["state"] == "running" and r.get("progress_at") and now - r["progress_at"] >= args.stuck_after}
    if not quiet:
        return []
    try:
        dumps = pick_backend(args).stacks(detail["id"], next(iter(quiet)) if len(quiet) == 1 else None)["ranks"]
    except OrchError as err:
        dumps = {str(rank): {"error": str(err)} for rank in quiet}
    lines = []
    for rank, seconds in sorted(quiet.items()):
        d = dumps.get(str(rank)) or {"error": "no dump"}
        where = f"now in {d['where']}" if d.get("where") else f"its stacks: {d.get('error')}"
        lines.append(f"rank {rank}: no progress for {seconds:.0f} s; {where} (orch stacks {detail['id']} "
                     f"--rank {rank})")
    return lines


def cmd_logs(args: argparse.Namespace) -> int:
    backend = pick_backend(args)
    detail = backend.detail(args.job)
    ranks = [args.rank] if args.rank is not None else [r["global_rank"] for r in detail["ranks"]]
    prefix = args.rank is None
    offsets = {r: (-1 if args.tail else 0) for r in ranks}
    while True:
        all_eof = True
        for r in ranks:
            chunk = backend.logs(detail["id"], r, args.attempt, offsets[r])
            offsets[r] = chunk["offset"]
            all_eof &= chunk["eof"]
            if args.output == "json":  # one JSON object per line, per rank and chunk
                lines = chunk["data"].splitlines()[-args.tail:] if args.tail else chunk["data"].splitlines()
                if lines:
                    sys.stdout.write(json.dumps({"rank": r, "lines": lines}) + "\n")
                    sys.stdout.flush()
            else:
                _write_lines(chunk["data"], f"[rank {r}] " if prefix else "", args.tail)
        if not args.follow or all_eof:
            return 0
        time.sleep(0.5)


def _write_lines(data: str, prefix: str, tail: int | None) -> None:
    if not data:
        return
    lines = data.splitlines()
    if tail:
        lines = lines[-tail:]
    sys.stdout.write("".join(f"{prefix}{printable(ln)}\n" for ln in lines))
    sys.stdout.flush()


def cmd_stacks(args: argparse.Namespace) -> int:
    """``orch stacks JOB [--rank N]``: what every running rank (or one) is doing now, from py-spy dumps."""
    report = pick_backend(args).stacks(args.job, args.rank)
    if args.output == "json":
        print_json(report)
        return 0
    c = console
    if not report["ranks"]:
        c.print(f"job {report['job']}: no running rank to dump", markup=False, highlight=False)
    for rank, d in report["ranks"].items():
        if d.get("error"):
            c.print(f"rank {rank}: cannot dump its stacks: {d['error']}", markup=False, highlight=False)
            continue
        c.print(Text(f"rank {rank}: {d.get('doing') or 'in ' + str(d.get('where') or '?')}", style="bold"))
        for frame in d.get("frames") or []:
            c.print(f"    {frame}", markup=False, highlight=False)
        if d.get("file"):
            c.print(f"  (every thread: {d['file']})", markup=False, highlight=False)
    if report.get("silent_nodes"):
        c.print(f"node(s) {', '.join(map(str, report['silent_nodes']))} did not answer in time", markup=False,
                highlight=False, style="yellow")
    return 0
