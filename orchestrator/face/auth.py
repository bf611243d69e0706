"""Who may use ``orch server``: a bearer token for the API, a cookie for the dashboard, a Host allowlist,
and an audit log of every request that changes state (docs/security.md).

* **The token** is created at the first ``orch server`` start in ``<state dir>/server.token`` (mode 0600,
  32 random bytes, URL-safe), and read from there by the CLI (or from ``$ORCH_TOKEN``, or
  ``--token-file``). Every request but ``/login`` and ``/metrics`` must carry ``Authorization: Bearer
  <token>`` or the dashboard's cookie; else 401, with nothing in the body but that word.
* **The dashboard** opens from the login URL ``orch server`` prints (``/login?token=...``, as Jupyter
  does): it sets an ``HttpOnly``, ``SameSite=Strict`` cookie holding an HMAC of the token (not the
  token) and redirects to ``/``, so the token leaves the address bar. Rotating the token (deleting the
  file) logs every browser out.
* **/metrics** stays open to Prometheus: the controller's series carry no job name, spec or value, only
  counts by state and cause (``orchestrator.observe.metrics``).
* **Host header**: only the names this server is reached by (loopback, this machine's names and
  addresses, ``--allowed-host``): a page on another site that rebinds its DNS name to this machine
  sends its own name and is refused (400).
* **The audit log** ``<state dir>/audit.log`` (0600, one JSON object per line) records every request
  that is not GET/HEAD/OPTIONS, refused ones included: time, client address, the local user behind a
  client on this machine as the kernel's socket table says (``/proc/net/tcp``), method, path, action
  (``submit``, ``cancel``, ``resume``, ...), job (for a submit: the new job's id), status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import parse_qs

__all__ = ["TOKEN_FILE", "AUDIT_FILE", "COOKIE", "ensure_token", "read_token", "TokenAuth", "login_url",
           "private_file"]

TOKEN_FILE = "server.token"
AUDIT_FILE = "audit.log"
COOKIE = "orch_session"
#: requests that need no token: the login page (it checks the token itself) and Prometheus' scrape
OPEN_PATHS = frozenset({"/login", "/metrics"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def private_file(path: Path) -> None:
    """Make ``path`` readable and writable by its owner only (0600), creating it empty if missing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def ensure_token(state_dir: Path) -> str:
    """The server's token, created (0600) if the state directory has none; an existing file's mode is
    set back to 0600.

    Raises:
        OSError: the file cannot be created or read.
    """
    path = Path(state_dir) / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        token = path.read_text().strip()
        if token:
            return token
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


_TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]{8,512}")


def _token_text(path: Path) -> str:
    """A token file's text: a small regular file (never a pipe or device), UTF-8.

    Raises:
        OSError: it cannot be read, or is not such a file (the message names it, never its content).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
        raise OSError(f"{path} is not a token file (a small regular file holding one line)")
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise OSError(f"{path} is not UTF-8 text, so not a token file") from None


def read_token(state_dir: Path, token_file: str | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token a client sends: ``token_file``'s, else ``$ORCH_TOKEN``, else the state directory's
    ``server.token``; None if there is none (or it cannot be read: the server then answers 401).

    Raises:
        OSError: ``token_file`` cannot be read; ValueError: the token found is not one (a token is 8-512
            URL-safe characters, one line; the message never quotes it).
    """
    if token_file:
        token = _token_text(Path(token_file).expanduser())
        where = f"token file {token_file}"
    elif env.get("ORCH_TOKEN"):
        token, where = env["ORCH_TOKEN"].strip(), "$ORCH_TOKEN"
    else:
        try:
            token, where = _token_text(Path(state_dir) / TOKEN_FILE), f"{Path(state_dir) / TOKEN_FILE}"
        except OSError:
            return None
    if not token:
        return None
    if not _TOKEN_CHARS.fullmatch(token):
        raise ValueError(f"{where} does not hold a token (one line of 8-512 URL-safe characters; not shown)")
    return token


def login_url(base_url: str, token: str) -> str:
    """The dashboard's login URL for ``token`` (``orch server`` prints it)."""
    return f"{base_url.rstrip('/')}/login?token={token}"


def _session(token: str) -> str:
    """The cookie's value: an HMAC of the token, so the cookie alone does not give the API token away."""
    return hmac.new(token.encode(), b"orch dashboard session", hashlib.sha256).hexdigest()


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or []:
        if key == name:
            return value.decode("latin-1")
    return ""


def _cookie(scope: Scope, name: str) -> str:
    for part in _header(scope, b"cookie").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


