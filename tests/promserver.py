"""A real Prometheus server for tests, and the PromQL of a Grafana dashboard.

    check_prerequisites()                      # /usr/bin/prometheus is there, or a clear error
    with PrometheusServer(config, tmp_path) as prom:
        prom.url                               # 'http://127.0.0.1:40123'
        prom.targets()                         # active targets, as /api/v1/targets lists them
        prom.query('orch_agent_up{job="j"}')   # [{'metric': {...}, 'value': [ts, '1']}]
        prom.wait_for('orch_agent_up', lambda r: len(r) == 2, timeout=10)

    for title, expr in dashboard_queries("dashboards/orch-job.json", job="j"):
        prom.query(expr)                       # AssertionError with Prometheus' text if bad

The server is Debian's ``prometheus`` package (``apt-get install prometheus``), started with
its data in ``<workdir>/data`` and its output in ``<workdir>/prometheus.log``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from typing_extensions import Self

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")

_VAR_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class PrometheusError(RuntimeError):
    """The Prometheus server could not be started, or stopped answering."""


def check_prerequisites() -> None:
    """Raise :class:`PrometheusError` unless ``/usr/bin/prometheus`` and ``promtool`` exist.

    Both come with Debian's ``prometheus`` package; CI installs it with apt.
    """
    missing = [str(p) for p in (PROMETHEUS, PROMTOOL) if not os.access(p, os.X_OK)]
    if missing:
        raise PrometheusError(
            f"{', '.join(missing)} not found: these tests need a Prometheus server "
            "(Debian/Ubuntu: apt-get install prometheus)")


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``addr`` a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a text file, or a note that it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class PrometheusServer:
    """``/usr/bin/prometheus`` on 127.0.0.1, for the duration of a ``with`` block.

    ``config_path``: the configuration file (relative ``file_sd`` paths in it resolve against
    its directory). ``workdir``: an existing directory for the TSDB (``data/``) and the log
    (``prometheus.log``, Prometheus' stdout and stderr). ``port``: where to listen; by default
    a free one (tried again with another port, up to 3 times, if it was taken meanwhile).
    ``ready_timeout``: seconds to wait for ``/-/ready``.

    Entering starts the server and returns once ``/-/ready`` answers 200; a server that exits
    or does not get ready raises :class:`PrometheusError` with the tail of its log. Leaving
    terminates it (SIGTERM, then SIGKILL after 10 s) and waits for it.
    """

    def __init__(self, config_path: str | Path, workdir: str | Path, *, port: int | None = None,
                 ready_timeout: float = 30.0) -> None:
        self.config_path = Path(config_path).resolve()
        self.workdir = Path(workdir).resolve()
        self.log_path = self.workdir / "prometheus.log"
        self.ready_timeout = ready_timeout
        self._port = port
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: httpx.Client | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` of the running server."""
        if self.port is None:
            raise PrometheusError("the Prometheus server is not running")
        return f"http://127.0.0.1:{self.port}"

    def argv(self, port: int) -> list[str]:
        """The command line the server runs with on ``port``."""
        return [
            str(PROMETHEUS),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            # A throwaway TSDB: keep only what a test can look at, and never wait on the
            # default 15 d retention's bookkeeping.
            "--storage.tsdb.retention.time=1h",
            # Lets a test reload a changed configuration (POST /-/reload).
            "--web.enable-lifecycle",
        ]

    def __enter__(self) -> Self:
        check_prerequisites()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._client = httpx.Client(timeout=10.0, trust_env=False)
        tries = 1 if self._port is not None else 3
        try:
            for attempt in range(1, tries + 1):
                port = self._port if self._port is not None else free_port()
                if self._start(port, last=attempt == tries):
                    break
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, port: int, *, last: bool) -> bool:
        """Start on ``port`` and wait for ``/-/ready``; False if the port was taken (and
        this is not the ``last`` try). Raises :class:`PrometheusError` on any other failure."""
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting on port {port}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv(port), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir)
        self.port = port
        deadline = time.monotonic() + self.ready_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                self.port = None
                tail = _tail(self.log_path)
                if not last and "address already in use" in tail:
                    return False
                raise PrometheusError(
                    f"prometheus exited with status {code} before it was ready; "
                    f"{self.log_path} ends with:\n{tail}")
            try:
                resp = self._http().get(f"{self.url}/-/ready", timeout=1.0)
                if resp.status_code == 200:
                    return True
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"prometheus was not ready within {self.ready_timeout} s; "
                    f"{self.log_path} ends with:\n{_tail(self.log_path)}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.port = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _http(self) -> httpx.Client:
        if self._client is None:
            raise PrometheusError("the Prometheus server is not running")
        return self._client

    # ------------------------------------------------------------------ API

    def _api(self, method: str, path: str, **kwargs: Any) -> Any:
        """``data`` of an ``/api/v1`` answer; AssertionError with Prometheus' error text if
        the answer's status is not ``success``."""
        resp = self._http().request(method, f"{self.url}/api/v1/{path}", **kwargs)
        try:
            body = resp.json()
        except json.JSONDecodeError:
            raise AssertionError(
                f"{method} /api/v1/{path}: HTTP {resp.status_code}, not JSON: "
                f"{resp.text[:500]}") from None
        if body.get("status") != "success":
            raise AssertionError(
                f"{method} /api/v1/{path} {kwargs.get('params') or kwargs.get('data')}: "
                f"HTTP {resp.status_code}, {body.get('errorType')}: {body.get('error')}")
        return body.get("data")

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant query of ``expr`` at Unix ``time`` (seconds; default now).

        Returns the result as a list of ``{"metric": {label: value}, "value": [ts, "v"]}``;
        a scalar or string result is one such dict with empty ``metric``. Raises
        AssertionError with Prometheus' error text (e.g. ``bad_data: 1:5: parse error: ...``)
        if Prometheus rejects the expression.
        """
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = f"{time:.3f}"
        data = self._api("POST", "query", data=params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """Range query of ``expr`` from ``start`` to ``end`` (Unix seconds) every ``step`` s, as a
        Grafana time-series panel runs it. Returns ``[{"metric": {...}, "values": [[ts, "v"], ...]}]``;
        AssertionError with Prometheus' error text if it rejects the expression."""
        data = self._api("POST", "query_range", data={"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                      "step": f"{step:g}"})
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        """The active targets (``/api/v1/targets?state=active``): dicts with ``labels``,
        ``discoveredLabels``, ``scrapeUrl``, ``health`` ('up', 'down', 'unknown'),
        ``lastError``, ..."""
        return list(self._api("GET", "targets", params={"state": "active"})["activeTargets"])

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        """Values of ``label`` (``/api/v1/label/<label>/values``), only on series that match
        the selector ``match`` if given: what Grafana's ``label_values(match, label)`` lists."""
        params = {"match[]": match} if match is not None else None
        return list(self._api("GET", f"label/{label}/values", params=params))

    def wait_for(self, expr: str, predicate: Callable[[list[dict[str, Any]]], bool],
                 timeout: float, interval: float = 0.2) -> list[dict[str, Any]]:
        """Query ``expr`` every ``interval`` s until ``predicate(result)`` is true; return that
        result. AssertionError with the last result after ``timeout`` s."""
        return _poll(lambda: self.query(expr), predicate, timeout, interval, f"query {expr!r}")

    def wait_for_targets(self, predicate: Callable[[list[dict[str, Any]]], bool],
                         timeout: float, interval: float = 0.2) -> list[dict[str, Any]]:
        """Like :meth:`wait_for`, on :meth:`targets`."""
        return _poll(self.targets, predicate, timeout, interval, "the active targets")

    def reload(self) -> None:
        """Reload the configuration file (POST ``/-/reload``); AssertionError if refused."""
        resp = self._http().post(f"{self.url}/-/reload")
        if resp.status_code != 200:
            raise AssertionError(f"reload refused: HTTP {resp.status_code}: {resp.text}")


def _poll(get: Callable[[], Any], predicate: Callable[[Any], bool], timeout: float,
          interval: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting on {what}; last: {value}")
        time.sleep(interval)


# ---------------------------------------------------------------------- dashboards

def iter_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel of a Grafana ``panels`` list, rows' nested ``panels`` included (a row
    comes before its nested panels)."""
    out: list[dict[str, Any]] = []
    for panel in panels:
        out.append(panel)
        out.extend(iter_panels(panel.get("panels") or []))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with every ``$name`` and ``${name}`` replaced by ``values[name]``.

    Raises ValueError naming a variable that ``values`` lacks (so a dashboard using an
    unknown variable fails loudly instead of sending ``$foo`` to Prometheus)."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise ValueError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]
    return _VAR_RE.sub(repl, expr)


def dashboard_queries(path: str | Path, job: str, attempt: str = "1",
                      rate_interval: str = "20s", interval: str = "5s") -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every target of every panel of the Grafana dashboard at
    ``path`` (rows' nested panels included), in panel order, with the variables ``$job``,
    ``$attempt`` (a plain value: it still matches itself as an ``=~`` regex), and Grafana's
    ``$__rate_interval`` and ``$__interval`` (durations, e.g. ``"20s"``) substituted.

    Raises ValueError for an unknown variable, KeyError/JSONDecodeError for a malformed file.
    """
    board = json.loads(Path(path).read_text())
    values = {"job": job, "attempt": attempt, "__rate_interval": rate_interval,
              "__interval": interval}
    queries = []
    for panel in iter_panels(board.get("panels") or []):
        for target in panel.get("targets") or []:
            queries.append((str(panel.get("title", "")), substitute(target["expr"], values)))
    return queries
