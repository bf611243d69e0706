"""The HTTP API of ``orch server``: thin routes over a :class:`~orchestrator.supervision.Controller`.

Every route but ``/login`` and ``/metrics`` needs the server's token (``Authorization: Bearer``) or the
dashboard's cookie, and every request a Host header this server answers to (:mod:`.auth`).

Routes (JSON in and out; errors are ``{"error": message, "kind": ErrorClass}`` with 400,
404 for an unknown job, 409 for an illegal state change, 413 for a body over 8 MiB (:mod:`.limits`), 507 when
the state database cannot be written (a full disk; reads still work)):

* ``GET  /api/health``                       liveness and the state directory
* ``GET  /api/jobs?limit=N``                 the newest N jobs (100), newest first, each with its current attempt's
  ``step``, ``loss``, ``steps_per_second``, ``eta_seconds``, ``total_steps`` (``orchestrator.observe.progress``)
* ``POST /api/jobs``  ``{"spec": {...}}``     submit a job (spec paths absolute); an ``Idempotency-Key`` header
  already used returns that job and starts nothing (the CLI sends one per ``orch submit``)
* ``GET  /api/jobs/{id}``                    a job with its attempts, ranks and ``goodput`` (docs/goodput.md)
* ``GET  /api/jobs/{id}/goodput``            its goodput alone: wall time by category, effective ratio, lost steps
* ``POST /api/jobs/{id}/cancel``             cancel it
* ``POST /api/jobs/{id}/resume`` ``{"exclude": [host, ...], "fresh": false}``  a new attempt from the last complete
  checkpoint, optionally without some hosts
* ``GET  /api/jobs/{id}/events?since=N``     its history
* ``GET  /api/jobs/{id}/plan?attempt=K``     an attempt's plan
* ``GET  /api/jobs/{id}/logs?rank=R&attempt=K&offset=B``  a rank's log from byte B
* ``GET  /api/jobs/{id}/progress?attempt=K&since=ID``  reported steps (id, rank, step, at, loss,
  lr, samples_per_second, tokens_per_second, step_seconds), oldest first, after point ``since``
* ``GET  /login?token=T``                    the dashboard's login: sets its cookie, redirects to ``/``
* ``GET  /metrics``                          the controller's Prometheus metrics (docs/metrics.md), no token
* ``GET  /``                                 the live web dashboard (orchestrator/face/web/index.html)
* ``GET  /static/{file}``                    its script and style sheet (orchestrator/face/web/)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from ..errors import NotFoundError, OrchError, StateError, StoreFullError
from ..observe import job_detail, job_list, read_log
from ..observe.views import goodput_view
from ..spec import spec_from_dict
from ..spec.files import MAX_DEPTH, json_depth
from ..spec.secrets import redact, secret_values
from ..supervision import Controller
from .auth import AUDIT_FILE, TokenAuth
from .limits import MAX_LIST_JOBS, BodyLimit, idempotency_key_ok

__all__ = ["WEB_DIR", "create_app"]

WEB_DIR = Path(__file__).resolve().parent / "web"


def create_app(controller: Controller, token: str, allowed_hosts: list[str], secure: bool = False) -> FastAPI:
    """Build the FastAPI app serving ``controller``: the job routes, health, metrics and the dashboard,
    behind the Host allowlist and the token check (:mod:`.auth`; audit log in the state directory).

    Args:
        token: the server's token (:func:`.auth.ensure_token`).
        allowed_hosts: the Host header values served (anything else: 400).
        secure: the server speaks TLS (the dashboard's cookie is then ``Secure``).
    """
    app = FastAPI(title="orch", version=__version__)
    app.add_exception_handler(OrchError, _orch_error)
    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(_job_routes(controller))
    app.include_router(_service_routes(controller))
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    app.add_middleware(BodyLimit)  # innermost: a refused Host or token costs no body read
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    app.add_middleware(TokenAuth, token=token, audit_path=controller.state_dir / AUDIT_FILE, secure=secure)
    # TokenAuth outermost: every state-changing request is audited, a foreign Host's too (then 400 or 401)
    return app


async def _orch_error(_request: Request, err: OrchError) -> JSONResponse:
    status = 404 if isinstance(err, NotFoundError) else 409 if isinstance(err, StateError) else \
        507 if isinstance(err, StoreFullError) else 400
    return JSONResponse({"error": str(err), "kind": type(err).__name__}, status_code=status)


async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
    # a query or body value of the wrong type (``?limit=abc``), in the API's error shape, naming each field
    problems = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')} (got {str(e.get('input'))[:80]!r})"
                for e in err.errors()[:5]]
    return JSONResponse({"error": "; ".join(problems) or "invalid request", "kind": "ValidationError"},
                        status_code=422)


async def _http_error(_request: Request, err: HTTPException) -> JSONResponse:
    # the framework's own refusals (a body that is not JSON, an unknown route) in the API's error shape
    return JSONResponse({"error": str(err.detail), "kind": "HTTPError"}, status_code=err.status_code,
                        headers=getattr(err, "headers", None))


async def _value_error(_request: Request, err: ValueError) -> JSONResponse:
    return JSONResponse({"error": str(err), "kind": "ValueError"}, status_code=400)


def _submitted_spec(body: dict[str, Any]) -> Any:
    """The spec of a submit's body, within the nesting cap."""
    if json_depth(body) > MAX_DEPTH + 1:  # (+1: the body's own {"spec": ...})
        raise ValueError(f"the submitted spec nests deeper than {MAX_DEPTH} levels, the most orch reads")
    return spec_from_dict(body.get("spec"), source=str(body.get("source", "<submitted spec>")))


def _detail(controller: Controller, job_id: str) -> dict[str, Any]:
    """A job's detail; where the store is behind (a full disk), what its attempt really is, and why."""
    detail = job_detail(controller.store, job_id)
    known = controller.unrecorded(detail["id"])
    if known:
        detail.update(state=known["state"], cause=known["cause"] or detail.get("cause"), unrecorded=known["message"])
    return detail


def _idempotency_key(request: Request) -> str | None:
    """A submit's ``Idempotency-Key`` header (:func:`.limits.idempotency_key_ok`), None without one."""
    key = request.headers.get("idempotency-key")
    if key is not None and not idempotency_key_ok(key):
        raise ValueError("the Idempotency-Key header must be 1 to 200 printable ASCII characters")
    return key


def _job_routes(controller: Controller) -> APIRouter:
    """``/api/jobs`` and everything under it."""
    api = APIRouter(prefix="/api/jobs")
    store = controller.store

    @api.get("")
    def list_jobs(limit: int = 100) -> list[dict[str, Any]]:
        return job_list(store, max(1, min(limit, MAX_LIST_JOBS)))

    @api.post("")
    def submit(body: dict[str, Any], request: Request) -> dict[str, Any]:
        job = controller.submit(_submitted_spec(body), key=_idempotency_key(request))
        return job_detail(store, job.id)

    @api.get("/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        return _detail(controller, job_id)

    @api.post("/{job_id}/cancel")
    def cancel(job_id: str) -> dict[str, Any]:
        job = controller.cancel(job_id)
        return job_detail(store, job.id)

    @api.post("/{job_id}/resume")
    def resume(job_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        exclude = (body or {}).get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(h, str) for h in exclude):
            raise ValueError("'exclude' must be a list of host names")
        fresh = (body or {}).get("fresh", False)
        if not isinstance(fresh, bool):
            raise ValueError("'fresh' must be true or false")
        job = controller.resume(job_id, exclude_hosts=exclude, fresh=fresh)
        return job_detail(store, job.id)

    @api.get("/{job_id}/resume-preview")
    def resume_preview(job_id: str, exclude: str = "") -> dict[str, Any]:
        return controller.resume_preview(job_id, exclude_hosts=[h for h in exclude.split(",") if h])

    def hidden(job: Any, shown: Any) -> Any:
        """``shown`` with the job's secret-looking values masked (its spec's and its plan's)."""
        patterns = (job.spec or {}).get("secret_env") or ()
        values = secret_values(job.spec, patterns)
        if job.attempt:
            values |= secret_values(store.get_attempt(job.id, job.attempt).plan, patterns)
        return redact(shown, patterns, values)

    @api.get("/{job_id}/events")
    def events(job_id: str, since: int = 0) -> list[dict[str, Any]]:
        job = store.get_job(job_id)
        return hidden(job, [e.to_dict() for e in store.events(job.id, since)])

    @api.get("/{job_id}/plan")
    def plan(job_id: str, attempt: int | None = None) -> dict[str, Any]:
        job = store.get_job(job_id)
        return hidden(job, store.get_attempt(job.id, attempt or job.attempt).plan)

    @api.get("/{job_id}/logs")
    def logs(job_id: str, rank: int = 0, attempt: int | None = None, offset: int = 0,
             limit: int = 1 << 20) -> dict[str, Any]:
        return hidden(store.get_job(job_id), read_log(store, job_id, rank, attempt, offset, limit))

    @api.get("/{job_id}/stacks")
    def stacks(job_id: str, rank: int | None = None) -> dict[str, Any]:
        return hidden(store.get_job(job_id), controller.stacks(job_id, rank))

    @api.get("/{job_id}/goodput")
    def goodput(job_id: str) -> dict[str, Any]:
        job = store.get_job(job_id)
        return {"job": job.id, **goodput_view(store, job)}

    @api.get("/{job_id}/progress")
    def progress(job_id: str, attempt: int | None = None, since: int = 0, limit: int = 20_000) -> dict[str, Any]:
        job = store.get_job(job_id)
        number = attempt or job.attempt
        store.get_attempt(job.id, number)  # NotFoundError for an unknown attempt
        points = store.progress(job.id, number, since, limit)
        return {"job": job.id, "attempt": number, "points": points,
                "last_id": points[-1]["id"] if points else since}

    return api


def _service_routes(controller: Controller) -> APIRouter:
    """Health, the controller's Prometheus metrics, the dashboard's page."""
    api = APIRouter()

    @api.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__, "state_dir": str(controller.state_dir),
                "pid": controller.owner["pid"]}

    @api.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(controller.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    return api
