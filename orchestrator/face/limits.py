"""What one request to ``orch server`` may cost: a cap on its body, the same cap a spec file has.

A body larger than :data:`~orchestrator.spec.files.MAX_INPUT_BYTES` (8 MiB) is refused with 413 before
more than that is read, whether it says its length (``Content-Length``) or not (chunked); the app sees
only bodies under the cap. The nesting cap on what the body holds is the submit route's
(:func:`orchestrator.spec.files.json_depth`, :data:`~orchestrator.spec.files.MAX_DEPTH`), as for a
spec read from a file (docs/security.md, "Input limits").
"""

from __future__ import annotations

import json
from typing import Any

from ..spec.files import MAX_INPUT_BYTES
from .auth import Receive, Scope, Send

__all__ = ["BodyLimit", "idempotency_key_ok", "MAX_LIST_JOBS"]

#: The most jobs one ``GET /api/jobs`` lists (``orch list --all`` asks for this many).
MAX_LIST_JOBS = 1_000_000


def idempotency_key_ok(key: str) -> bool:
    """Whether ``key`` may be a submit's idempotency key: 1 to 200 printable ASCII characters (it travels
    as an HTTP header, so nothing else could)."""
    return 0 < len(key) <= 200 and key.isascii() and key.isprintable()


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 and never reaches the app.

    The body is read here (at most ``limit`` + one chunk) and handed on whole; a client that goes away
    midway reaches the app as the disconnect it is.

    Args:
        app: the application to guard.
        limit: the most bytes a body may have (default :data:`MAX_INPUT_BYTES`).
    """

    def __init__(self, app: Any, limit: int = MAX_INPUT_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app hears it
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": f"the request body is larger than {self.limit >> 20} MiB, the most orch "
                                    "reads (a spec's limit)", "kind": "RequestTooLarge"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict[str, Any]], then: Receive | None = None) -> Receive:
    """A ``receive`` that gives ``messages``, then defers to ``then`` (a disconnect, later)."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
