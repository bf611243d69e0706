"""Following a job in the foreground (``orch run``, ``orch resume``): a live table on a terminal, plain
timestamped lines otherwise; Ctrl-C (or SIGTERM) cancels the job, twice leaves at once."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from rich.live import Live

from ...observe.views import ops_words
from .output import console, err_console, fmt_loss, print_json, printable
from .render import final_words, render_detail, resume_words


def follow_embedded(controller: Any, job_id: str, args: argparse.Namespace, since_event: int = 0) -> int:
    """Show a job's progress until its attempt ends; Ctrl-C (or SIGTERM) cancels it, twice leaves at once.

    Args:
        since_event: only events after this id are reported (a resume shows only its attempt).

    Returns:
        0 when the job succeeded, 130 when interrupted, else 1, or the failed rank's exit status (1-255)
        where ``args.rank_exit_status`` is set (the drop-in commands: deepspeed exits with it).
    """
    from ...observe import job_detail
    from ...store import JobState
    interrupted = {"n": 0}

    def on_signal(sig: int, _frame: Any) -> None:
        interrupted["n"] += 1
        if interrupted["n"] == 1:
            name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
            err_console.print(f"Cancelling the job ({name}; again to leave at once)...", markup=False, highlight=False)
            controller.cancel(job_id, f"cancelled by the user ({name} to orch)")
        else:
            raise KeyboardInterrupt

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    run = controller.active_run(job_id)
    live = args.output != "json" and sys.stdout is not None and sys.stdout.isatty()
    try:
        if live:
            with Live(render_detail(job_detail(controller.store, job_id)), console=console,
                      refresh_per_second=4, transient=False) as view:
                while controller.busy(job_id):
                    time.sleep(0.5)
                    view.update(render_detail(job_detail(controller.store, job_id)))
                view.update(render_detail(job_detail(controller.store, job_id)))
        else:
            follow_plain(controller, job_id, run, args, since_event)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    detail = job_detail(controller.store, job_id)
    if args.output == "json":
        print_json(detail)
    else:
        final_words(detail, header=not live)
    if interrupted["n"]:
        return 130
    if detail["state"] == JobState.SUCCEEDED.value:
        return 0
    cause = detail.get("cause") or {}
    code = cause.get("returncode") if cause.get("kind") == "rank_exit" else None
    if getattr(args, "rank_exit_status", False) and isinstance(code, int) and 0 < code < 256:
        return code  # a drop-in command exits as the real tool does: with the failed rank's status
    return 1


def follow_plain(controller: Any, job_id: str, run: Any, args: argparse.Namespace, since_event: int = 0) -> None:
    """Progress as plain lines (no terminal, or --output json: then on stderr).

    Every state change and warning is printed (from the job's events, so none is
    missed); at most every 5 seconds the step and loss of every rank that reports them;
    and every 15 seconds without a reported step, that the ranks are still starting.
    """
    from ...observe import job_detail
    out = err_console if args.output == "json" else console

    def say(text: str, at: float | None = None) -> None:
        out.print(f"[{time.strftime('%H:%M:%S', time.localtime(at))}] {printable(text)}", markup=False,
                  highlight=False)

    seen_event, last_print, last_steps, running_since = since_event, 0.0, None, None
    while True:
        finished = not controller.busy(job_id)
        if not finished:
            time.sleep(0.5)
        kept: list = []  # agent_kept events not said yet (one line for a run of them)
        for ev in controller.store.events(job_id, since_id=seen_event):
            seen_event = ev.id
            if kept and ev.kind != "agent_kept":
                say(kept_words(kept), kept[-1].at)
                kept = []
            if ev.kind == "agent_kept":
                kept.append(ev)
            elif ev.kind == "state":
                cause = (ev.data.get("cause") or {}).get("message")
                say(f"job {job_id} {ev.data['to']} (attempt {ev.attempt}){': ' + cause if cause else ''}", ev.at)
                if "resume_tag" in ev.data:
                    say(resume_words(ev.data), ev.at)
                running_since = time.monotonic() if ev.data["to"] == "RUNNING" else None
                last_print = time.monotonic()
            elif ev.kind in ("warning", "allocation"):
                say(f"{'warning: ' if ev.kind == 'warning' else ''}{ev.data.get('message')}", ev.at)
            elif ev.kind == "preflight" and ev.data.get("passed"):
                ops = ops_words(ev.data.get("ops"))
                say(f"preflight passed on {len(ev.data.get('nodes') or [])} node(s) in "
                    f"{ev.data.get('seconds', 0):.2f} s{'; DeepSpeed ops: ' + ops if ops else ''}", ev.at)
            elif ev.kind == "hang_detected":
                say(f"no progress on rank(s) {', '.join(map(str, ev.data.get('ranks', [])))}: dumping every rank's "
                    "stacks to see what each is doing", ev.at)
            elif ev.kind == "startup_timeout_passed":
                say("no rank reported a first step within startup_timeout: dumping every rank's stacks to see "
                    "what each waits on", ev.at)
            elif ev.kind == "hang_dismissed":
                doing = "; ".join(f"rank {r}: {d}" for r, d in (ev.data.get("doing") or {}).items() if d)
                say(f"not a hang: {doing or ev.data.get('why')}; {ev.data.get('more_seconds', 0):.0f} s more", ev.at)
            elif ev.kind == "restart_scheduled":
                say(restart_words(ev.data), ev.at)
            elif ev.kind == "checkpoint_marked_bad":
                say(f"checkpoint {ev.data['tag']} marked bad: {ev.data['reason']}; no resume starts from it again "
                    "until it is saved again", ev.at)
            elif ev.kind == "cause_revised":
                say(f"root cause of attempt {ev.attempt}: {(ev.data.get('cause') or {}).get('message')}", ev.at)
            elif ev.kind == "checkpoint_converted":
                d = ev.data
                say(f"checkpoint {d['from_tag']} (saved by {d['from_world_size']} ranks) "
                    + ("already converted" if d.get("reused") else f"converted in {d['seconds']:.1f} s")
                    + f" to DeepSpeed's universal format, {d['tag']}, for {d['to_world_size']} ranks", ev.at)
        if kept:
            say(kept_words(kept), kept[-1].at)
        d = job_detail(controller.store, job_id)
        steps = [(r["global_rank"], r["step"], r["loss"]) for r in d["ranks"]]
        reporting = any(s[1] is not None for s in steps)
        if steps != last_steps and time.monotonic() - last_print >= 5 and reporting:
            say("  ".join(f"rank {g}: step {s} loss {fmt_loss(lo)}" for g, s, lo in steps if s is not None))
            last_print, last_steps = time.monotonic(), steps
        elif running_since is not None and not reporting and time.monotonic() - last_print >= 15:
            say(f"{sum(r['state'] == 'running' for r in d['ranks'])} rank(s) running, no step reported yet "
                f"({time.monotonic() - running_since:.0f} s; Python, torch and DeepSpeed are starting)")
            last_print = time.monotonic()
        if finished:
            return


def kept_words(events: list) -> str:
    """One line for a run of ``agent_kept`` events: the attempt, the hosts (4 named), what was kept."""
    names = [e.data.get("host") for e in events]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    templates = sum(1 for e in events if e.data.get("template"))
    what = " and fork-server templates" if templates == len(events) else \
        f" ({templates} with its fork-server template)" if templates else ""
    return f"attempt {events[0].attempt} reuses the agents{what} of the attempt before on {shown} (warm: no new agent)"


def restart_words(data: dict) -> str:
    """The line of a ``restart_scheduled`` event: which restart, when, without which hosts, and why."""
    if data.get("controller_fault"):
        which, why = f"restart {data['restart']}", "the controller's own trouble, whatever the restart policy"
    else:
        which, why = f"restart {data['restart']} of {data['max_restarts']}", "restart policy"
    without = f" without {', '.join(data['exclude_hosts'])}" if data.get("exclude_hosts") else ""
    return f"{which} in {data['in_seconds']:.0f} s{without} ({why})"
