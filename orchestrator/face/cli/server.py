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
#: seconds a stopping server waits for its clients' open connections (an idle HTTPS keep-alive one would hold it
#: for asyncio's 30 s TLS shutdown timeout; uvicorn's default is to wait for ever) before it closes them itself
SHUTDOWN_S = 5.0


def _quiet_server_class() -> type:
    import contextlib

    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's server, except that SIGTERM/SIGINT only end serving and are not
        re-raised afterwards (uvicorn re-raises them), so ``orch server`` can stop the jobs
        it runs and exit 0; and that connections still open at :data:`SHUTDOWN_S` are reported in orch's
        words, not uvicorn's ("Cancel 0 running task(s), timeout graceful shutdown exceeded")."""

        async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
            import logging

            def reword(record: logging.LogRecord) -> bool:
                if "timeout graceful shutdown exceeded" not in record.getMessage():
                    return True
                err_console.print(f"orch server stopping: {len(self.server_state.connections)} client "
                                  f"connection(s) still open after {SHUTDOWN_S:g} s are closed",
                                  markup=False, highlight=False)
                return False
            log = logging.getLogger("uvicorn.error")
            log.addFilter(reword)
            try:
                await super().shutdown(sockets)
            finally:
                log.removeFilter(reword)

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


def _is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, extra: list[str]) -> list[str]:
    """The Host header values the server answers to: loopback, this machine's names, the address it listens
    on (a wildcard: every address of this machine), and ``--allowed-host``."""
    import socket

    from agents.network import this_machine_names
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    if host in ("0.0.0.0", "::", ""):
        names = this_machine_names()
    else:
        names.add(host)
    return sorted(names | set(extra))


def _check_binding(args: argparse.Namespace) -> str:
    """``http`` or ``https``: off loopback, TLS or an explicit ``--insecure-http`` (docs/security.md).

    Raises:
        UsageError: a non-loopback address without either, or only one of the TLS files.
    """
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together: give both (PEM files), or neither.")
    for path in (args.tls_cert, args.tls_key):
        if path and not os.path.isfile(path):
            raise UsageError(f"TLS file {path} does not exist.")
    if args.tls_cert:
        import ssl
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.tls_cert, args.tls_key)
        except (ssl.SSLError, OSError) as err:
            raise UsageError(f"Cannot serve TLS with --tls-cert {args.tls_cert} and --tls-key {args.tls_key}: "
                             f"{getattr(err, 'reason', None) or err.strerror or 'not a PEM certificate and its key'}; "
                             "expected PEM files of a certificate (chain) and its private key.") from None
        return "https"
    if not _is_loopback(args.host):
        if not args.insecure_http:
            raise UsageError(f"--host {args.host} is reachable from other machines: serve it over TLS "
                             "(--tls-cert FILE --tls-key FILE), or pass --insecure-http to accept that the token and "
                             "every job's data cross the network in clear (docs/security.md).")
        err_console.print(f"WARNING: serving plain HTTP on {args.host}: the token and every job's data cross the "
                          "network unencrypted; anyone on the path can take over this server. Use --tls-cert/"
                          "--tls-key (docs/security.md).", markup=False, highlight=False, style="bold red")
    return "http"


def cmd_server(args: argparse.Namespace) -> int:
    import socket

    import psutil
    import uvicorn

    from ...supervision import Controller
    from ..api import create_app
    from ...store import make_private
    from ..auth import ensure_token, login_url
    scheme = _check_binding(args)
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
    url = f"{scheme}://{_url_host(args.host)}:{args.port}"  # as this machine's CLI reaches it (wildcard: loopback)
    controller = Controller(state_dir, owner_url=url, recover_every_s=5.0,
                            prometheus_targets=args.prometheus_targets, share_warm_s=args.keep_warm)
    try:
        controller.targets.write("controller", [{"targets": [f"{_url_host(args.host)}:{args.port}"],
                                                 "labels": {"orch_role": "controller"}}])
    except OSError as err:
        err_console.print(f"warning: cannot write the Prometheus targets of this server into "
                   f"{controller.targets.directory}: {err.strerror or err}", markup=False, highlight=False)
    for job_id in controller.recover():
        state = controller.get(job_id).state.value
        then = "" if state == "SUCCEEDED" else " (it is restarted)" if controller.busy(job_id) else \
            " (resume it with orch resume)"
        err_console.print(f"job {job_id}: its controller had gone away; marked {state}{then}",
                          markup=False, highlight=False)
    server_file(state_dir).write_text(json.dumps({"url": url, "pid": os.getpid(),
                                                   "create_time": psutil.Process().create_time()}))
    fixed = make_private(state_dir, walk=True, keep=(controller.targets.directory,))  # from before: 0600/0700
    if fixed:
        err_console.print(f"made {fixed} file(s) and directories under {state_dir} private to you (they were "
                          "readable by others)", markup=False, highlight=False)
    token = ensure_token(state_dir)
    err_console.print(f"orch server {__version__} on {scheme}://{args.host}:{args.port} (state dir {state_dir})",
                      markup=False, highlight=False)
    public = url if _is_loopback(args.host) else f"{scheme}://{socket.getfqdn()}:{args.port}"
    err_console.print(f"dashboard: {login_url(public, token)}\n"
                      f"(the token is in {state_dir / 'server.token'}, readable by you alone; the orch command "
                      "reads it from there, or from $ORCH_TOKEN or --token-file)", markup=False, highlight=False)
    if args.keep_warm > 0:
        err_console.print(f"agents stay warm for {args.keep_warm:g} s after each job, for the next job on the same "
                          "hosts (--keep-warm)", markup=False, highlight=False)
    app = create_app(controller, token, allowed_hosts(args.host, args.allowed_host or []), secure=scheme == "https")
    server = _quiet_server_class()(uvicorn.Config(app, log_level="warning", ssl_certfile=args.tls_cert,
                                                  ssl_keyfile=args.tls_key, timeout_graceful_shutdown=SHUTDOWN_S))
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
