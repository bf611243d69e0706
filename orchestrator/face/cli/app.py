"""The ``orch`` command.

``orch run`` and ``orch plan`` work on their own (the controller runs embedded in the
command). ``orch server`` runs the controller as a service with an HTTP API; ``orch
submit`` needs it, and ``list``, ``status``, ``logs``, ``cancel`` and ``resume`` use it
when one is running for the state directory (or ``--server`` names one), and otherwise
work on the state directory directly (``resume`` then runs the job in the foreground,
like ``orch run``). Every command takes ``--output json`` for scripts.

Exit status: 0 success (for ``run``/``resume``: the job SUCCEEDED); 1 the job FAILED or
was cancelled; 2 bad input (spec, hostfile, filter, port...) or an unknown job; 130
interrupted.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Callable, Iterable

from rich.text import Text

from ... import __version__
from ...errors import OrchError
from .gc import gc_options
from .dropin import DROPINS, dropin_help, run_dropin
from .options import common_options, host_list, job_arguments, positive_int, seconds_arg, tcp_port
from .output import Parser, err_console, print_json, printable
from .server import DEFAULT_PORT

__all__ = ["main"]


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``orchestrator.face.cli.<module>``, imported when it runs: a command loads only
    what it uses (the spec's models, the store, the controller, rich's tables), not what every other needs."""
    def run(args: argparse.Namespace) -> int:
        import importlib
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(args)
    run.__name__ = name
    return run


cmd_plan, cmd_run, cmd_submit = _lazy("jobs", "cmd_plan"), _lazy("jobs", "cmd_run"), _lazy("jobs", "cmd_submit")
cmd_cancel, cmd_resume = _lazy("jobs", "cmd_cancel"), _lazy("jobs", "cmd_resume")
cmd_list, cmd_logs = _lazy("show", "cmd_list"), _lazy("show", "cmd_logs")
cmd_stacks, cmd_status = _lazy("show", "cmd_stacks"), _lazy("show", "cmd_status")
cmd_export, cmd_gc, cmd_server = _lazy("export", "cmd_export"), _lazy("gc", "cmd_gc"), _lazy("server", "cmd_server")
cmd_doctor = _lazy("doctor", "cmd_doctor")


