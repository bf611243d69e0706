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
import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ... import __version__
from ...errors import OrchError

__all__ = ["main"]

DEFAULT_PORT = 8470
_console = Console(width=None if sys.stdout.isatty() else 200)
_err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

_STATE_STYLE = {"PENDING": "yellow", "PROVISIONING": "yellow", "RUNNING": "cyan", "SUCCEEDED": "green",
                "FAILED": "bold red", "CANCELLED": "magenta", "running": "cyan", "exited": "green",
                "failed": "bold red", "stopped": "magenta", "pending": "yellow", "not started": "dim"}


# -- backends: the HTTP API, or the state directory itself ----------------------------------------


class UsageError(OrchError):
    """A command cannot be carried out as asked (e.g. submit with no server running)."""


class StoreBackend:
    """Reads the store directly; commands that change state use an embedded controller.

    Reading creates nothing: a state directory without a store simply has no jobs. Jobs
    whose controller died (an ``orch run`` that was killed) are marked FAILED first, so
    what is shown is not stale (:func:`orchestrator.controller.recover_orphans`).
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._store = None

    @property
    def store(self) -> Any:
        from ...supervision import recover_orphans
        from ...errors import NotFoundError
        from ...store import Store
        if self._store is None:
            if not (self.state_dir / "orch.db").is_file():
                raise NotFoundError(f"No jobs in state dir {self.state_dir} (nothing has run with it yet).")
            self._store = Store(self.state_dir / "orch.db")
            recover_orphans(self._store)
        return self._store

    def list(self) -> list[dict]:
        from ...errors import NotFoundError
        from ...observe import job_summary
        try:
            store = self.store
        except NotFoundError:
            return []
        out = []
        for job in store.list_jobs(1000):
            attempt = store.get_attempt(job.id, job.attempt) if job.attempt else None
            out.append(job_summary(job, attempt))
        return out

    def detail(self, job_id: str) -> dict:
        from ...observe import job_detail
        return job_detail(self.store, job_id)

    def logs(self, job_id: str, rank: int, attempt: int | None, offset: int) -> dict:
        from ...observe import read_log
        return read_log(self.store, job_id, rank, attempt, offset)

    def cancel(self, job_id: str) -> dict:
        from ...supervision import Controller
        self.store  # noqa: B018 - fails clearly when there is no store
        c = Controller(self.state_dir)
        try:
            c.cancel(job_id)
        finally:
            c.close(cancel=False)
        return self.detail(job_id)


class HttpBackend:
    """Talks to ``orch server``."""

    def __init__(self, url: str) -> None:
        import httpx
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=60.0)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise UsageError(f"Cannot reach the orch server at {self.url}: {err}.") from err
        if r.status_code >= 400:
            try:
                body = r.json()
                msg = body.get("error") or body.get("detail") or r.text
            except ValueError:
                msg = r.text
            raise UsageError(str(msg))
        return r.json()

    def list(self) -> list[dict]:
        return self._call("GET", "/api/jobs", params={"limit": 1000})

    def detail(self, job_id: str) -> dict:
        return self._call("GET", f"/api/jobs/{job_id}")

    def logs(self, job_id: str, rank: int, attempt: int | None, offset: int) -> dict:
        params: dict[str, Any] = {"rank": rank, "offset": offset}
        if attempt:
            params["attempt"] = attempt
        return self._call("GET", f"/api/jobs/{job_id}/logs", params=params)

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/api/jobs/{job_id}/cancel")

    def resume(self, job_id: str, exclude: list[str], fresh: bool = False) -> dict:
        # no time limit: the server may first convert the checkpoint for a new world size (minutes)
        return self._call("POST", f"/api/jobs/{job_id}/resume", json={"exclude": exclude, "fresh": fresh},
                          timeout=None)

    def submit(self, spec: dict, source: str) -> dict:
        return self._call("POST", "/api/jobs", json={"spec": spec, "source": source})


def _server_file(state_dir: Path) -> Path:
    return state_dir / "server.json"


def _find_server(args: argparse.Namespace) -> str | None:
    """The URL of the server to use: --server/$ORCH_SERVER, else a live one recorded in the state dir."""
    if args.server:
        return args.server
    path = _server_file(_state_dir(args))
    try:
        info = json.loads(path.read_text())
        import psutil
        if psutil.pid_exists(int(info["pid"])):
            return str(info["url"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def _backend(args: argparse.Namespace) -> StoreBackend | HttpBackend:
    url = _find_server(args)
    return HttpBackend(url) if url else StoreBackend(_state_dir(args))


def _state_dir(args: argparse.Namespace) -> Path:
    from ...supervision import default_state_dir
    path = Path(args.state_dir).expanduser().resolve() if args.state_dir else default_state_dir().resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"State dir {path} is not a directory; give --state-dir (or $ORCH_STATE_DIR) a "
                         "directory.")
    return path


# -- rendering ------------------------------------------------------------------------------------


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def _styled(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def _ago(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0, int(time.time() - t))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def _fmt_loss(v: Any) -> str:
    return "-" if v is None else v if isinstance(v, str) else f"{v:.4f}"


def _ranks_table(detail: dict) -> Table:
    t = Table(box=None, pad_edge=False)
    for col in ("rank", "node", "local", "pid", "state", "exit", "step", "loss", "tokens/s", "last output"):
        t.add_column(col, overflow="ellipsis", no_wrap=col in ("last output", "state", "exit"),
                     max_width=60 if col == "last output" else None)
    for r in detail.get("ranks", []):
        exit_ = (r.get("how") or "").replace("exit code ", "").replace("signal ", "") or "-"
        t.add_row(str(r["global_rank"]), f"{r['host']} ({r['node_rank']})", str(r["local_rank"]),
                  str(r["pid"] or "-"), _styled(r["state"]), exit_,
                  str(r["step"] if r["step"] is not None else "-"), _fmt_loss(r["loss"]),
                  f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") is not None else "-",
                  Text((r.get("last_line") or "")[:200]))
    return t


def _header(detail: dict) -> Text:
    t = Text()
    t.append(f"job {detail['id']}  ", style="bold")
    t.append_text(_styled(detail["state"]))
    t.append(f"  attempt {detail['attempt']}  world size {detail.get('world_size', '-')}"
             f"  master {detail.get('master_addr', '-')}:{detail.get('master_port', '-')}")
    return t


def _cause_lines(detail: dict) -> list[str]:
    cause = detail.get("cause") or {}
    lines = []
    if cause.get("lines") and cause.get("summary"):  # preflight_failed: a line per finding and its nodes
        lines.append(f"cause: {cause['summary']}:")
        lines += [f"  {line}" for line in cause["lines"]]
    elif cause.get("message"):
        lines.append(f"cause: {cause['message']}")
    with_tail = cause if cause.get("log_tail") else (cause.get("first_symptom") or {})
    tail = with_tail.get("log_tail") or []
    if tail:
        lines.append(f"last lines of rank {with_tail.get('global_rank')}'s log:")
        lines += [f"  | {ln}" for ln in tail[-10:]]
    return lines


def _render_detail(detail: dict) -> Group:
    parts: list[Any] = [_header(detail)]
    for line in _cause_lines(detail):
        parts.append(Text(line, style="red" if line.startswith("cause") else ""))
    parts.append(_ranks_table(detail))
    return Group(*parts)


# -- commands -------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from ...supervision import prepare_plan
    spec = _load_job(args)
    plan, _lease = prepare_plan(spec, _state_dir(args), f"{spec.name}-plan", hold_port=False)
    if args.output == "json":
        _print_json(plan.to_dict())
        return 0
    c = _console
    c.print(Text(f"Plan for job '{plan.job_name}' (nothing started)", style="bold"))
    c.print(f"launcher {plan.launcher}, provisioner {plan.provisioner}, {len(plan.nodes)} node(s), "
            f"world size {plan.world_size}, master {plan.master_addr}:{plan.master_port}",
            markup=False, highlight=False)
    nodes = Table(title="Nodes", box=None, title_justify="left", pad_edge=False)
    for col in ("node rank", "host", "slots", "global ranks", "metrics"):
        nodes.add_column(col)
    for n in plan.nodes:
        nodes.add_row(str(n.node_rank), n.host, ",".join(map(str, n.slots)),
                      ",".join(str(r.global_rank) for r in n.ranks),
                      f":{n.metrics_port}/metrics" if n.metrics_port else "-")
    c.print(nodes)
    pairs = plan.ranks()
    envs = [dict(r.env) for _, r in pairs]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    c.print(Text("Environment of every rank (over its node's own):", style="bold"))
    for k in sorted(common):
        c.print(f"  {k}={shlex.quote(common[k])}", markup=False, highlight=False, soft_wrap=True)
    ranks = Table(title="Ranks", box=None, title_justify="left", pad_edge=False)
    for col in ("rank", "node", "local rank", "slot", "rank's own environment", "command line"):
        ranks.add_column(col, overflow="fold")
    for (n, r), env in zip(pairs, envs):
        own = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in common)
        ranks.add_row(str(r.global_rank), f"{n.host} ({n.node_rank})", str(r.local_rank), str(r.slot), own,
                      shlex.join(r.argv))
    c.print(ranks)
    defaults = {k: v for n in plan.nodes for k, v in n.env_defaults.items()}
    if defaults:
        c.print("Set where a node's environment lacks them: " +
                " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(defaults.items())), markup=False,
                highlight=False, soft_wrap=True)
    if plan.deepspeed_config:
        c.print(Text(f"DeepSpeed config, resolved (a run writes it to {plan.deepspeed_config_path}):", style="bold"))
        c.print(json.dumps(plan.deepspeed_config, indent=2), markup=False, highlight=False, soft_wrap=True)
    c.print(Text(f"What the real {plan.launcher} launcher would run:", style="bold"))
    for cmd in plan.real_commands:
        where = f"on {cmd.where}" if cmd.where else "on the launching machine"
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        c.print(f"  {where}: {prefix + ' ' if prefix else ''}{shlex.join(cmd.argv)}", markup=False,
                highlight=False, soft_wrap=True)
    for w in plan.warnings:
        _err.print(Text(f"warning: {w}", style="yellow"))
    return 0


def _follow_embedded(controller: Any, job_id: str, args: argparse.Namespace, since_event: int = 0) -> int:
    """Show a job's progress until its attempt ends; Ctrl-C (or SIGTERM) cancels it, twice leaves at once.

    Args:
        since_event: only events after this id are reported (a resume shows only its attempt).
    """
    from ...store import JobState
    from ...observe import job_detail
    interrupted = {"n": 0}

    def on_signal(sig: int, _frame: Any) -> None:
        interrupted["n"] += 1
        if interrupted["n"] == 1:
            name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
            _err.print(f"Cancelling the job ({name}; again to leave at once)...", markup=False, highlight=False)
            controller.cancel(job_id, f"cancelled by the user ({name} to orch)")
        else:
            raise KeyboardInterrupt

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    run = controller.active_run(job_id)
    live = args.output != "json" and sys.stdout.isatty()
    try:
        if live:
            with Live(_render_detail(job_detail(controller.store, job_id)), console=_console,
                      refresh_per_second=4, transient=False) as view:
                while controller.busy(job_id):
                    time.sleep(0.5)
                    view.update(_render_detail(job_detail(controller.store, job_id)))
                view.update(_render_detail(job_detail(controller.store, job_id)))
        else:
            _follow_plain(controller, job_id, run, args, since_event)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    detail = job_detail(controller.store, job_id)
    if args.output == "json":
        _print_json(detail)
    else:
        _final_words(detail, header=not live)
    if interrupted["n"]:
        return 130
    return 0 if detail["state"] == JobState.SUCCEEDED.value else 1


def _follow_plain(controller: Any, job_id: str, run: Any, args: argparse.Namespace, since_event: int = 0) -> None:
    """Progress as plain lines (no terminal, or --output json: then on stderr).

    Every state change and warning is printed (from the job's events, so none is
    missed); at most every 5 seconds the step and loss of every rank that reports them;
    and every 15 seconds without a reported step, that the ranks are still starting.
    """
    from ...observe import job_detail
    out = _err if args.output == "json" else _console

    def say(text: str, at: float | None = None) -> None:
        out.print(f"[{time.strftime('%H:%M:%S', time.localtime(at))}] {text}", markup=False, highlight=False)

    seen_event, last_print, last_steps, running_since = since_event, 0.0, None, None
    while True:
        finished = not controller.busy(job_id)
        if not finished:
            time.sleep(0.5)
        for ev in controller.store.events(job_id, since_id=seen_event):
            seen_event = ev.id
            if ev.kind == "state":
                cause = (ev.data.get("cause") or {}).get("message")
                say(f"job {job_id} {ev.data['to']} (attempt {ev.attempt}){': ' + cause if cause else ''}", ev.at)
                if "resume_tag" in ev.data:
                    say(_resume_words(ev.data), ev.at)
                running_since = time.monotonic() if ev.data["to"] == "RUNNING" else None
                last_print = time.monotonic()
            elif ev.kind == "warning":
                say(f"warning: {ev.data.get('message')}", ev.at)
            elif ev.kind == "preflight" and ev.data.get("passed"):
                say(f"preflight passed on {len(ev.data.get('nodes') or [])} node(s) in "
                    f"{ev.data.get('seconds', 0):.2f} s", ev.at)
            elif ev.kind == "hang_detected":
                say(f"no progress on rank(s) {', '.join(map(str, ev.data.get('ranks', [])))}: dumping every rank's "
                    "stacks, then failing the attempt", ev.at)
            elif ev.kind == "restart_scheduled":
                say(f"restart {ev.data['restart']} of {ev.data['max_restarts']} in {ev.data['in_seconds']:.0f} s"
                    + (f" without {', '.join(ev.data['exclude_hosts'])}" if ev.data.get("exclude_hosts") else "")
                    + " (restart policy)", ev.at)
            elif ev.kind == "cause_revised":
                say(f"root cause of attempt {ev.attempt}: {(ev.data.get('cause') or {}).get('message')}", ev.at)
            elif ev.kind == "checkpoint_converted":
                d = ev.data
                say(f"checkpoint {d['from_tag']} (saved by {d['from_world_size']} ranks) "
                    + ("already converted" if d.get("reused") else f"converted in {d['seconds']:.1f} s")
                    + f" to DeepSpeed's universal format, {d['tag']}, for {d['to_world_size']} ranks", ev.at)
        d = job_detail(controller.store, job_id)
        steps = [(r["global_rank"], r["step"], r["loss"]) for r in d["ranks"]]
        reporting = any(s[1] is not None for s in steps)
        if steps != last_steps and time.monotonic() - last_print >= 5 and reporting:
            say("  ".join(f"rank {g}: step {s} loss {_fmt_loss(lo)}" for g, s, lo in steps if s is not None))
            last_print, last_steps = time.monotonic(), steps
        elif running_since is not None and not reporting and time.monotonic() - last_print >= 15:
            say(f"{sum(r['state'] == 'running' for r in d['ranks'])} rank(s) running, no step reported yet "
                f"({time.monotonic() - running_since:.0f} s; Python, torch and DeepSpeed are starting)")
            last_print = time.monotonic()
        if finished:
            return


def _resume_words(data: dict) -> str:
    """Where a new attempt starts, and the newer checkpoints it skipped and why (a state event's data)."""
    words = f"  starts from checkpoint {data['resume_tag']}" if data.get("resume_tag") else \
        "  starts from the beginning (no complete checkpoint)"
    for s in data.get("skipped_checkpoints") or []:
        words += f"; skipped {s['tag']}: {'; '.join(s['problems'])}"
    return words


def _final_words(detail: dict, header: bool = True) -> None:
    c = _console
    if header:
        c.print(_header(detail))
        for line in _cause_lines(detail):
            c.print(line, markup=False, highlight=False, style="red" if line.startswith("cause") else None)
    if detail.get("run_dir"):
        c.print(f"logs: {detail['run_dir']}/logs", markup=False, highlight=False)
    if detail["state"] in ("FAILED", "CANCELLED"):
        if (detail.get("cause") or {}).get("kind") == "preflight_failed":
            c.print(f"fix the nodes, then resume with: orch resume {detail['id']}; a problem in the spec itself "
                    "(python, workdir, entrypoint, checkpoint_dir) needs a new job from the fixed spec (orch run), "
                    "since a resume runs the job's stored spec", markup=False, highlight=False)
        else:
            c.print(f"resume with: orch resume {detail['id']}", markup=False, highlight=False)


def cmd_run(args: argparse.Namespace) -> int:
    from ...supervision import Controller
    spec = _load_job(args)
    controller = Controller(_state_dir(args))
    try:
        job = controller.submit(spec)
        if args.output != "json":
            _console.print(f"Submitted job {job.id} ({spec.launcher} launcher, state dir {controller.state_dir})",
                           markup=False, highlight=False)
        return _follow_embedded(controller, job.id, args)
    finally:
        controller.close(cancel=True)


def _start_checkpoint(attempt: dict) -> str:
    """An attempt's start checkpoint in words: its tag, and for a universal one the tag it came from."""
    tag = attempt.get("resume_tag")
    if not tag:
        return "-"
    source = attempt.get("resume_universal_from")
    return f"{tag} (converted from {source})" if source else tag


def cmd_resume(args: argparse.Namespace) -> int:
    url = _find_server(args)
    if url:
        detail = HttpBackend(url).resume(args.job, args.exclude, args.fresh)
        start = _start_checkpoint(detail["attempts"][-1])
        _emit_detail(detail, args, f"Resumed job {detail['id']}: attempt {detail['attempt']} from checkpoint "
                                   f"{start if start != '-' else '(none: from the start)'}")
        return 0
    from ...supervision import Controller
    state_dir = _state_dir(args)
    StoreBackend(state_dir).store  # noqa: B018 - a clear error when there are no jobs at all
    controller = Controller(state_dir)
    try:
        before = controller.store.events(controller.get(args.job).id)
        job = controller.resume(args.job, exclude_hosts=args.exclude, fresh=args.fresh)
        attempt = controller.store.get_attempt(job.id, job.attempt)
        if args.output != "json":
            start = _start_checkpoint(attempt.to_dict())
            none = "(none: from step 0, as --fresh asks)" if args.fresh else "(none found: from the start)"
            _console.print(f"Resuming job {job.id}: attempt {job.attempt} from checkpoint "
                           f"{start if start != '-' else none}", markup=False, highlight=False)
        return _follow_embedded(controller, job.id, args, since_event=before[-1].id if before else 0)
    finally:
        controller.close(cancel=True)


def cmd_submit(args: argparse.Namespace) -> int:
    spec = _load_job(args)
    url = _find_server(args)
    if not url:
        raise UsageError(f"No orch server is running for state dir {_state_dir(args)}. Start one with "
                         "`orch server`, or run the job in the foreground with `orch run`.")
    detail = HttpBackend(url).submit(spec.to_dict(), str(args.spec))
    _emit_detail(detail, args, f"Submitted job {detail['id']}")
    return 0


def _emit_detail(detail: dict, args: argparse.Namespace, message: str) -> None:
    if args.output == "json":
        _print_json(detail)
    else:
        _console.print(message, markup=False, highlight=False)


def cmd_list(args: argparse.Namespace) -> int:
    jobs = _backend(args).list()
    if args.output == "json":
        _print_json(jobs)
        return 0
    if not jobs:
        _console.print("No jobs yet. Run one with `orch run job.yaml`.")
        return 0
    t = Table(box=None, pad_edge=False)
    for col in ("job", "state", "attempt", "restarts", "nodes", "world", "updated", "cause"):
        t.add_column(col, overflow="ellipsis", max_width=70 if col == "cause" else None)
    for j in jobs:
        t.add_row(j["id"], _styled(j["state"]), str(j["attempt"]), str(j["restarts"]),
                  ",".join(j.get("nodes") or []), str(j.get("world_size") or "-"), _ago(j["updated_at"]),
                  j.get("cause_message") or "")
    _console.print(t)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    detail = _backend(args).detail(args.job)
    if args.output == "json":
        _print_json(detail)
        return 0
    c = _console
    c.print(_header(detail))
    attempts = Table(title="Attempts", box=None, title_justify="left", pad_edge=False)
    for col in ("#", "state", "nodes", "world", "start checkpoint", "started", "cause"):
        attempts.add_column(col, overflow="fold")
    for a in detail["attempts"]:
        attempts.add_row(str(a["number"]), _styled(a["state"]), ",".join(a["nodes"]), str(a["world_size"]),
                         _start_checkpoint(a), _ago(a["created_at"]), (a.get("cause") or {}).get("message") or "")
    c.print(attempts)
    c.print(Text(f"Ranks of attempt {detail['attempt']}", style="bold"))
    c.print(_ranks_table(detail))
    for line in _cause_lines(detail)[1:]:
        c.print(line, markup=False, highlight=False)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    backend = _backend(args)
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
    sys.stdout.write("".join(f"{prefix}{ln}\n" for ln in lines))
    sys.stdout.flush()


def cmd_cancel(args: argparse.Namespace) -> int:
    backend = _backend(args)
    detail = backend.cancel(args.job)
    if args.wait:
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            detail = backend.detail(args.job)
            if detail["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and \
                    (not detail["attempts"] or detail["attempts"][-1]["stopped_at"]):
                break
            time.sleep(0.25)
    _emit_detail(detail, args, f"Job {detail['id']}: {detail['state']}")
    return 0


def _size(n: int) -> str:
    """Bytes for people: ``123.4 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_export(args: argparse.Namespace) -> int:
    from ...errors import ExportError
    from ...checkpoints import export_checkpoint
    if not args.file:
        raise UsageError("Name the file to write: orch export JOB model.pt (or orch export JOB --output model.pt).")
    detail = _backend(args).detail(args.job)
    if not detail.get("checkpoint_dir"):
        raise ExportError(f"Job {detail['id']} never started an attempt, so it has no checkpoints to export.")
    # bound to the real stderr now: the export sends DeepSpeed's own output elsewhere while it runs
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else 200)
    ckpt, label = detail["checkpoint_dir"], f"Job {detail['id']}"
    if err.is_terminal:
        with err.status("Exporting...") as status:
            result = export_checkpoint(ckpt, args.file, args.tag, label=label,
                                       progress=lambda msg: status.update(msg + "..."))
    else:
        result = export_checkpoint(ckpt, args.file, args.tag, label=label, progress=lambda msg: err.print(
            f"[{time.strftime('%H:%M:%S')}] {msg}", markup=False, highlight=False))
    if args.output == "json":
        _print_json({"job": detail["id"], **result.to_dict()})
        return 0
    c = _console
    c.print(f"Exported checkpoint {result.tag} of job {detail['id']} (step {result.step}, ZeRO stage "
            f"{result.zero_stage}, {result.world_size} ranks) to {result.output}", markup=False, highlight=False)
    c.print(f"  {result.tensors} tensors, {result.params:,} parameters, {'/'.join(result.dtypes)}, "
            f"{_size(result.bytes)}, {result.seconds:.1f} s ({result.method})", markup=False, highlight=False)
    c.print(f"  load it with: model.load_state_dict(torch.load({result.output!r}, weights_only=True))",
            markup=False, highlight=False, soft_wrap=True)
    return 0


def _quiet_server_class() -> type:
    import contextlib

    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's server, except that SIGTERM/SIGINT only end serving and are not
        re-raised afterwards (uvicorn re-raises them), so ``orch server`` can stop the jobs
        it runs and exit 0."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return QuietServer


def _url_host(host: str) -> str:
    """The address to reach a server listening on ``host`` (a wildcard: this machine's loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def cmd_server(args: argparse.Namespace) -> int:
    import socket

    import psutil
    import uvicorn

    from ..api import create_app
    from ...supervision import Controller
    state_dir = _state_dir(args)
    running = _find_server(argparse.Namespace(server=None, state_dir=str(state_dir)))
    if running:
        raise UsageError(f"An orch server already runs for state dir {state_dir} at {running}; stop it first "
                         "(or use another --state-dir).")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as err:
        sock.close()
        raise UsageError(f"Cannot listen on {args.host}:{args.port}: {err.strerror or err}; choose another "
                         "--port or --host.") from err
    url = f"http://{args.host}:{args.port}"
    controller = Controller(state_dir, owner_url=url, recover_every_s=5.0,
                            prometheus_targets=args.prometheus_targets)
    try:
        controller.targets.write("controller", [{"targets": [f"{_url_host(args.host)}:{args.port}"],
                                                 "labels": {"orch_role": "controller"}}])
    except OSError as err:
        _err.print(f"warning: cannot write the Prometheus targets of this server into "
                   f"{controller.targets.directory}: {err.strerror or err}", markup=False, highlight=False)
    for job_id in controller.recover():
        then = "its restart policy restarts it" if controller.busy(job_id) else "resume it with orch resume"
        _err.print(f"job {job_id}: its controller had gone away; marked FAILED ({then})",
                   markup=False, highlight=False)
    _server_file(state_dir).write_text(json.dumps({"url": url, "pid": os.getpid(),
                                                   "create_time": psutil.Process().create_time()}))
    _err.print(f"orch server {__version__} on {url} (state dir {state_dir})", markup=False, highlight=False)
    server = _quiet_server_class()(uvicorn.Config(create_app(controller), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        _err.print("orch server stopping: cancelling the jobs it runs...")
        controller.close(cancel=True, reason="cancelled: orch server was stopped")
        controller.targets.remove("controller")
        try:
            if json.loads(_server_file(state_dir).read_text()).get("pid") == os.getpid():
                _server_file(state_dir).unlink()
        except (OSError, ValueError):
            pass
    return 0


# -- argument parsing -----------------------------------------------------------------------------


def _host_list(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",")]
    if not all(hosts) or any(":" in h or "@" in h for h in hosts):
        raise argparse.ArgumentTypeError(f"expected host names separated by commas (no slots), got {text!r}")
    return hosts


def _bounded(kind: Callable[[str], float], low: float, high: float | None, what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within ``low..high``, else a message saying ``what`` was expected."""
    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


_positive_int = _bounded(int, 1, None, "a whole number of at least 1")
_port = _bounded(int, 1, 65535, "a TCP port 1..65535")
_seconds = _bounded(float, 0, None, "a number of seconds >= 0")

#: accelerate launch's DeepSpeed flags: (name, type, help); each sets the spec's accelerate.<name>.
_ACCELERATE_FLAGS = (
    ("mixed_precision", str, "no | fp16 | bf16 | fp8"),
    ("zero_stage", int, "ZeRO stage 0-3"),
    ("gradient_accumulation_steps", int, "micro batches per optimizer step"),
    ("gradient_clipping", float, "max gradient norm"),
    ("offload_optimizer_device", str, "none | cpu | nvme"),
    ("offload_param_device", str, "none | cpu | nvme"),
    ("offload_optimizer_nvme_path", str, "NVMe directory for optimizer states"),
    ("offload_param_nvme_path", str, "NVMe directory for parameters"),
    ("zero3_init_flag", str, "true | false: deepspeed.zero.Init at stage 3"),
    ("zero3_save_16bit_model", str, "true | false: save 16-bit weights at stage 3"),
)


def _job_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Options that build or amend the job: an Accelerate config, accelerate launch's DeepSpeed
    flags, the values that fill a DeepSpeed config's "auto" (docs/accelerate.md)."""
    default = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("job from an Accelerate config (see docs/accelerate.md)")
    g.add_argument("--accelerate-config", metavar="FILE", default=default,
                   help="an Accelerate config file (accelerate config's YAML); then the positional may be the "
                   "training script, followed by its arguments, as with accelerate launch")
    g.add_argument("--name", default=default, help="job name (without a job spec; default: the script's name)")
    g.add_argument("--micro-batch-size", type=_positive_int, metavar="N", default=default,
                   help="samples per rank per micro step: fills \"auto\" batch sizes of the DeepSpeed config")
    g.add_argument("--hidden-size", type=_positive_int, metavar="N", default=default,
                   help="the model's hidden size: fills the three \"auto\" bucket sizes")
    g.add_argument("--model-config", metavar="PATH", default=default,
                   help="a Hugging Face config.json (or its folder) to read the hidden size from")
    for name, kind, help_ in _ACCELERATE_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", f"--{name}", dest=f"acc_{name}", type=kind,
                       metavar=kind.__name__.upper(), default=default, help=f"{help_} (accelerate launch --{name})")


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC|SCRIPT", nargs="?", help="job spec (YAML); with --accelerate-config, "
                        "a training script instead (then every later word is the script's argument)")
    parser.add_argument("script_args", metavar="...", nargs=argparse.REMAINDER,
                        help="with --accelerate-config: the script's arguments")
    _job_options(parser)


def _job_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Spec fields from the command line (paths absolute: they are the caller's, not the spec's)."""
    out: dict[str, Any] = {}
    for key in ("accelerate_config", "model_config"):
        if getattr(args, key, None) is not None:
            out[key] = os.path.abspath(os.path.expanduser(getattr(args, key)))
    for key in ("micro_batch_size", "hidden_size"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    flags = {name: getattr(args, f"acc_{name}") for name, _, _ in _ACCELERATE_FLAGS
             if getattr(args, f"acc_{name}", None) is not None}
    if flags:
        out["accelerate"] = flags
    return out


def _script_job_name(script: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).lstrip("._-")[:63]
    return stem or "job"


def _load_job(args: argparse.Namespace) -> Any:
    """The command's job: a spec file (amended by the options), or, with ``--accelerate-config`` and
    a non-YAML positional, a job made of that script and its arguments.

    Raises:
        UsageError: words after a job spec that are not options.
        SpecError: the spec (or the Accelerate config) has problems.
    """
    from ...spec import load_spec, spec_from_dict
    if not args.spec:
        raise UsageError(f"Name the job: orch {args.command} job.yaml, or orch {args.command} --accelerate-config "
                         "accel.yaml train.py [script arguments].")
    rest = list(getattr(args, "script_args", None) or [])
    script_mode = getattr(args, "accelerate_config", None) is not None and \
        not str(args.spec).endswith((".yaml", ".yml"))
    if not script_mode and rest:  # options after the spec: parse them as options
        p = argparse.ArgumentParser(prog=f"orch {args.command} SPEC", add_help=False)
        _common_options(p, top=False)
        _job_options(p, suppress=True)
        extra, unknown = p.parse_known_args(rest, namespace=args)
        if unknown:
            raise UsageError(f"Unexpected arguments after the job spec {args.spec}: {' '.join(unknown)}. Put the "
                             "script's arguments in the spec's args (or give --accelerate-config and the script).")
        script_mode = getattr(args, "accelerate_config", None) is not None and \
            not str(args.spec).endswith((".yaml", ".yml"))
        rest = []
    overrides = _job_overrides(args)
    if not script_mode:
        if getattr(args, "name", None):
            overrides["name"] = args.name
        return load_spec(args.spec, overrides=overrides or None)
    data = {"name": getattr(args, "name", None) or _script_job_name(args.spec), "entrypoint": args.spec,
            "args": rest, "workdir": os.getcwd(), **overrides}
    return spec_from_dict(data, os.getcwd(), source=f"(from --accelerate-config {args.accelerate_config})")


def _common_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """The options every command takes, before or after the command's name.

    On the commands they default to SUPPRESS, so a value given before the command name
    (``orch -o json list``) is not overwritten by the command's default.
    """
    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS
    parser.add_argument("--state-dir", default=default(None),
                        help="where jobs, logs and checkpoints are kept (default: $ORCH_STATE_DIR or ~/.orch)")
    parser.add_argument("--output", "-o", metavar="{table,json}", default=default("table"),
                        help="output format: human tables (default) or JSON for scripts (orch export also takes "
                        "the file to write here)")
    parser.add_argument("--server", default=default(os.environ.get("ORCH_SERVER")),
                        help="URL of an orch server (default: $ORCH_SERVER, else the one running for the state dir)")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, top=False)
    p = argparse.ArgumentParser(
        prog="orch", description="Run DeepSpeed ZeRO training jobs across nodes from a job spec: plan them, "
        "supervise every rank, stop them cleanly, resume them from the last complete checkpoint.",
        epilog="Start with: orch plan examples/quickstart.yaml, then orch run examples/quickstart.yaml")
    p.add_argument("--version", action="version", version=f"orch {__version__}")
    _common_options(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=help_)
        sp.set_defaults(func=func)
        return sp

    sp = add("plan", cmd_plan, "Show where every rank of a job would run, with its environment and command "
             "line, and the command the real launcher would run. Starts nothing.")
    _job_arguments(sp)
    sp = add("run", cmd_run, "Run a job in the foreground with live progress; exit 0 only if it succeeds. "
             "Ctrl-C cancels it.")
    _job_arguments(sp)
    sp = add("server", cmd_server, "Run the controller as a service: the HTTP API, the web dashboard (/) and "
             "the controller's Prometheus metrics (/metrics).")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    sp.add_argument("--prometheus-targets", metavar="DIR", default=None,
                    help="directory for the Prometheus file_sd files of running attempts and of this server "
                         "(default $ORCH_PROMETHEUS_TARGETS or <state dir>/prometheus/targets; see docs/metrics.md)")
    sp = add("submit", cmd_submit, "Submit a job to the running orch server and return at once.")
    _job_arguments(sp)
    add("list", cmd_list, "List jobs, newest first.")
    sp = add("status", cmd_status, "Show a job: its attempts, their causes, and every rank's state and progress.")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp = add("logs", cmd_logs, "Print a job's rank logs (all ranks, each line prefixed, or one rank).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--rank", type=int, default=None, help="only this global rank, without prefixes")
    sp.add_argument("--attempt", type=int, default=None, help="attempt number (default: the latest)")
    sp.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the attempt stops")
    sp.add_argument("--tail", type=_positive_int, default=None, metavar="N", help="only the last N lines of each log")
    sp = add("cancel", cmd_cancel, "Cancel a job: every rank on every node is stopped within the grace period.")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--wait", type=_seconds, default=0, metavar="SECONDS",
                    help="wait up to SECONDS for every process to be gone")
    sp = add("resume", cmd_resume, "Start a new attempt of a FAILED or CANCELLED job from its last complete "
             "checkpoint (in the foreground unless a server runs it).")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("--exclude", type=_host_list, action="extend", default=[], metavar="HOST[,HOST...]",
                    help="leave these hostfile hosts out from now on (e.g. a lost node), so spare hosts take "
                    "their place; may be repeated")
    sp.add_argument("--fresh", action="store_true",
                    help="start from step 0, whatever checkpoints there are (without it, a job that had "
                    "checkpoints but has no complete one is refused)")
    sp = add("export", cmd_export, "Write a job's checkpoint as one consolidated fp32 state_dict file (DeepSpeed's "
             "zero_to_fp32), loadable with torch.load + load_state_dict without DeepSpeed.")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("file", nargs="?", help="the file to write (torch.save format), e.g. model.pt; its directory "
                    "must exist (or give it as --output model.pt)")
    sp.add_argument("--tag", default=None, help="checkpoint tag, e.g. step_100 (default: the newest complete one); "
                    "an incomplete tag is refused")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    """Entry point of the ``orch`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    fmt = getattr(args, "output", "table")
    if fmt not in ("table", "json"):
        if getattr(args, "func", None) is cmd_export and args.file is None:  # orch export JOB --output model.pt
            args.file, args.output = fmt, "table"
        else:
            parser.error(f"argument --output/-o: invalid choice: {fmt!r} (choose from 'table', 'json')")
    try:
        return args.func(args)
    except OrchError as err:
        if getattr(args, "output", None) == "json":
            _print_json({"error": str(err), "kind": type(err).__name__})
        _err.print(Text(f"error: {err}", style="red"))
        return err.exit_code
    except KeyboardInterrupt:
        _err.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
