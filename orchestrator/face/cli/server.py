"""``orch server``: the controller as a service (HTTP API, web dashboard, Prometheus ``/metrics``)."""

from __future__ import annotations

import argparse
import json
import os
import signal

from ... import __version__
from .backends import find_server, server_file, state_dir_of
from .output import UsageError, err_console

DEFAULT_PORT = 8470


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

    from ...supervision import Controller
    from ..api import create_app
    state_dir = state_dir_of(args)
    running = find_server(argparse.Namespace(server=None, state_dir=str(state_dir)))
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
        err_console.print(f"warning: cannot write the Prometheus targets of this server into "
                   f"{controller.targets.directory}: {err.strerror or err}", markup=False, highlight=False)
    for job_id in controller.recover():
        then = "its restart policy restarts it" if controller.busy(job_id) else "resume it with orch resume"
        err_console.print(f"job {job_id}: its controller had gone away; marked FAILED ({then})",
                   markup=False, highlight=False)
    server_file(state_dir).write_text(json.dumps({"url": url, "pid": os.getpid(),
                                                   "create_time": psutil.Process().create_time()}))
    err_console.print(f"orch server {__version__} on {url} (state dir {state_dir})", markup=False, highlight=False)
    server = _quiet_server_class()(uvicorn.Config(create_app(controller), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        err_console.print("orch server stopping: cancelling the jobs it runs...")
        controller.close(cancel=True, reason="cancelled: orch server was stopped")
        controller.targets.remove("controller")
        try:
            if json.loads(server_file(state_dir).read_text()).get("pid") == os.getpid():
                server_file(state_dir).unlink()
        except (OSError, ValueError):
            pass
    return 0
