"""``orch gc``: remove what the retention rule lets go (docs/housekeeping.md): leftovers of attempts that are
over, and with ``--older-than`` the run directories and checkpoints of jobs finished that long ago. The logic is
``orchestrator.supervision.housekeeping``'s; this module reads the options and prints."""

from __future__ import annotations

import argparse
import re
from typing import Any

from .backends import state_dir_of
from .output import UsageError, console, human_bytes, print_json

__all__ = ["cmd_gc", "gc_options", "age_arg"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def age_arg(text: str) -> float:
    """``--older-than``'s value in seconds: a number and a unit (``s``, ``m``, ``h``, ``d``, ``w``: ``7d``,
    ``12h``, ``1.5w``), or ``0`` (every finished job).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not m or (not m[2] and float(m[1]) != 0):
        raise argparse.ArgumentTypeError(f"takes a number and a unit (s, m, h, d, w), e.g. 7d or 12h, or 0 for "
                                         f"every finished job; got {text!r}")
    return float(m[1]) * _UNITS.get(m[2] or "s", 1)


def gc_options(sp: argparse.ArgumentParser) -> None:
    """``orch gc``'s options."""
    sp.add_argument("--older-than", type=age_arg, default=None, metavar="AGE",
                    help="also remove the run directories (plans, configs, logs) and the checkpoints under the "
                         "state dir of jobs that finished at least AGE ago (7d, 12h, 30m; 0: every finished job); "
                         "the jobs stay in orch list")
    sp.add_argument("--keep-checkpoints", action="store_true",
                    help="with --older-than: remove the run directories only, no checkpoint")
    sp.add_argument("--drop-resume-checkpoints", action="store_true",
                    help="with --older-than: also remove the checkpoint a FAILED or CANCELLED job would resume "
                         "from (it can then only start over: orch resume --fresh)")
    sp.add_argument("--dry-run", action="store_true", help="remove nothing: list what would be removed and its size")



def cmd_gc(args: argparse.Namespace) -> int:
    """Run ``orch gc``; exit status 0, or 1 when something could not be removed (each named)."""
    from ...supervision.housekeeping import run_gc
    if (args.keep_checkpoints or args.drop_resume_checkpoints) and args.older_than is None:
        flag = "--keep-checkpoints" if args.keep_checkpoints else "--drop-resume-checkpoints"
        raise UsageError(f"{flag} applies to the jobs --older-than selects: give --older-than AGE too.")
    if args.keep_checkpoints and args.drop_resume_checkpoints:
        raise UsageError("--keep-checkpoints keeps every checkpoint, --drop-resume-checkpoints removes some: "
                         "give one of them.")
    state_dir = state_dir_of(args)
    result = run_gc(state_dir, dry_run=args.dry_run, older_than_s=args.older_than,
                    keep_checkpoints=args.keep_checkpoints, drop_resume_checkpoints=args.drop_resume_checkpoints)
    if args.output == "json":
        print_json({"state_dir": str(state_dir), **result.to_dict()})
        return 1 if result.failed else 0
    _print(result, str(state_dir))
    return 1 if result.failed else 0


def _line(*parts: Any) -> None:
    console.print(" ".join(str(p) for p in parts if p not in (None, "")), markup=False, highlight=False,
                  soft_wrap=True)


def _print(result: Any, state_dir: str) -> None:
    for job in result.recovered:
        _line(f"job {job}: its controller is gone; recorded as ended (FAILED: controller_lost) before cleaning up")
    verb = "would remove" if result.dry_run else "removed"
    for e in result.entries:
        whose = f"job {e.job}" + (f" attempt {e.attempt}" if e.attempt else "") if e.job else "no job's"
        if e.what == "process":
            _line(f"{'would kill' if result.dry_run else 'killed'} process {e.path}", f"({whose}: {e.why})")
            continue
        failed = result.failed.get(e.path)
        _line(f"{verb if not failed else 'could not remove'} {e.what:<11} {human_bytes(e.bytes):>10}  {e.path}",
              f"({whose}: {failed or e.why})")
    for k in result.kept:
        whose = f"job {k.job}" if k.job else "no job's"
        _line(f"kept {k.path}  ({whose}: {k.why})" if k.path else f"kept {whose}: {k.why}")
    paths = sum(1 for e in result.entries if e.what != "process" and e.path not in result.failed)
    if not result.entries:
        _line(f"nothing to remove in {state_dir} or left by its jobs' attempts")
    elif result.dry_run:
        _line(f"{verb} {paths} path(s), {human_bytes(result.bytes)}; nothing was removed (--dry-run)")
    else:
        _line(f"{verb} {paths} path(s), {human_bytes(result.bytes)}"
              + (f"; {len(result.failed)} could not be removed" if result.failed else ""))
