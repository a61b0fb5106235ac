"""The server's errors: :class:`ApiError` (OpenAI's error shape) and the handler that answers every exception
with it -- pydantic's validation errors reworded to name the field, HTTP errors, and anything unexpected (a 500
naming the request id, logged with its traceback)."""

import json
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .middleware import BODY_TOO_LARGE, error_body

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


class BodyError(RequestValidationError):
    """pydantic's errors on a request body that a route validated with the app's model
    (:func:`robustir.serving.routes._body`), placed under ``body`` as FastAPI places them; ``fields``: what the
    model takes (named when an unknown field is sent)."""

    def __init__(self, exc: Any, body: Any, model: type) -> None:
        super().__init__([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)], body=body)
        self.fields = tuple(model.model_fields)


_PYDANTIC_WORDING = (("Input should be ", "must be "), ("Value should have", "must have"),
                     ("a valid dictionary", "a JSON object"), ("a valid list", "a JSON list"))


def _param(loc: tuple, body: Any) -> str | None:
    parts = [p for p in loc[1:] if p != "body"] if loc and loc[0] == "body" else list(loc)
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    field_value = body.get(parts[0]) if isinstance(body, dict) else None
    flat = parts[0] == "vector" and isinstance(field_value, list) and field_value and not isinstance(field_value[0],
                                                                                                  list)
    if (isinstance(field_value, str) or flat) and len(parts) > 1 and parts[1] == 0:  # one text (vector) as a list
        out = str(parts[0]) + out[len(f"{parts[0]}[0]"):]
    return out


def _validation_error(exc: RequestValidationError, fields: tuple[str, ...]) -> ApiError:
    """pydantic's first error as one OpenAI-shaped 400 naming the field (``input[3]``, ``fusion.rrf_k``)."""
    errors = exc.errors()
    first = errors[0]
    kind, loc, ctx = first.get("type", ""), tuple(first.get("loc", ())), first.get("ctx") or {}
    body = exc.body
    param = _param(loc, body)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if kind == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({ctx.get('error', 'decode error')} at character "
                        f"{loc[-1] if loc else '?'})")
    if kind == "model_attributes_type" or (param is None and kind.endswith("_type")):
        return ApiError(400, f"the request body must be a JSON object, got {_type(first.get('input'))}")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        takes = f"; this endpoint takes {', '.join(fields)}" if "." not in (param or "") else ""
        return ApiError(400, f"unrecognized request argument '{param}'{takes}", param=param)
    if kind == "missing":
        return ApiError(400, f"'{param}' is required{more}", param=param)
    if kind == "query_or_vector" and not (isinstance(body, dict) and body.get("query") is not None):
        return ApiError(400, "'query' is required (or 'vector', to search by vector)", param="query")
    if kind in ("ids_or_filter", "query_or_vector"):
        return ApiError(400, first["msg"])
    if kind == "token_ids_not_supported":
        where = f"{param}[{ctx.get('index', 0)}]"
        return ApiError(400, f"'{where}' {first['msg']}", param=where, code=kind)
    if kind == "too_long" and param in ("input", "query"):
        return ApiError(400, f"'{param}' holds {ctx.get('actual_length')} items; at most {ctx.get('max_length')} per "
                        "request (split it into several requests)", param=param, code="too_many_inputs")
    if kind == "too_long" and param == "documents":  # /v1/rerank's (it has a query) or POST /documents'
        bound = ("at most {most} per request: each is one pair for the reranker (the smaller of --max-rerank-pairs "
                 "and --max-inputs-per-request)" if isinstance(body, dict) and "query" in body else
                 "at most {most} per request (--max-inputs-per-request)")
        return ApiError(400, f"'documents' holds {ctx.get('actual_length')} items; "
                        + bound.format(most=ctx.get("max_length")) + "; split them into several requests",
                        param=param, code="too_many_inputs")
    if kind == "too_short" and param in ("input", "query"):
        return ApiError(400, f"'{param}' is an empty list; send at least one string", param=param)
    if kind == "string_too_long" and param and param.split("[")[0] in ("input", "query"):
        return ApiError(400, f"'{param}' has {len(first.get('input') or '')} characters; at most "
                        f"{ctx.get('max_length')} per text (split it into passages)", param=param,
                        code="input_too_long")
    if kind == "string_unicode":
        return ApiError(400, f"'{param}' is not valid Unicode (a lone surrogate: in JSON a \\ud8xx escape must be "
                        "followed by its \\udcxx pair; send text encoded as UTF-8)", param=param, code="invalid_unicode")
    message = re.sub(r"a dictionary or an instance of \w+", "a JSON object", first.get("msg", "is not valid"))
    for old, new in _PYDANTIC_WORDING:
        message = message.replace(old, new)
    if kind in ("empty_text", "invalid_unicode"):
        return ApiError(400, f"'{param}' {message}", param=param, code=kind)
    given = first.get("input")
    shown = f", got {_type(given)}" if isinstance(given, (dict, list)) else f", got {_show(given)}"
    return ApiError(400, f"'{param}' {message[0].lower() + message[1:]}{shown}{more}", param=param)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number", bytes: "non-JSON bytes"}.get(type(value), type(value).__name__)


def _parse_failure(exc: BaseException | None) -> str:
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8"
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"


ROUTES = ("POST /v1/embeddings, POST /search, POST /v1/rerank, POST|DELETE /documents, GET /documents/{id}, "
          "GET /v1/models, GET /info, GET /health, GET /metrics")


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: every error the app raises becomes OpenAI's ``{"error": {...}}``."""
    if isinstance(exc, RequestValidationError):
        exc = _validation_error(exc, getattr(exc, "fields", ()))
        request.app.state.server.metrics.reject("invalid")
    elif isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        if status == 404:
            exc = ApiError(404, f"{request.method} {request.url.path}: robustir serve (an embeddings and search "
                           f"server) has no such route; routes: {ROUTES}", code="route_not_found")
        elif status == 405:
            exc = ApiError(405, f"{request.method} {request.url.path}: method not allowed; routes: {ROUTES}",
                           code="method_not_allowed")
        elif status == 400:
            exc = ApiError(400, f"the request body could not be read: {_parse_failure(exc.__cause__)}")
        elif status == 413:
            exc = ApiError(413, BODY_TOO_LARGE.format(limit=request.app.state.server.config.max_body_bytes),
                           code="request_too_large")
        else:
            exc = ApiError(status, f"{request.method} {request.url.path}: {exc.detail}")
    elif not isinstance(exc, ApiError):
        request_id = getattr(request.state, "request_id", "?")
        logger.error("request %s: %s %s failed", request_id, request.method, request.url.path,
                     exc_info=(type(exc), exc, exc.__traceback__))
        exc = ApiError(500, f"internal server error ({type(exc).__name__}); request id {request_id}",
                       kind="server_error", code="internal_error")
        exc.headers = {"X-Request-ID": request_id}  # answered outside the request-id middleware
    headers = dict(exc.headers or {})
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

