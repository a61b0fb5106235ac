"""The HTTP routes of ``robustir serve`` (:func:`_router`): each maps its request onto a handler
(:mod:`robustir.serving.handlers`), which calls the engine (:class:`~robustir.serving.service.Server`). They are made
per app, not at module level, because their body types carry that app's limits
(:func:`robustir.serving.schemas.request_models`: pydantic checks sizes and counts, and ``/docs`` shows them)."""

# no "from __future__ import annotations": FastAPI reads the routes' body types (made per app) at run time

import hmac
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer


from . import handlers
from . import responses as answers
from .errors import ApiError
from .service import _server

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



def _router(embedding_request: type, search_request: type, rerank_request: type, documents_request: type,
            delete_request: type, max_body_bytes: int) -> APIRouter:
    """The routes, with the request models of :func:`request_models` as their bodies."""
    router = APIRouter(max_body_size=max_body_bytes)
    keyed = [Depends(authorize)]
    _operation_routes(router, keyed)
    _model_routes(router, keyed, embedding_request, search_request, rerank_request)
    _document_routes(router, keyed, [Depends(authorize_write)], documents_request, delete_request)
    return router


def _operation_routes(router: APIRouter, keyed: list) -> None:
    @router.get("/health", tags=["operations"], response_model=answers.HealthAnswer)
    async def health(request: Request):
        return await handlers.health(_server(request))

    @router.get("/info", dependencies=keyed, tags=["operations"], response_model=answers.InfoAnswer)
    async def info(request: Request):
        return await handlers.info(_server(request))

    @router.get("/v1/models", dependencies=keyed, tags=["openai"], response_model=answers.ModelList)
    async def models(request: Request):
        s = _server(request)
        return handlers._answer({"object": "list", "data": [{"id": name, "object": "model", "created": s.created,
                                                             "owned_by": "robustir"} for name in s.model_names()]})

    @router.get("/v1/models/{model_id:path}", dependencies=keyed, tags=["openai"], response_model=answers.ModelCard)
    async def one_model(model_id: str, request: Request):
        s = _server(request)
        s.check_model(model_id, s.reranker_name)
        return handlers._answer({"id": model_id if model_id == s.reranker_name else s.name, "object": "model",
                                 "created": s.created, "owned_by": "robustir"})


def _model_routes(router: APIRouter, keyed: list, embedding_request: type, search_request: type,
                  rerank_request: type) -> None:
    @router.post("/v1/embeddings", dependencies=keyed, tags=["openai"], response_model=answers.EmbeddingList)
    async def embeddings(body: embedding_request, request: Request):  # type: ignore[valid-type]
        return await handlers.embeddings(_server(request), body, request)

    @router.post("/search", dependencies=keyed, tags=["search"], response_model=answers.SearchAnswer)
    async def search(body: search_request, request: Request):  # type: ignore[valid-type]
        return await handlers.search(_server(request), body, request)

    @router.post("/v1/rerank", dependencies=keyed, tags=["rerank"], response_model=answers.RerankAnswer)
    async def rerank(body: rerank_request, request: Request):  # type: ignore[valid-type]
        """Order ``documents`` by relevance to ``query`` (Infinity's and Cohere's shape): the cross-encoder of
--rerank-model, else the served embedding model's cosine."""
        return await handlers.rerank(_server(request), body, request)


def _document_routes(router: APIRouter, keyed: list, write_keyed: list, documents_request: type,
                     delete_request: type) -> None:
    @router.post("/documents", dependencies=write_keyed, tags=["documents"], response_model=answers.Upserted)
    async def add_documents(body: documents_request, request: Request):  # type: ignore[valid-type]
        """Insert documents, replacing those whose id exists (``robustir index --upsert``), answered once committed;
``/search`` finds them on its next query."""
        return await handlers.upsert_documents(_server(request), body)

    @router.delete("/documents", dependencies=write_keyed, tags=["documents"], response_model=answers.Deleted)
    async def delete_documents_route(body: delete_request, request: Request):  # type: ignore[valid-type]
        """Delete documents by ``ids`` or by ``filter`` (``robustir index --delete``: one commit, all or nothing)."""
        return await handlers.delete_documents(_server(request), body)

    @router.get("/documents/{document_id:path}", dependencies=keyed, tags=["documents"], response_model=answers.DocumentAnswer)
    async def get_document(document_id: str, request: Request):
        """The document with this id (an id may hold ``/``: ``GET /documents/a/b`` is the document ``a/b``)."""
        return await handlers.get_document(_server(request), document_id)
