"""The HTTP routes of ``robustir serve``: :data:`router`, built once at module level. Each route maps its request
onto a handler (:mod:`robustir.serving.handlers`), which calls the engine (:class:`~robustir.serving.service.Server`,
a dependency read from ``request.app.state``).

A request body is validated by a dependency (:func:`_body`) with the app's own copy of its model
(:func:`robustir.serving.schemas.request_models`, kept in ``app.state.requests``), so each app's limits (texts per
request, characters per text, ``top_k``) are pydantic ``Field`` constraints, checked with pydantic's errors (a 400
naming the field, as before); :func:`openapi` puts the same models into the app's ``/openapi.json``, so ``/docs``
shows that app's limits. FastAPI has no per-app body type on a shared route, nor a pydantic validation context; a
dependency plus the app's OpenAPI hook (FastAPI's documented way to extend the schema) is its own machinery for this.
"""

# no "from __future__ import annotations": FastAPI reads the routes' annotations at run time

import hmac
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError

from . import handlers
from . import responses as answers
from .errors import ApiError, BodyError
from .service import Server, _server

logger = logging.getLogger(__name__)


_bearer = HTTPBearer(auto_error=False, description="The server's API key, when it was started with one")


async def authorize(request: Request,
                    credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """The API-key check of every reading route (all but ``/health``, ``/metrics`` and the writes): the read-write
    key (``--api-key``) or the read-only one (``--read-api-key``); constant-time comparisons. ``async``: FastAPI runs
    a plain ``def`` dependency on its thread pool, a thread hop per request (issue 55: 30-41 threads at 32 clients)."""
    _check_key(_server(request), credentials, write=False)


async def authorize_write(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """The API-key check of POST and DELETE ``/documents``: the read-write key only; the read-only key gets 403
    naming the scope it lacks."""
    _check_key(_server(request), credentials, write=True)


def _check_key(s: Any, credentials: HTTPAuthorizationCredentials | None, write: bool) -> None:
    if s.api_key is None and s.read_key is None:
        return
    if credentials is None or not credentials.credentials:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
    given = credentials.credentials.strip().encode()
    writes = s.api_key is not None and hmac.compare_digest(given, s.api_key.encode())
    reads = s.read_key is not None and hmac.compare_digest(given, s.read_key.encode())
    if not writes and not reads:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    if write and not writes:
        raise ApiError(403, "this API key has the 'read' scope only (search, embeddings, rerank, models, info, GET "
                       "/documents); POST and DELETE /documents need the 'write' scope: the server's read-write key "
                       "(--api-key)", code="insufficient_scope")


def _body(name: str) -> Any:
    """The dependency that validates a route's body with the app's model ``name`` (its limits as constraints)."""

    async def validated(request: Request, body: Annotated[Any, Body()]) -> Any:
        model = request.app.state.requests[name]
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise BodyError(exc, body, model) from None

    validated.model_name = name  # type: ignore[attr-defined]
    return validated


async def _service(request: Request) -> Server:
    """The engine, as a dependency: ``async``, as the key checks, so FastAPI does not hop to its thread pool."""
    return _server(request)


Service = Annotated[Server, Depends(_service)]
_keyed, _write_keyed = [Depends(authorize)], [Depends(authorize_write)]
router = APIRouter()
"""Every route of the API (:func:`robustir.serving.app.create_app` includes it in each app)."""


@router.get("/health", tags=["operations"], response_model=answers.HealthAnswer)
async def health(s: Service):
    return await handlers.health(s)


@router.get("/info", dependencies=_keyed, tags=["operations"], response_model=answers.InfoAnswer)
async def info(s: Service):
    return await handlers.info(s)


@router.get("/v1/models", dependencies=_keyed, tags=["openai"], response_model=answers.ModelList)
async def models(s: Service):
    return handlers._answer({"object": "list", "data": [{"id": name, "object": "model", "created": s.created,
                                                         "owned_by": "robustir"} for name in s.model_names()]})


@router.get("/v1/models/{model_id:path}", dependencies=_keyed, tags=["openai"], response_model=answers.ModelCard)
async def one_model(model_id: str, s: Service):
    s.check_model(model_id, s.reranker_name)
    return handlers._answer({"id": model_id if model_id == s.reranker_name else s.name, "object": "model",
                             "created": s.created, "owned_by": "robustir"})


@router.post("/v1/embeddings", dependencies=_keyed, tags=["openai"], response_model=answers.EmbeddingList)
async def embeddings(body: Annotated[Any, Depends(_body("EmbeddingRequest"))], s: Service, request: Request):
    return await handlers.embeddings(s, body, request)


@router.post("/search", dependencies=_keyed, tags=["search"], response_model=answers.SearchAnswer)
async def search(body: Annotated[Any, Depends(_body("SearchRequest"))], s: Service, request: Request):
    return await handlers.search(s, body, request)


@router.post("/v1/rerank", dependencies=_keyed, tags=["rerank"], response_model=answers.RerankAnswer)
async def rerank(body: Annotated[Any, Depends(_body("RerankRequest"))], s: Service, request: Request):
    """Order ``documents`` by relevance to ``query`` (Infinity's and Cohere's shape): the cross-encoder of
--rerank-model, else the served embedding model's cosine."""
    return await handlers.rerank(s, body, request)


@router.post("/documents", dependencies=_write_keyed, tags=["documents"], response_model=answers.Upserted)
async def add_documents(body: Annotated[Any, Depends(_body("DocumentsRequest"))], s: Service):
    """Insert documents, replacing those whose id exists (``robustir index --upsert``), answered once committed;
``/search`` finds them on its next query."""
    return await handlers.upsert_documents(s, body)


@router.delete("/documents", dependencies=_write_keyed, tags=["documents"], response_model=answers.Deleted)
async def delete_documents(body: Annotated[Any, Depends(_body("DeleteRequest"))], s: Service):
    """Delete documents by ``ids`` or by ``filter`` (``robustir index --delete``: one commit, all or nothing)."""
    return await handlers.delete_documents(s, body)


@router.get("/documents/{document_id:path}", dependencies=_keyed, tags=["documents"],
            response_model=answers.DocumentAnswer)
async def get_document(document_id: str, s: Service):
    """The document with this id (an id may hold ``/``: ``GET /documents/a/b`` is the document ``a/b``)."""
    return await handlers.get_document(s, document_id)


def openapi(app: FastAPI) -> dict:
    """The app's OpenAPI schema (``app.openapi``): FastAPI's, with each body the app's own model (its limits)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for route in router.routes:  # this module's (the app holds them as an included router)
            for name in filter(None, (getattr(d.call, "model_name", None) for d in route.dependant.dependencies)):
                schema = app.state.requests[name].model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}), **{name: schema})
                for method in route.methods:
                    spec["paths"][route.path_format][method.lower()]["requestBody"] = {
                        "required": True, "content": {"application/json": {"schema": {
                            "$ref": f"#/components/schemas/{name}"}}}}
        app.openapi_schema = spec
    return app.openapi_schema
