"""Where commands read jobs from: ``orch server``'s HTTP API when one runs for the state directory (or
``--server`` names one), else the state directory itself."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote
from typing import Any

from .output import UsageError


class StoreBackend:
    """Reads the store directly; commands that change state use an embedded controller.

    Reading creates nothing: a state directory without a store simply has no jobs. Jobs
    whose controller died (an ``orch run`` that was killed) are marked FAILED first, so
    what is shown is not stale (:func:`orchestrator.supervision.orphans.recover_orphans`).
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._store = None

    @property
    def store(self) -> Any:
        from ...errors import NotFoundError, StoreFullError
        from ...store import Store
        from ...supervision import recover_orphans
        if self._store is None:
            if not (self.state_dir / "orch.db").is_file():
                raise NotFoundError(f"No jobs in state dir {self.state_dir} (nothing has run with it yet).")
            self._store = Store(self.state_dir / "orch.db")
            try:
                recover_orphans(self._store)
            except StoreFullError as err:  # reading works all the same: say why nothing was marked
                from .output import err_console
                err_console.print(f"warning: {err}", highlight=False, soft_wrap=True)
        return self._store

    def list(self, limit: int = 1000) -> list[dict]:
        """Up to ``limit`` jobs, newest first, with their progress (``observe.job_list``)."""
        from ...errors import NotFoundError
        from ...observe import job_list
        try:
            store = self.store
        except NotFoundError:
            return []
        return job_list(store, limit)

    def detail(self, job_id: str) -> dict:
        """The job's detail; for a job whose ``orch server`` died and whose ranks still run awaiting a new one
        (``supervision/reattach.py``), ``awaiting_server`` says for how long."""
        from ...observe import job_detail
        from ...supervision.orphans import owner_alive
        from ...supervision.reattach import awaiting_reattach
        detail = job_detail(self.store, job_id)
        job = self.store.get_job(detail["id"])
        left = 0.0 if owner_alive(job.owner) else awaiting_reattach(job)
        if left > 0:
            detail["awaiting_server"] = {
                "seconds_left": round(left, 1), "server": (job.owner or {}).get("url"),
                "message": f"its orch server ({(job.owner or {}).get('url')}) is gone; its agents keep its ranks (or, if "
                           f"they ended, their exits), and an orch server started on this state dir within {left:.0f} s "
                           "takes the job over without a restart (after that, running ranks are stopped and the job "
                           "is marked FAILED: controller_lost)"}
        return detail

    def logs(self, job_id: str, rank: int, attempt: int | None, offset: int) -> dict:
        from ...observe import read_log
        return read_log(self.store, job_id, rank, attempt, offset)

    def stacks(self, job_id: str, rank: int | None) -> dict:
        """No server: dump the stacks of the job's running ranks that run on this machine (a local job run by
        ``orch run``), with py-spy directly, into each rank's stacks file next to its log.

        Raises:
            UsageError: the job runs on other machines (ask its server), or is not running.
        """
        from agents.stacks import dump_all
        detail = self.detail(job_id)
        if detail["state"] != "RUNNING":
            raise UsageError(f"Job {detail['id']} is {detail['state']}, not running: there are no stacks to dump "
                             "(orch logs shows what its ranks printed).")
        provisioner = (detail.get("spec") or {}).get("provisioner", "local")
        if provisioner != "local":
            raise UsageError(f"Job {detail['id']} runs on other machines ({provisioner} provisioner) "
                             "and no orch server runs it: dump its stacks on the nodes (py-spy dump --pid PID).")
        wanted = [r for r in detail["ranks"] if r["state"] == "running" and r.get("pid")
                  and (rank is None or r["global_rank"] == rank)]
        if rank is not None and not any(r["global_rank"] == rank for r in detail["ranks"]):
            raise UsageError(f"Job {detail['id']} has no rank {rank} (world size {detail.get('world_size')}).")
        log_dir = os.path.join(detail["run_dir"], "logs")
        procs = [SimpleNamespace(global_rank=r["global_rank"], pid=r["pid"]) for r in wanted]
        return {"job": detail["id"], "attempt": detail["attempt"], "silent_nodes": [],
                "ranks": dict(sorted(dump_all(procs, log_dir).items(), key=lambda kv: int(kv[0])))}

    def cancel(self, job_id: str) -> dict:
        from ...supervision import Controller
        self.store  # noqa: B018 - fails clearly when there is no store
        c = Controller(self.state_dir)
        try:
            c.cancel(job_id)
        finally:
            c.close(cancel=False)
        return self.detail(job_id)


def _job(job_id: str) -> str:
    """A job id (or prefix) as one path segment of a URL.

    Raises:
        NotFoundError: it has characters no job id has (ids are a job name, ``[A-Za-z0-9._-]``, and 6 hex digits).
    """
    from ...errors import NotFoundError
    if not re.fullmatch(r"[A-Za-z0-9._-]+", job_id):
        raise NotFoundError(f"No job {job_id!r}: a job id has only letters, digits, '.', '_' and '-'; `orch list` "
                            "shows the jobs.")
    return quote(job_id, safe="")