def _submit_and_list(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``orch submit`` and ``orch list``."""
    sp = add("submit", cmd_submit, "Submit a job to the running orch server and return at once.")
    job_arguments(sp)
    sp.add_argument("--idempotency-key", metavar="KEY", default=None,
                    help="submit at most once under KEY: a repeat with the same KEY (a script's retry) returns the "
                         "job the first made (default: a new key per invocation; its own retries reuse it)")
    sp = add("list", cmd_list, "List jobs, newest first.")
    sp.add_argument("--limit", type=positive_int, default=50, metavar="N", help="the newest N jobs (default 50)")
    sp.add_argument("--all", action="store_true", help="every job")


def _server_options(sp: argparse.ArgumentParser) -> None:
    """``orch server``'s options."""
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine "
                    "only); any other address needs --tls-cert/--tls-key or --insecure-http")
    sp.add_argument("--tls-cert", metavar="PEM", default=None, help="serve HTTPS with this certificate (chain)")
    sp.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's private key")
    sp.add_argument("--insecure-http", action="store_true",
                    help="serve plain HTTP on a non-loopback --host anyway (a warning on every start)")
    sp.add_argument("--allowed-host", action="append", metavar="NAME", default=None,
                    help="one more Host header value to answer to (a DNS alias or proxy name; repeatable); "
                         "loopback and this machine's names and addresses are always allowed")
    sp.add_argument("--port", type=tcp_port, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    sp.add_argument("--prometheus-targets", metavar="DIR", default=None,
                    help="directory for the Prometheus file_sd files of running attempts and of this server "
                         "(default $ORCH_PROMETHEUS_TARGETS or <state dir>/prometheus/targets; see docs/metrics.md)")
    sp.add_argument("--keep-warm", type=_seconds, metavar="SECONDS",
                    default=os.environ.get("ORCH_SERVER_KEEP_WARM_S", "0"),
                    help="keep each ended job's agents (and their imported fork-server templates) up this long for "
                         "the next job on the same hosts, which then starts without connecting, starting agents or "
                         "importing torch again (default $ORCH_SERVER_KEEP_WARM_S or 0: agents end with their job; "
                         "idle agents hold their memory meanwhile; see docs/fast_start.md)")


def _seconds(text: str) -> float:
    """A non-negative number of seconds (``--keep-warm``, and ``$ORCH_SERVER_KEEP_WARM_S``: its default).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number of seconds >= 0, e.g. 300 (so does $ORCH_SERVER_KEEP_WARM_S, "
                                         f"its default); got {text!r}")
    return value


def _plan_options(sp: argparse.ArgumentParser) -> None:
    """``orch plan``'s arguments and options."""
    job_arguments(sp)
    sp.add_argument("--offline", action="store_true", help="plan for hosts this machine cannot reach (names that "
                    "do not resolve here, keys not in known_hosts): checks that need them are skipped and listed")
    sp.add_argument("--all", action="store_true", help="every node, rank and command of a plan of more than 16 nodes "
                    "(default: a summary: counts, the first and last nodes and ranks, rank 0's environment in full)")


def _doctor_command(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``orch doctor`` (face/cli/doctor.py)."""
    from .doctor import doctor_options
    doctor_options(add("doctor", cmd_doctor, "Check every node of a job (or a hostfile) before running it: Python, "
                       "torch, CUDA, NCCL and DeepSpeed versions and that they agree, GPUs, free disk and memory, "
                       "clock skew, the master port reachable from every node, and the preflight checks; in "
                       "parallel, through the job's provisioner. Exit 0 only if every check passed."))


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common_options(common, top=False)
    p = Parser(
        prog="orch", description="Run DeepSpeed ZeRO training jobs across nodes from a job spec: plan them, "
        "supervise every rank, stop them cleanly, resume them from the last complete checkpoint.",
        epilog="Start with: orch plan examples/quickstart.yaml, then orch run examples/quickstart.yaml")
    p.add_argument("--version", action="version", version=f"orch {__version__}")
    common_options(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=help_)
        sp.set_defaults(func=func)
        return sp

    sp = add("plan", cmd_plan, "Show where every rank of a job would run, with its environment and command "
             "line, and the command the real launcher would run. Starts nothing.")
    _plan_options(sp)
    _doctor_command(add)
    sp = add("run", cmd_run, "Run a job in the foreground with live progress; exit 0 only if it succeeds. "
             "Ctrl-C cancels it.")
    job_arguments(sp)
    for name in DROPINS:  # parsed by run_dropin (main); listed here for orch --help
        sub.add_parser(name, help=dropin_help(name), add_help=False)
    sp = add("server", cmd_server, "Run the controller as a service: the HTTP API, the web dashboard (/) and "
             "the controller's Prometheus metrics (/metrics).")
    _server_options(sp)
    _submit_and_list(add)
    sp = add("status", cmd_status, "Show a job: its attempts, their causes, and every rank's state and progress; "
             "for a rank with no progress for a while, where it is now (its stacks).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--stuck-after", type=seconds_arg, default=60.0, metavar="SECONDS",
                    help="show where a running rank is (orch stacks' innermost frame) once it has made no "
                         "progress for SECONDS (default 60; 0: never)")
    sp = add("logs", cmd_logs, "Print a job's rank logs (all ranks, each line prefixed, or one rank).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--rank", type=int, default=None, help="only this global rank, without prefixes")
    sp.add_argument("--attempt", type=int, default=None, help="attempt number (default: the latest)")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the attempt stops")
    sp.add_argument("--tail", type=positive_int, default=None, metavar="N", help="only the last N lines of each log")
    sp = add("stacks", cmd_stacks, "Show what every running rank of a job (or one) is doing now: its Python "
             "stacks, innermost frame first (py-spy dump, through the job's agents; every thread in a file next to "
             "the rank's log).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--rank", type=int, default=None, help="only this global rank")
    sp = add("cancel", cmd_cancel, "Cancel a job: every rank on every node is stopped within the grace period.")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--wait", type=seconds_arg, default=0, metavar="SECONDS",
                    help="wait up to SECONDS for every process to be gone")
    sp = add("resume", cmd_resume, "Start a new attempt of a FAILED or CANCELLED job from its last complete, "
             "undamaged checkpoint, whatever wrote it (orch's contract, DeepSpeed's save_checkpoint, the HF Trainer, "
             "Accelerate's save_state: resume.format), in the foreground unless a server runs it. Each newer "
             "checkpoint skipped is named with why (a file missing, truncated or changed since its save, a crash on "
             "load); the script is told which one to load (resume.args, or DeepSpeed's latest pointed at it).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--exclude", type=host_list, action="extend", default=[], metavar="HOST[,HOST...]",
                    help="leave these hostfile hosts out from now on (e.g. a lost node), so spare hosts take "
                    "their place; may be repeated")
    sp.add_argument("--fresh", action="store_true",
                    help="start from step 0, whatever checkpoints there are (without it, a job that had "
                    "checkpoints but has no complete one is refused); a script that loads DeepSpeed's latest itself "
                    "still loads it (orch warns)")
    sp.add_argument("--dry-run", action="store_true",
                    help="start nothing: list the checkpoints found, check the newest complete one against its "
                    "manifest (hashing its files), and say which one a resume would start from and how the script "
                    "would be told; exit status 2 if a resume would be refused")
    sp = add("export", cmd_export, "Write a job's checkpoint as one consolidated fp32 state_dict file (DeepSpeed's "
             "zero_to_fp32), loadable with torch.load + load_state_dict without DeepSpeed.")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("file", nargs="?", help="the file to write (torch.save format), e.g. model.pt; its directory "
                    "must exist (or give it as --output model.pt)")
    sp.add_argument("--tag", default=None, help="checkpoint tag, e.g. step_100 (default: the newest complete one); "
                    "an incomplete tag is refused")
    gc_options(add("gc", cmd_gc, "Remove what finished attempts left behind (scratch of killed agents, their "
                   "sockets and cgroups, stale files), and with --older-than the logs and checkpoints of jobs "
                   "finished that long ago; never a running job's files (docs/housekeeping.md)."))
    return p


#: options of ``orch`` itself that take a value (common_options), before a command's name
_TOP_VALUED = ("--state-dir", "--output", "-o", "--server", "--token-file")


def _dropin_at(argv: list[str]) -> int | None:
    """Where a drop-in command's name (``orch deepspeed ...``) stands in ``argv``, after orch's own
    options; None for every other command. Its arguments are the real tool's, parsed by its own parser."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in _TOP_VALUED:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return i if word in DROPINS else None
    return None


def main(argv: Iterable[str] | None = None) -> int:
    """Entry point of the ``orch`` console script; returns the exit status."""
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    dropin = _dropin_at(argv)
    if dropin is not None:
        top = parser.parse_args(argv[:dropin] + ["list"])  # the options before the command's name
        top.func = lambda args: run_dropin(argv[dropin], argv[dropin + 1:], args)
        args = top
    else:
        args = parser.parse_args(argv)
    fmt = getattr(args, "output", "table")
    if fmt not in ("table", "json"):
        if getattr(args, "command", None) == "export" and args.file is None:  # orch export JOB --output model.pt
            args.file, args.output = fmt, "table"
        else:
            parser.error(f"argument --output/-o: invalid choice: {fmt!r} (choose from 'table', 'json')")
    try:
        return args.func(args)
    except OrchError as err:
        if getattr(args, "output", None) == "json":
            print_json({"error": str(err), "kind": type(err).__name__})
        # one line: copy, paste, grep; what it quotes (a job id, a spec's value) is shown, never obeyed
        err_console.print(Text(f"error: {printable(str(err))}", style="red"), soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except OSError as err:  # the output cannot be written (a pipe closed by `| head`, a full disk): say so, once
        if err.errno not in (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO) or not _drop_stdout():
            raise
        err_console.print(f"error: cannot write the output ({err.strerror}); orch stopped, and a job it ran in "
                          "the foreground was cancelled (orch status shows it)", markup=False, highlight=False)
        return 1


def _drop_stdout() -> bool:
    """Point standard output at /dev/null (so the interpreter's last flush does not fail again); False when
    it is not standard output that failed (it still takes a write)."""
    try:
        sys.stdout.write("")
        sys.stdout.flush()
        if not _pipe_closed(1):  # (an empty buffer flushes without writing: ask the descriptor itself)
            return False
    except (OSError, ValueError, AttributeError):
        pass
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError:
        pass
    return True


def _pipe_closed(fd: int) -> bool:
    """The descriptor is a pipe or socket whose reader has gone (poll(2) reports POLLERR or POLLHUP for writing)."""
    import select
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