class TokenAuth:
    """ASGI middleware: the token check, the login page, the audit log (the module docstring).

    Args:
        app: the application to guard.
        token: the server's token.
        audit_path: the audit log (created 0600).
        secure: the server speaks TLS (the cookie is then ``Secure``).
    """

    def __init__(self, app: Callable, token: str, audit_path: Path, secure: bool = False) -> None:
        self.app = app
        self.token = token
        self.session = _session(token)
        self.audit_path = Path(audit_path)
        self.secure = secure
        private_file(self.audit_path)

    def authorized(self, scope: Scope) -> bool:
        """The request carries the token (``Authorization: Bearer``) or the dashboard's cookie."""
        auth = _header(scope, b"authorization")
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), self.token.encode()):
            return True
        cookie = _cookie(scope, COOKIE)
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self.session.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        audited = scope["method"] not in ("GET", "HEAD", "OPTIONS")
        user = _local_user(scope) if audited else None  # now: the client may be gone once answered
        status: dict[str, Any] = {}
        submitted = audited and scope["path"] == "/api/jobs"  # the new job's id is in the answer

        async def send_noting(message: dict[str, Any]) -> None:
            # the entry is written before the client has the whole answer: whoever reads the log after a
            # reply finds the request in it
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if audited and not (submitted and status["code"] == 200):
                    status["logged"] = self._audit(scope, user, status["code"], None)
            elif submitted and message["type"] == "http.response.body" and status.get("code") == 200:
                status["body"] = status.get("body", b"") + message.get("body", b"")
                if not message.get("more_body"):
                    status["logged"] = self._audit(scope, user, 200, _job_of(status["body"]))
            await send(message)

        try:
            if scope["path"] == "/login":
                await self._login(scope, send_noting)
            elif scope["path"] in OPEN_PATHS or self.authorized(scope):
                await self.app(scope, receive, send_noting)
            else:
                await _plain(send_noting, 401, b"unauthorized\n", [(b"www-authenticate", b"Bearer")])
        finally:
            if audited and not status.get("logged"):  # no answer went out (the app failed, the client left)
                self._audit(scope, user, status.get("code", 500), _job_of(status.get("body")))

    async def _login(self, scope: Scope, send: Send) -> None:
        given = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [""])[0]
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            await _plain(send, 401, b"unauthorized\n", [(b"www-authenticate", b"Bearer")])
            return
        cookie = f"{COOKIE}={self.session}; Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if self.secure else "")
        await _plain(send, 303, b"", [(b"location", b"/"), (b"set-cookie", cookie.encode()),
                                      (b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer")])

    def _audit(self, scope: Scope, user: str | None, status: int, job: str | None) -> bool:
        """Append one entry; True (also when the disk refused it: the request was answered all the same)."""
        client = scope.get("client") or ("", 0)
        m = re.match(r"/api/jobs(?:/([^/]+)(?:/([^/]+))?)?/?$", scope["path"])
        action = None if not m else "submit" if not m.group(1) else m.group(2) or scope["method"].lower()
        entry = {"at": round(time.time(), 3), "client": f"{client[0]}:{client[1]}", "user": user,
                 "method": scope["method"], "path": scope["path"], "action": action,
                 "job": job or (m.group(1) if m else None), "status": status, "authorized": self.authorized(scope)}
        try:
            with open(self.audit_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError:
            pass  # a full disk must not take the API down; the request itself was answered
        return True


def _job_of(body: bytes | None) -> str | None:
    """The job id in a submit's answer (``job_detail``: ``{"id": ...}``), if it is one."""
    try:
        job = json.loads(body or b"null")
    except ValueError:
        return None
    return job.get("id") if isinstance(job, dict) and isinstance(job.get("id"), str) else None


def _local_user(scope: Scope) -> str | None:
    """The local user owning the client's socket, for a client on this machine (any of its addresses): the
    ``uid`` column of the kernel's socket table (``/proc/net/tcp``, ``tcp6``) for the connection from the
    client's port to ours."""
    client, server = scope.get("client"), scope.get("server")
    if not client or not server:
        return None  # (a remote client's socket is not in this machine's table: no row matches it)
    import pwd
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            try:
                local, remote, uid = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16), \
                    int(fields[7])
            except (IndexError, ValueError):
                continue
            if local == client[1] and remote == server[1]:
                try:
                    return pwd.getpwuid(uid).pw_name
                except KeyError:
                    return f"uid {uid}"
    return None


async def _plain(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