class HttpBackend:
    """Talks to ``orch server``."""

    def __init__(self, url: str, token: str | None = None) -> None:
        import httpx
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.has_token = bool(token)
        self.http = httpx.Client(base_url=self.url, timeout=60.0, headers=headers)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise UsageError(f"Cannot reach the orch server at {self.url}: {str(err).rstrip('.')}.") from err
        return self._answer(r)

    def _answer(self, r: Any) -> Any:
        """The JSON of a reply, or the UsageError its status means."""
        if r.status_code == 401 and not self.has_token:
            raise UsageError(f"The orch server at {self.url} needs its token, and none was found: give the state "
                             "dir it runs with (--state-dir), --token-file FILE, or $ORCH_TOKEN.")
        if r.status_code == 401:
            raise UsageError(f"The orch server at {self.url} refused the token: give the one in its state dir's "
                             "server.token (--state-dir, --token-file FILE or $ORCH_TOKEN).")
        if r.status_code >= 400:
            try:
                body = r.json()
                msg = body.get("error") or body.get("detail") or r.text
            except ValueError:
                msg = r.text
            raise UsageError(str(msg))
        return r.json()

    def list(self, limit: int = 1000) -> list[dict]:
        """Up to ``limit`` jobs, newest first."""
        return self._call("GET", "/api/jobs", params={"limit": limit})

    def detail(self, job_id: str) -> dict:
        return self._call("GET", f"/api/jobs/{_job(job_id)}")

    def logs(self, job_id: str, rank: int, attempt: int | None, offset: int) -> dict:
        params: dict[str, Any] = {"rank": rank, "offset": offset}
        if attempt:
            params["attempt"] = attempt
        return self._call("GET", f"/api/jobs/{_job(job_id)}/logs", params=params)

    def stacks(self, job_id: str, rank: int | None) -> dict:
        """Every running rank's stacks now, dumped by the server's agents (``Controller.stacks``)."""
        return self._call("GET", f"/api/jobs/{_job(job_id)}/stacks", params={} if rank is None else {"rank": rank},
                          timeout=60)

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/api/jobs/{_job(job_id)}/cancel")

    def resume(self, job_id: str, exclude: list[str], fresh: bool = False) -> dict:
        # no time limit: the server may first convert the checkpoint for a new world size (minutes)
        return self._call("POST", f"/api/jobs/{_job(job_id)}/resume", json={"exclude": exclude, "fresh": fresh},
                          timeout=None)

    def resume_preview(self, job_id: str, exclude: list[str]) -> dict:
        # no time limit: hashing a large checkpoint against its manifest takes a while
        return self._call("GET", f"/api/jobs/{_job(job_id)}/resume-preview", params={"exclude": ",".join(exclude)},
                          timeout=None)

    def submit(self, spec: dict, source: str, key: str) -> dict:
        """Submit with the idempotency key ``key``: a request whose reply is lost (the connection broke, a
        timeout) is sent again, up to 3 times in all, and the server answers a repeat with the same job."""
        import httpx
        for attempt in range(3):
            try:
                r = self.http.request("POST", "/api/jobs", json={"spec": spec, "source": source},
                                      headers={"Idempotency-Key": key})
            except httpx.HTTPError as err:
                if attempt == 2 or not isinstance(err, httpx.TransportError):  # (timeouts are transport errors)
                    raise UsageError(f"Cannot reach the orch server at {self.url}: {str(err).rstrip('.')}"
                                     f"{f' (tried {attempt + 1} times)' if attempt else ''}.") from err
                time.sleep(0.5 * (attempt + 1))
                continue
            return self._answer(r)
        raise AssertionError("unreachable")


def server_file(state_dir: Path) -> Path:
    return state_dir / "server.json"


def find_server(args: argparse.Namespace) -> str | None:
    """The URL of the server to use: --server/$ORCH_SERVER, else a live one recorded in the state dir."""
    if args.server:
        return args.server
    path = server_file(state_dir_of(args))
    try:
        info = json.loads(path.read_text())
        from ...supervision.orphans import owner_alive
        if owner_alive({**info, "host": socket.gethostname()}):  # the same process (not a reused pid, not a zombie)
            return str(info["url"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def http_backend(args: argparse.Namespace, url: str) -> HttpBackend:
    """A client of the server at ``url``, with the token :func:`orchestrator.face.auth.read_token` finds.

    Raises:
        UsageError: ``--token-file`` cannot be read.
    """
    from ..auth import read_token
    try:
        token = read_token(state_dir_of(args), getattr(args, "token_file", None))
    except OSError as err:
        raise UsageError(f"Cannot read the token file {args.token_file}: {err.strerror or err}.") from None
    except ValueError as err:
        raise UsageError(f"{err}.") from None
    return HttpBackend(url, token)


def pick_backend(args: argparse.Namespace) -> StoreBackend | HttpBackend:
    url = find_server(args)
    return http_backend(args, url) if url else StoreBackend(state_dir_of(args))


def state_dir_of(args: argparse.Namespace) -> Path:
    from ...supervision import default_state_dir
    path = Path(args.state_dir).expanduser().resolve() if args.state_dir else default_state_dir().resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"State dir {path} is not a directory; give --state-dir (or $ORCH_STATE_DIR) a "
                         "directory.")
    return path
