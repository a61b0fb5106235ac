"""The outermost layer of ``robustir serve``'s app: request ids, timing headers, and JSON for every error.

A pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would run each request in an extra task and stream its
answer through a memory channel), doing three things:

* ``X-Request-ID``: the client's (1-128 characters of ``[A-Za-z0-9._:-]``) or a new one, echoed on the answer and
  kept in ``request.state.request_id`` (logged with every server error);
* ``X-Total-Time``: milliseconds from the request's first byte to its answer's headers (the routes add
  ``X-Queue-Time`` and ``X-Inference-Time``);
* an error answer that is not JSON -- FastAPI's request-body limiter answers 413 in plain text from inside the route,
  where no exception handler can reach it -- is rewritten as OpenAI's ``{"error": {...}}``, so a client always gets
  one shape.
"""

from __future__ import annotations

import http
import json
import re
import time
import uuid
from typing import Any

__all__ = ["RequestContext", "error_body", "BODY_TOO_LARGE"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


#: the message of every 413 for a body over --max-body-bytes: FastAPI's limiter answers a too-large Content-Length in
#: plain text from inside the route (rewritten here) and raises the limit found while reading a body without
#: Content-Length to the exception handler (tests/test_server_hardening.py covers both)
BODY_TOO_LARGE = ("the request body is over {limit} bytes (send fewer or shorter inputs per request, or raise "
                  "--max-body-bytes)")


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestContext:
    """See the module docstring. ``max_body_bytes`` names the limit in a rewritten 413."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given if given is not None and _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        held: dict | None = None  # the start of a non-JSON error answer, held until its body is read

        async def send_wrapped(message: dict) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if message["status"] >= 400 and not content_type.startswith(b"application/json"):
                    held = {**message, "headers": headers, "body": b""}
                    return
                headers += [(b"x-request-id", request_id.encode()),
                            (b"x-total-time", f"{(time.perf_counter() - start) * 1000:.2f}".encode())]
                await send({**message, "headers": headers})
                return
            if held is not None and message["type"] == "http.response.body":
                held["body"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                await self._send_json_error(send, held, request_id, start)
                held = None
                return
            await send(message)

        await self.app(scope, receive, send_wrapped)

    async def _send_json_error(self, send: Any, held: dict, request_id: str, start: float) -> None:
        status = held["status"]
        text = held["body"].decode("utf-8", "replace").strip()[:500]
        if status == 413:
            body = error_body(BODY_TOO_LARGE.format(limit=self.max_body_bytes), code="request_too_large")
        else:
            try:
                phrase = http.HTTPStatus(status).phrase
            except ValueError:
                phrase = "error"
            kind = "server_error" if status >= 500 else "invalid_request_error"
            body = error_body(f"{phrase}: {text}" if text and text != phrase else phrase, kind=kind)
        payload = json.dumps(body).encode()
        keep = [(k, v) for k, v in held["headers"] if k.lower() not in (b"content-type", b"content-length")]
        headers = keep + [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                          (b"x-request-id", request_id.encode()),
                          (b"x-total-time", f"{(time.perf_counter() - start) * 1000:.2f}".encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
