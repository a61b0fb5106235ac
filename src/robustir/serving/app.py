"""The FastAPI app of ``robustir serve``: OpenAI-compatible embeddings and search over a :class:`SearchIndex`.

Routes (an :class:`fastapi.APIRouter` whose handlers read the app's :class:`Server` from ``app.state``; request bodies
are the pydantic models of :mod:`robustir.serving.schemas`, so ``/docs`` shows them with their limits):

* ``POST /v1/embeddings`` -- OpenAI's request and response: ``input`` (a string or a list of strings; token-id
  arrays are refused with 400), ``model``, ``encoding_format`` (``float``, or ``base64``: little-endian float32, what
  the ``openai`` client asks for by default), ``dimensions`` (only for sizes the model was trained for, declared
  with ``--matryoshka-dims``; the vector is cut and re-normalised), ``user`` (ignored); plus the extension
  ``input_type``: ``document`` or ``query`` (the model's query instruction and query length apply); without it, the
  server's ``--default-input-type`` (``document`` unless set: LangChain and LlamaIndex send no ``input_type``, so a
  server for their queries is started with ``--default-input-type query``). ``usage`` counts the tokens the model saw
  (instruction and special tokens included, after truncation).
* ``POST /search`` -- ``{"query": str | [str], "top_k": int, "filter": {...}, "mode": "dense" | "lexical" |
  "hybrid", "fusion": {"rrf_k", "dense_weight", "lexical_weight", "candidates"}}`` ->
  ``{"hits": [{"id", "score", "title", "text", "fields"}]}`` (for a list of queries, a list of such lists). ``dense``
  (default) searches with the model, ``lexical`` with BM25 over title and text (no model), ``hybrid`` fuses both
  lists by reciprocal rank (``fusion``, as ``robustir eval --mode hybrid``; only with ``hybrid``). The filter is
  :mod:`robustir.index.store.filters`' JSON language: ``{"lang": "en"}``, ``{"lang": ["en", "de"]}``,
  ``{"year": {"$gte": 2020, "$lt": 2024}}``, ``$eq``/``$ne``/``$in``/``$nin``, nested fields by dotted name
  (``{"meta.source": "pubmed"}``) and ``$and``/``$or``/``$not``; it is checked before the model runs. Every query
  reads the index's latest committed version: ``robustir index --add / --upsert / --delete`` while the server runs
  show on the next query, with no restart.
* ``GET /info`` -- the model, its dimensions and token lengths, the limits, the version; ``GET /v1/models``.
* ``GET /health`` and ``GET /metrics`` (Prometheus, :mod:`robustir.serving.metrics`) need no key.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, from one exception handler
(:func:`_error_response`) -- a server bug too (500, with the request id) -- and the middleware
(:mod:`robustir.serving.middleware`) for the body limiter's 413:

* 400 for a malformed request (bad JSON, a missing or unknown field, a wrong type, too many inputs, an input too
  long, a blank or non-Unicode text, an unsupported ``dimensions``, a bad filter, whose message names the place in
  it, e.g. ``filter.year.$gt``);
* 401 without the right ``Authorization: Bearer KEY`` when the server has an API key; 403 (``insufficient_scope``)
  for the read-only key (``--read-api-key``) on POST / DELETE ``/documents``;
* 404 for a ``model`` that is not the served one (OpenAI's ``model_not_found``), for ``/search`` on a server without
  an index, and for an unknown route;
* 413 for a body over ``--max-body-bytes`` and for a search over ``--max-hits-per-request`` (queries x ``top_k``) or
  whose answer would be over ``--max-response-bytes``;
* 429 with ``Retry-After`` when ``--max-queued-texts`` texts already wait for the models (a rerank's
  ``(query, document)`` pairs count as texts: the cross-encoder's work goes through the same queue);
* 503 with ``Retry-After`` for a request one of whose micro-batches waited ``--request-timeout-s`` in the queue for a
  model worker (encoding time does not count: a 1,500-text request on an idle CPU finishes);
* a client that disconnects cancels its micro-batches that have not started (logged as 499), an embedding's or a
  rerank's alike;
* 500 when the model fails on a request -- that request only: a failing batch is re-run request by request.

Answers carry ``X-Request-ID`` (the client's, or a new one), ``X-Total-Time``, and on model routes
``X-Queue-Time`` / ``X-Inference-Time`` (milliseconds).

Each request's texts are checked and tokenized (once: the token counts of ``usage`` are those ids) before they join
a batch shared with other requests (:class:`~robustir.serving.batcher.MicroBatcher`); the model and LanceDB run on
worker threads, the event loop parses, validates and answers.
"""

# no "from __future__ import annotations": FastAPI reads the routes' body types (made per app) at run time

import asyncio
import base64
import contextlib
import copy
import functools
import hmac
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..data.beir import encoding_text
from ..errors import ConfigError, DataError
from ..index.fusion import FusionConfig
from .batcher import EncodeFailed, MicroBatcher, Overloaded
from .config import ServeConfig
from .middleware import BODY_TOO_LARGE, RequestContext, error_body
from . import responses as answers
from .schemas import Limits, request_models

logger = logging.getLogger(__name__)

__all__ = ["ServeConfig", "create_app", "ApiError", "Server"]

#: characters of one request tokenized on the event loop (MiniLM's fast tokenizer: 2.9-4.1 ms median for 16,384
#: characters on the 2-core dev box); longer requests go to the tokenizer thread
INLINE_TOKENIZE_CHARS = 16384


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


# ------------------------------------------------------------------------------------------------ the server state

@dataclass
class Server:
    """What the routes need: the model, the index, the batcher, the limits (``app.state.server``)."""

    config: ServeConfig
    encoder: Any
    index: Any
    name: str
    aliases: set[str]
    dim: int
    allowed_dims: list[int]
    api_key: str | None  # reads and writes
    batcher: MicroBatcher
    metrics: Any
    device: str
    precision: str
    workers: int
    encode_batch: int
    created: int = field(default_factory=lambda: int(time.time()))
    _loop_tokenizer: Any = None
    _pool: Any = None  # one thread, its own tokenizer: long requests are tokenized off the event loop
    _pool_tokenizer: Any = None
    reranker: Any = None  # a cross-encoder (robustir.models.cross_encoder.CrossEncoder) for /v1/rerank, or None
    reranker_name: str | None = None
    read_key: str | None = None  # reads only (--read-api-key): POST/DELETE /documents answer it 403
    write_lock: Any = field(default_factory=asyncio.Lock)  # HTTP writes of this server, one at a time
    _search_pool: Any = None  # index work that needs no model: its own threads (Server.searching)
    _write_pool: Any = None  # one thread: an HTTP upsert's job (its encoding goes through the batcher: Server.upsert)
    _write_tokenizer: Any = None  # that thread's own tokenizer

    async def rerank_scores(self, query: str, documents: list[str], request: Request | None = None) -> np.ndarray:
        """Relevance of each document to ``query``: the cross-encoder's score (``--rerank-model``), else the served
        embedding model's cosine (query and documents embedded as /v1/embeddings does). Either way the work goes
        through the batcher's queue (:meth:`model_work`): its limits, 429/503 and a client's disconnect hold for it,
        and it takes turns with the embeddings micro-batch by micro-batch."""
        if not documents:
            return np.zeros(0, dtype=np.float32)
        started = time.perf_counter()
        if self.reranker is not None:
            pairs = [(query, document) for document in documents]
            scores = (await self.model_work(RERANK, pairs, request)).vectors.astype(np.float32)
        else:
            ids = await self.tokenize([query], "query", "query") + await self.tokenize(documents, "passage",
                                                                                      "documents")
            vectors = (await self.embed(ids, request)).vectors.astype(np.float32)
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            scores = vectors[1:] @ vectors[0]
        self.metrics.reranked(len(documents), time.perf_counter() - started)
        return scores

    def check_model(self, value: str | None, *also: str | None) -> None:
        """404 unless ``value`` names the served model (or one of ``also``: the reranker's names, where it may)."""
        if value is not None and value not in self.aliases and value not in also:
            other = f" and the reranker '{also[0]}'" if also and also[0] else ""
            raise ApiError(404, f"the model '{value}' does not exist on this server; it serves '{self.name}'{other} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def describe(self) -> str:
        """The model workers as they run: "1 model worker x 2 torch threads, fp32 on cpu"."""
        threads = torch.get_num_threads() if self.device.startswith("cpu") else None
        return (f"{self.workers} model worker{'s' if self.workers != 1 else ''}"
                + (f" x {threads} torch thread{'s' if threads != 1 else ''}" if threads else "")
                + f", {self.precision} on {self.device}")

    def model_names(self) -> list[str]:
        """What GET /v1/models lists: the embedding model, then the reranker (``--rerank-model``) if there is one."""
        return [self.name] + ([self.reranker_name] if self.reranker_name not in (None, self.name) else [])

    async def tokenize(self, texts: list[str], kind: str, param: str) -> list[list[int]]:
        """This request's token ids (``kind``: ``query`` or ``passage``); a tokenizer failure is this request's 400."""
        try:
            if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
                return self.encoder.token_ids(texts, kind, tokenizer=self._loop_tokenizer)
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
                self.encoder.token_ids, texts, kind, tokenizer=self._pool_tokenizer))
        except Exception as exc:
            raise ApiError(400, f"'{param}' could not be tokenized ({type(exc).__name__}: {exc})", param=param) from None

    async def embed(self, ids: list[list[int]], request: Request | None = None) -> Any:
        """The vectors of ``ids`` from the batcher (micro-batches of ``--max-batch-size``, interleaved with other
        requests). With ``request``, a client that disconnects cancels what has not started."""
        return await self.model_work(MicroBatcher.EMBED, ids, request)

    async def model_work(self, kind: str, rows: list, request: Request | None = None) -> Any:
        """Model ``kind``'s results for ``rows`` from the batcher -- every model's work comes here, so each gets the
        same answers: 429 when the queue is full, 503 when a micro-batch waited too long, 500 when the model fails on
        this request, 499 (and its queued work dropped) when the client disconnects."""
        noun = "pair" if kind == RERANK else "text"
        try:
            work = self.batcher.submit(kind, rows, timeout=self.config.request_timeout_s)
            return await (work if request is None else _unless_client_leaves(request, work, self.metrics))
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        except asyncio.TimeoutError:
            self.metrics.reject("timeout")
            retry = self.batcher.retry_after(self.batcher.queued)
            raise ApiError(503, f"part of this request waited {self.config.request_timeout_s:g} s in the queue "
                           "without reaching a model worker (time spent encoding does not count), so it was "
                           f"dropped: the server is overloaded; retry in {retry} s, send smaller requests, or raise "
                           "--request-timeout-s", kind="server_error", code="timeout",
                           headers={"Retry-After": str(retry)}) from None
        except EncodeFailed as exc:
            what = "the reranker" if kind == RERANK else "the model"
            raise ApiError(500, str(exc).replace("the model", what, 1), kind="server_error",
                           code="internal_error") from None
        except ClientGone:  # nobody reads this answer; 499 is what proxies log for it
            raise ApiError(499, f"the client disconnected before the answer was ready; its queued {noun}s were "
                           "dropped", code="client_closed_request") from None

    def _overloaded(self, exc: Overloaded) -> ApiError:
        self.metrics.reject("overloaded")
        return ApiError(429, f"{exc} (or raise --max-queued-texts)", kind="rate_limit_error", code="overloaded",
                        headers={"Retry-After": str(exc.retry_after)})

    async def upsert(self, documents: list[dict]) -> Any:
        """Upsert ``documents`` into the index (:func:`robustir.index.store.spool.upsert_documents`: one ``--upsert``
        job, answered once committed). The job runs on the write thread; its documents are encoded through the
        batcher as background micro-batches (:class:`BatcherPool`), so searches and embeddings go first and an
        upsert never holds a model worker for longer than one micro-batch (issue 55: a 100-document upsert used to
        hold it for the whole job, and searches waited 25 s). Let in by the queue's limit like any request (429)."""
        from ..index.store.spool import upsert_documents

        try:
            self.batcher.admit(INGEST, len(documents))
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        pool = BatcherPool(self.encoder, self._write_tokenizer, self.batcher, asyncio.get_running_loop())
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._write_pool, upsert_documents, self.index.store, self.encoder, documents, pool)
        except EncodeFailed as exc:
            raise ApiError(500, f"{str(exc).replace('request', 'upsert', 1)}; nothing of it was acknowledged (the "
                           "server's next write finishes it)", kind="server_error", code="internal_error") from None

    async def searching(self, fn: Any, *args: Any) -> Any:
        """Run index work that needs no model (vector, full-text and filtered search, reads, deletes) on the search
        threads, not the model's: a lexical search or a lookup never waits behind embedding work."""
        return await asyncio.get_running_loop().run_in_executor(self._search_pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._search_pool is not None:
            self._search_pool.shutdown(wait=False)
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=False)


#: the batcher's name for the cross-encoder's work (``--rerank-model``)
RERANK = "rerank"
#: the batcher's name for an HTTP upsert's documents: background work, searches and embeddings go first
INGEST = "ingest"


class BatcherPool:
    """The encoder pool (:class:`robustir.index.store.config.EncoderPool`) of an HTTP upsert's job: each chunk's texts
    are tokenized on the write thread (its own tokenizer) and encoded through the batcher as :data:`INGEST`
    micro-batches (``--ingest-batch-size`` documents), so they take turns with searches and embeddings instead of
    holding a model worker for the whole job. Called from the write thread, never from the event loop."""

    def __init__(self, encoder: Any, tokenizer: Any, batcher: MicroBatcher, loop: asyncio.AbstractEventLoop) -> None:
        self.encoder, self.tokenizer, self.batcher, self.loop = encoder, tokenizer, batcher, loop

    def encode(self, texts: list[str], kind: str, *, batch_size: int, precision: str) -> np.ndarray:
        ids = self.encoder.token_ids(texts, kind, tokenizer=self.tokenizer)
        work = self.batcher.submit(INGEST, [(row, precision) for row in ids], admitted=True)  # let in by the route
        return asyncio.run_coroutine_threadsafe(work, self.loop).result().vectors

    def close(self) -> None:
        """Nothing to close: the batcher is the server's."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its queued micro-batches were dropped)."""


async def _unless_client_leaves(request: Request, work: Any, metrics: Any = None) -> Any:
    """Await ``work`` (the model's part of a request) unless the client disconnects first: then ``work`` is cancelled
    -- its micro-batches that have not started are dropped, so a client that gives up frees the model within the
    micro-batch already running -- and :class:`ClientGone` is raised. The disconnect is the ASGI server's
    ``http.disconnect`` message (the body has been read by then), no polling."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or failed meanwhile: nobody is waiting for it
        pass
    if metrics is not None:
        metrics.reject("disconnected")
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def _server(request: Request) -> Server:
    return request.app.state.server


_bearer = HTTPBearer(auto_error=False, description="The server's API key, when it was started with one")


def authorize(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """The API-key check of every reading route (all but ``/health``, ``/metrics`` and the writes): the read-write
    key (``--api-key``) or the read-only one (``--read-api-key``); constant-time comparisons."""
    _check_key(_server(request), credentials, write=False)


def authorize_write(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """The API-key check of POST and DELETE ``/documents``: the read-write key only; the read-only key gets 403
    naming the scope it lacks."""
    _check_key(_server(request), credentials, write=True)


def _check_key(s: "Server", credentials: HTTPAuthorizationCredentials | None, write: bool) -> None:
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


def _answer(payload: Any, headers: dict | None = None) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False, separators=(",", ":")), media_type="application/json",
                    headers=headers)


def _timing(result: Any) -> dict:
    return {"X-Queue-Time": f"{result.queue_s * 1000:.2f}", "X-Inference-Time": f"{result.inference_s * 1000:.2f}"}


# ------------------------------------------------------------------------------------------------ the routes

def _router(embedding_request: type, search_request: type, rerank_request: type, documents_request: type,
            delete_request: type, max_body_bytes: int) -> APIRouter:
    """The routes, with the request models of :func:`request_models` as their bodies."""
    router = APIRouter(max_body_size=max_body_bytes)
    keyed = [Depends(authorize)]
    write_keyed = [Depends(authorize_write)]

    @router.get("/health", tags=["operations"], response_model=answers.HealthAnswer)
    async def health(request: Request):
        s = _server(request)
        try:
            index = None if s.index is None else {"documents": s.index.count, "kind": s.index.kind}
        except DataError as exc:  # e.g. rebuilt with another model: a restart is the fix, so health says so
            raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
        return _answer({"status": "ok", "model": s.name, "dimension": s.dim, "device": s.device,
                        "precision": s.precision, "workers": s.workers, "torch_threads": torch.get_num_threads(),
                        "queued_texts": s.batcher.queued, "index": index,
                        "batching": {"max_batch_size": s.config.max_batch_size, "max_wait_ms": s.config.max_wait_ms,
                                     "encode_batch_size": s.encode_batch, **s.batcher.stats.to_dict()}})

    @router.get("/info", dependencies=keyed, tags=["operations"], response_model=answers.InfoAnswer)
    async def info(request: Request):
        from .. import __version__

        s = _server(request)
        c, ec = s.config, s.encoder.config
        try:
            index = None if s.index is None else {"documents": s.index.count, "kind": s.index.kind,
                                                  "fields": sorted(s.index.manifest.get("fields") or [])}
        except DataError as exc:
            raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
        return _answer({
            "version": __version__, "model": s.name, "dimension": s.dim, "dimensions": s.allowed_dims,
            "pooling": ec.pooling, "normalized": ec.normalize,
            "max_tokens": {"query": ec.query_max_length, "document": ec.passage_max_length},
            "instructions": {"query": ec.query_instruction, "document": ec.passage_instruction},
            "default_input_type": c.default_input_type, "device": s.device, "precision": s.precision,
            "index": index,
            "limits": {"max_inputs_per_request": c.max_inputs_per_request, "max_chars_per_input":
                       c.max_chars_per_input, "max_body_bytes": c.max_body_bytes, "max_top_k": c.max_top_k,
                       "max_hits_per_request": c.max_hits_per_request, "max_response_bytes": c.max_response_bytes,
                       "max_queued_texts": c.max_queued_texts, "request_timeout_s": c.request_timeout_s}})

    @router.get("/v1/models", dependencies=keyed, tags=["openai"], response_model=answers.ModelList)
    async def models(request: Request):
        s = _server(request)
        return _answer({"object": "list", "data": [{"id": name, "object": "model", "created": s.created,
                                                    "owned_by": "robustir"} for name in s.model_names()]})

    @router.get("/v1/models/{model_id:path}", dependencies=keyed, tags=["openai"], response_model=answers.ModelCard)
    async def one_model(model_id: str, request: Request):
        s = _server(request)
        s.check_model(model_id, s.reranker_name)
        return _answer({"id": model_id if model_id == s.reranker_name else s.name, "object": "model",
                        "created": s.created, "owned_by": "robustir"})

    @router.post("/v1/embeddings", dependencies=keyed, tags=["openai"], response_model=answers.EmbeddingList)
    async def embeddings(body: embedding_request, request: Request):  # type: ignore[valid-type]
        s = _server(request)
        s.check_model(body.model)
        dims = body.dimensions
        if dims is not None and dims not in s.allowed_dims:
            hint = (f"this model supports {', '.join(map(str, s.allowed_dims))}" if len(s.allowed_dims) > 1 else
                    f"this model was not trained to be cut (Matryoshka): it gives {s.dim} dimensions only (a server "
                    "for a Matryoshka model declares its sizes with --matryoshka-dims)")
            raise ApiError(400, f"'dimensions' = {dims} is not supported: {hint}", param="dimensions")
        kind = body.input_type or s.config.default_input_type
        ids = await s.tokenize(body.input, "query" if kind == "query" else "passage", "input")
        result = await s.embed(ids, request)
        vectors = result.vectors
        if dims is not None and dims != s.dim:
            vectors = vectors[:, :dims]
            if s.encoder.config.normalize:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        packed = body.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(row.tobytes()).decode("ascii") if packed else row.tolist()}
                for i, row in enumerate(vectors)]
        tokens = sum(map(len, ids))
        s.metrics.embedded(kind, len(ids), tokens)
        return _answer({"object": "list", "data": data, "model": s.name,
                        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, _timing(result))

    @router.post("/search", dependencies=keyed, tags=["search"], response_model=answers.SearchAnswer)
    async def search(body: search_request, request: Request):  # type: ignore[valid-type]
        s, started = _server(request), time.perf_counter()
        if s.index is None:
            raise ApiError(404, "this server has no index: start it with --index IDX (built by robustir index)",
                           code="no_index")
        s.check_model(body.model)
        queries, c = body.query or [""] * len(body.vector), s.config
        if body.vector is not None:
            _check_query_vectors(body, s.dim)
        if body.fusion is not None and body.mode != "hybrid":
            raise ApiError(400, f"'fusion' goes with mode 'hybrid', not {body.mode!r}", param="fusion")
        if body.fusion is not None and body.fusion.candidates > c.max_top_k:
            raise ApiError(400, f"fusion.candidates must be at most {c.max_top_k}, got {body.fusion.candidates}",
                           param="fusion.candidates")
        depth, what = body.top_k, f"top_k {body.top_k}"
        if body.rerank and c.rerank_candidates > depth:  # each query's best rerank_candidates are re-scored
            depth, what = c.rerank_candidates, f"--rerank-candidates {c.rerank_candidates} (rerank re-scores that many)"
        if body.mode == "hybrid":  # each list is read fusion.candidates deep (at least top_k) before fusing
            candidates = (body.fusion or FusionConfig()).candidates
            if candidates > depth:
                depth, what = candidates, f"fusion.candidates {candidates} (hybrid reads each list that deep)"
        if len(queries) * depth > c.max_hits_per_request:
            raise ApiError(413, f"{len(queries)} queries x {what} = {len(queries) * depth} hits; at most "
                           f"{c.max_hits_per_request} per request (send fewer queries per request or a smaller "
                           "top_k)", param="top_k", code="too_many_hits")
        try:  # compiled once, after one look at the manifest; a bad filter is refused before the model runs
            where = s.index.compile_filter(body.filter) if body.filter else None
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="filter") from None
        except DataError as exc:  # the index on disk cannot be served (rebuilt with another model, damaged)
            raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
        headers = None
        vectors = None
        if body.vector is not None:
            vectors = np.asarray(body.vector, dtype=np.float32)
        elif body.mode != "lexical":
            ids = await s.tokenize(queries, "query", "query")
            result = await s.embed(ids, request)
            vectors, headers = result.vectors, _timing(result)
            s.metrics.embedded("query", len(ids), sum(map(len, ids)))
        fetched = max(body.top_k, c.rerank_candidates) if body.rerank else body.top_k
        try:
            hits = await s.searching(functools.partial(s.index.search_encoded, queries, vectors, fetched,
                                                         body.filter or None, mode=body.mode, fusion=body.fusion,
                                                         where=where))
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="filter") from None
        except DataError as exc:  # the index on disk cannot be served (rebuilt with another model, damaged)
            raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
        found = [[hit.to_dict() for hit in row] for row in hits]
        if body.rerank:  # second stage: the reranker's order of each query's candidates, its score beside the first
            for query, row in zip(queries, found):
                scores = await s.rerank_scores(query, [encoding_text(h["title"], h["text"]) for h in row], request)
                for hit, score in zip(row, scores):
                    hit["rerank_score"] = float(score)
                row.sort(key=lambda h: -h["rerank_score"])  # stable: ties keep the first stage's order
                del row[body.top_k:]
        rows, size = [], 0
        for row in found:  # serialised query by query: an answer over the limit is refused before it is all built
            text = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
            size += len(text)
            if size > c.max_response_bytes:
                raise ApiError(413, f"the answer would be over {c.max_response_bytes} bytes (--max-response-bytes): "
                               "send fewer queries per request or a smaller top_k", param="top_k",
                               code="response_too_large")
            rows.append(text)
        payload = rows[0] if body.single else "[" + ",".join(rows) + "]"
        s.metrics.searched(body.mode, "text" if body.vector is None else "vector", len(queries),
                           time.perf_counter() - started)
        return Response('{"hits":' + payload + "}", media_type="application/json", headers=headers)

    @router.post("/v1/rerank", dependencies=keyed, tags=["rerank"], response_model=answers.RerankAnswer)
    async def rerank(body: rerank_request, request: Request):  # type: ignore[valid-type]
        """Order ``documents`` by relevance to ``query`` (Infinity's and Cohere's shape): the cross-encoder of
        --rerank-model, else the served embedding model's cosine."""
        s = _server(request)
        s.check_model(body.model, s.reranker_name, s.config.rerank_model)  # the reranker's name, or the embedder's
        scores = await s.rerank_scores(body.query, list(body.documents), request)
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:body.top_n]
        results = [{"relevance_score": float(scores[i]), "index": i,
                    **({"document": body.documents[i]} if body.return_documents else {})} for i in order]
        return _answer({"object": "rerank", "results": results, "model": s.reranker_name or s.name})

    @router.post("/documents", dependencies=write_keyed, tags=["documents"], response_model=answers.Upserted)
    async def add_documents(body: documents_request, request: Request):  # type: ignore[valid-type]
        """Insert documents, replacing those whose id exists (``robustir index --upsert``), answered once committed;
        ``/search`` finds them on its next query."""
        from ..index.store.spool import DocumentError, StorageFailure
        from ..index.store.jobs import UnfinishedJob

        s, started = _writable_index(request), time.perf_counter()
        c = s.config
        for i, document in enumerate(body.documents):
            _check_document(document, i, c.max_chars_per_input)
        _check_field_count(body.documents)
        async with s.write_lock:
            try:
                report = await s.upsert(body.documents)
            except DocumentError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            except UnfinishedJob as exc:  # a killed CLI job's record: never erased, named with its fix
                raise ApiError(409, str(exc), code="unfinished_job") from None
            except ConfigError as exc:  # another process holds the index's writer lock
                raise ApiError(409, str(exc), code="index_busy") from None
            except StorageFailure as exc:  # a full disk: the cause, and the next write finishes what this began
                raise ApiError(exc.status, f"{exc} (an upsert stopped half-way is finished by the server's next "
                               "write; sending the same request again is safe)",
                               kind="server_error", code="insufficient_storage" if exc.status == 507
                               else "storage_error") from None
        s.metrics.ingested("upsert", report.added, time.perf_counter() - started)
        return _answer({"object": "documents", "upserted": report.added, "documents": report.documents})

    @router.delete("/documents", dependencies=write_keyed, tags=["documents"], response_model=answers.Deleted)
    async def delete_documents_route(body: delete_request, request: Request):  # type: ignore[valid-type]
        """Delete documents by ``ids`` or by ``filter`` (``robustir index --delete``: one commit, all or nothing)."""
        from ..index.store.spool import StorageFailure, delete_documents
        from ..index.store.jobs import UnfinishedJob

        s, started = _writable_index(request), time.perf_counter()
        if body.filter:
            try:
                s.index.check_filter(body.filter)
            except ConfigError as exc:
                raise ApiError(400, str(exc), param="filter") from None
        async with s.write_lock:
            try:
                report = await s.searching(delete_documents, s.index.store, body.ids, body.filter,
                                             s.config.max_inputs_per_request, s.encoder)
            except DataError as exc:  # an id not in the index: nothing deleted
                raise ApiError(404, exc.problem + (f" ({exc.fix})" if exc.fix else ""), param="ids",
                               code="document_not_found") from None
            except UnfinishedJob as exc:  # a killed CLI job's record: never erased, named with its fix
                raise ApiError(409, str(exc), code="unfinished_job") from None
            except StorageFailure as exc:
                raise ApiError(exc.status, str(exc), kind="server_error",
                               code="insufficient_storage" if exc.status == 507 else "storage_error") from None
            except ConfigError as exc:
                busy = "being changed by another process" in str(exc)
                raise ApiError(409 if busy else 400, str(exc), param=None if busy else "filter",
                               code="index_busy" if busy else None) from None
        s.metrics.ingested("delete", report.deleted, time.perf_counter() - started)
        return _answer({"object": "documents", "deleted": report.deleted, "documents": report.documents})

    @router.get("/documents/{document_id:path}", dependencies=keyed, tags=["documents"], response_model=answers.DocumentAnswer)
    async def get_document(document_id: str, request: Request):
        """The document with this id (an id may hold ``/``: ``GET /documents/a/b`` is the document ``a/b``)."""
        s = _server(request)
        if s.index is None:
            raise ApiError(404, "this server has no index: start it with --index IDX", code="no_index")
        if "\x00" in document_id or _surrogate(document_id):
            raise ApiError(400, f"document id {document_id[:40]!r} holds a NUL character or is not valid Unicode; no "
                           "document id can (the index refuses such ids when they are written)",
                           param="document_id", code="invalid_document_id")
        found = await s.searching(s.index.get, [document_id])
        if not found:
            raise ApiError(404, f"no document with id {document_id!r} in the index", param="document_id",
                           code="document_not_found")
        hit = found[0].to_dict()
        hit.pop("score", None)
        return _answer(hit)

    return router


def _check_query_vectors(body: Any, dim: int) -> None:
    """A search by vector: dense mode, no rerank (both need the query's text), each vector the index's dimension."""
    if body.mode != "dense" or body.rerank:
        what = "rerank" if body.rerank else f"mode {body.mode!r}"
        raise ApiError(400, f"a search by 'vector' is dense only: {what} needs the query's text (send 'query' "
                       "instead)", param="rerank" if body.rerank else "mode")
    for i, row in enumerate(body.vector):
        if len(row) != dim:
            where = "vector" if body.single else f"vector[{i}]"
            raise ApiError(400, f"'{where}' has {len(row)} numbers; this index's vectors have {dim} (GET /info: "
                           "'dimension')", param=where)


def _writable_index(request: Request) -> "Server":
    s = _server(request)
    if s.index is None:
        raise ApiError(404, "this server has no index: start it with --index IDX (built by robustir index)",
                       code="no_index")
    return s


def _check_document(document: dict, i: int, max_chars: int) -> None:
    """What the index's reader would refuse about a request's document, named as ``documents[i]`` (the reader checks
    the rest -- finite numbers, NUL in ids -- and is answered the same way)."""
    where = f"documents[{i}]"
    ids = [key for key in ("_id", "id") if key in document]
    if not ids or not isinstance(document[ids[0]], str) or not document[ids[0]].strip():
        raise ApiError(400, f"'{where}' needs an id: \"_id\" (or \"id\") as a non-empty string", param=where)
    for key in ("title", "text"):
        value = document.get(key, "")
        if not isinstance(value, str):
            raise ApiError(400, f"'{where}.{key}' must be a string, got {_type(value)}", param=f"{where}.{key}")
        if len(value) > max_chars:
            raise ApiError(400, f"'{where}.{key}' has {len(value)} characters; at most {max_chars} per text (split it "
                           "into passages)", param=f"{where}.{key}", code="input_too_long")
    if not str(document.get("text", "")).strip() and not str(document.get("title", "")).strip():
        raise ApiError(400, f"'{where}' has neither text nor title", param=where)
    bad = _surrogate(document, where)
    if bad:  # JSON's \ud8xx escapes decode to a lone surrogate, which no UTF-8 file (the upsert's spool) can hold
        raise ApiError(400, f"'{bad}' is not valid Unicode (a lone surrogate: in JSON a \\ud8xx escape must be "
                       "followed by its \\udcxx pair; send text encoded as UTF-8)", param=bad, code="invalid_unicode")


def _surrogate(value: Any, where: str = "") -> str | None:
    """Where in ``value`` (a JSON value: keys and strings at any depth) a lone surrogate is, else None."""
    if isinstance(value, str):
        return where or "value" if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _surrogate(key):
                return f"{where} (a field name)"
            found = _surrogate(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate(item, f"{where}[{i}]")
            if found:
                return found
    return None


def _check_field_count(documents: list[dict]) -> None:
    """A request may bring at most :data:`~robustir.index.store.known_fields.MAX_FIELDS` distinct top-level field names
    (an index remembers each, and every filtered search reads them): more is a 413, before anything is written."""
    from ..index.store.known_fields import MAX_FIELDS

    names: set[str] = set()
    for i, document in enumerate(documents):
        names.update(key for key in document if key not in ("_id", "id", "title", "text"))
        if len(names) > MAX_FIELDS:
            raise ApiError(413, f"'documents' hold more than {MAX_FIELDS} distinct field names (reached at "
                           f"documents[{i}]); an index keeps at most {MAX_FIELDS}: put open-ended data under one "
                           "nested field (e.g. \"meta\": {...}) or send fewer kinds of fields", param="documents",
                           code="too_many_fields")


# ------------------------------------------------------------------------------------------------ errors

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
        route = request.scope.get("route")
        body_field = getattr(getattr(route, "body_field", None), "field_info", None)
        model = getattr(body_field, "annotation", None)
        fields = tuple(getattr(model, "model_fields", {}) or ())
        exc = _validation_error(exc, fields)
        _server(request).metrics.reject("invalid")
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
            exc = ApiError(413, BODY_TOO_LARGE.format(limit=_server(request).config.max_body_bytes),
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


# ------------------------------------------------------------------------------------------------ the app

def create_app(model: Any = None, index: Any = None, config: ServeConfig | None = None, *,
               encoder_options: dict | None = None, storage_options: dict | None = None) -> FastAPI:
    """The FastAPI app serving ``model`` (a folder, hub id or :class:`~robustir.models.encoder.Encoder`; default: the
    index's model, else the bundled MiniLM) and, optionally, ``index`` (a folder or an open
    :class:`~robustir.index.store.SearchIndex`, checked to be built with ``model``).

    The model loads here, so a bad model, index or setting fails before any port is opened.
    """
    import concurrent.futures

    from .. import __version__
    from ..device import resolve_device
    from ..models.encoder import Encoder
    from ..precision import resolve_precision
    from ..index.store import SearchIndex
    from ..index.store.records import _model_label
    from .metrics import ServerMetrics

    config = (config or ServeConfig()).validate()
    api_key, read_key = config.resolved_api_key(), config.resolved_read_api_key()
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    workers, encode_batch = _workers(config, device, precision)
    options = {k: v for k, v in (encoder_options or {}).items() if v is not None}

    search_index: SearchIndex | None = None
    if index is not None:
        if options:
            raise ConfigError(f"encoder options ({', '.join(sorted(options))}) come from the index's manifest when an "
                              "index is served: leave them out")
        if not isinstance(index, SearchIndex):  # an HTTP upsert a killed server left: finished before serving
            from ..index.store.spool import finish_incoming
            from ..index.store.storage import open_store

            index = open_store(index, storage_options)  # a folder, or s3://... (robustir.index.store.storage)
            finish_incoming(index, model if isinstance(model, Encoder) else None, str(device))
        search_index = index if isinstance(index, SearchIndex) else SearchIndex.open(index,
                                                                                      refresh_s=config.index_refresh_s)
        try:
            if isinstance(model, Encoder):
                search_index.use_model(model.to(device))
                given = model.source or search_index.model_path
            else:
                given = str(model) if model is not None else search_index.model_path
                search_index.use_model(given, device=str(device))  # refused unless it is the index's model
        except BaseException:
            if search_index is not index:
                search_index.close()
            raise
        encoder = search_index.encoder
        precision = _query_precision(search_index, config, device, precision)
        workers, encode_batch = _workers(config, device, precision)
    elif isinstance(model, Encoder):
        encoder = model.to(device)
        given = model.source or "model"
    else:
        from ..resources import default_model_path

        given = str(model) if model is not None else default_model_path()
        encoder = Encoder.from_pretrained(given, device=device, **options)
        encoder.source = given
    encoder.eval()
    name = config.served_model_name or (search_index.model_name if search_index is not None else _model_label(given))
    aliases = {name, given, str(Path(given).expanduser().resolve()) if Path(given).expanduser().exists() else given}
    dim = encoder.dim
    # builds the bf16/fp16 copy once, before the workers start
    encoder.encode(["warm-up"], "query", precision=precision, show_progress=False)
    local = threading.local()

    def worker_encoder() -> Encoder:
        """This worker thread's view of the model: the same weights, its own tokenizer (a fast tokenizer must not be
        called from two threads at once)."""
        mine = getattr(local, "encoder", None)
        if mine is None:
            mine = encoder if workers == 1 else copy.copy(encoder)
            if workers > 1:
                mine.tokenizer = copy.deepcopy(encoder.tokenizer)
            local.encoder = mine
        return mine

    def encode(ids: list[list[int]], at: str = precision) -> np.ndarray:
        return worker_encoder().encode_ids(ids, batch_size=encode_batch, precision=at,
                                           pad_to_multiple_of=config.pad_to_multiple_of if config.pad_to_multiple_of > 1 else None)

    metrics = ServerMetrics(lambda: batcher.queued, workers)  # read at scrape time, when the batcher exists
    batcher = MicroBatcher(encode, max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms,
                           workers=workers, max_queued=config.max_queued_texts, on_batch=metrics.on_batch)
    reranker, reranker_name = None, None
    if config.rerank_model:  # loaded here: a bad folder fails before any port opens
        from ..models.cross_encoder import CrossEncoder

        reranker = CrossEncoder(config.rerank_model, batch_size=encode_batch, precision=precision, device=str(device),
                                what="--rerank-model")
        reranker_name = reranker.name
        scoring = threading.Lock()  # its fast tokenizer must not be called from two worker threads at once

        def rerank(pairs: list[tuple[str, str]]) -> np.ndarray:
            with scoring:
                return reranker.score([query for query, _ in pairs], [document for _, document in pairs])

        # one forward pass per micro-batch: an embedding waits behind at most one of them per worker
        batcher.add_model(RERANK, rerank, batch_size=encode_batch, unit="pair")

    def encode_documents(rows: list[tuple[list[int], str]]) -> np.ndarray:
        """An HTTP upsert's micro-batch: (token ids, the index's precision) rows of one job (writes are one at a
        time, so one precision)."""
        return encode([ids for ids, _ in rows], rows[0][1])

    # small on a CPU: a search that arrives waits for at most one of them (bench/upsert_search.py, fp32, one worker:
    # 16 documents a micro-batch kept a search's p99 at 11.5x its idle p99, 4 at 0.94x, the upsert no slower)
    ingest_batch = config.ingest_batch_size or (encode_batch if device.type == "cuda" else min(4, encode_batch))
    batcher.add_model(INGEST, encode_documents, batch_size=ingest_batch, unit="document", background=True)
    server = Server(config=config, encoder=encoder, index=search_index, name=name, aliases=aliases, dim=dim,
                    allowed_dims=sorted({dim, *[d for d in config.matryoshka_dims or [] if d <= dim]}),
                    api_key=api_key, batcher=batcher, metrics=metrics, device=str(device), precision=precision,
                    workers=workers, encode_batch=encode_batch,
                    _loop_tokenizer=copy.deepcopy(encoder.tokenizer), _pool_tokenizer=copy.deepcopy(encoder.tokenizer),
                    _pool=concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="robustir-tokenize"),
                    _search_pool=concurrent.futures.ThreadPoolExecutor(_search_threads(),
                                                                       thread_name_prefix="robustir-search"),
                    _write_pool=concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="robustir-write"),
                    _write_tokenizer=copy.deepcopy(encoder.tokenizer),
                    reranker=reranker, reranker_name=reranker_name, read_key=read_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            server.close()

    handlers = {cls: _error_response for cls in (ApiError, RequestValidationError, StarletteHTTPException, Exception)}
    app = FastAPI(title="robustir serve", version=__version__, lifespan=lifespan, exception_handlers=handlers,
                  description="OpenAI-compatible embeddings and search with a robustir retriever")
    models = request_models(Limits.of(config))
    app.include_router(_router(*models, config.max_body_bytes))
    app.state.server = server
    metrics.instrument(app)
    # once, with what is served (the first _workers call above may have been for another precision than the index's)
    logger.info("robustir serve: %s", server.describe())
    if search_index is not None:
        metrics.watch_index(lambda: search_index.untyped_fields)
    if config.cors_allow_origin:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origin,
                           allow_methods=["GET", "POST", "DELETE"],  # every method the API has
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID", "X-Total-Time", "X-Queue-Time", "X-Inference-Time"])
    app.add_middleware(RequestContext, max_body_bytes=config.max_body_bytes)
    return app


def _search_threads() -> int:
    """Threads for index work: one per CPU this process may use (LanceDB's own readers are native threads; these only
    wait on them), at least 2 so a long filtered search does not hold up a lookup."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cpus)


def _query_precision(index: Any, config: ServeConfig, device: Any, precision: str) -> str:
    """The precision queries are encoded in when an index is served: the one its documents were encoded in (recorded
    in its manifest), so ``/search`` finds the exact top-k -- unless ``--precision`` says otherwise (then a warning
    says what that costs) or the device lacks native support for it (bf16 emulated on a CPU is ~10x slower; fp32
    then, with a warning)."""
    from ..precision import resolve_precision

    recorded = index.manifest.get("precision")
    if not recorded or recorded == precision:
        if not recorded:
            logger.info("index %s does not record the precision of its documents (built by an older robustir): "
                        "queries are encoded in %s", index.path, precision)
        return precision
    if str(config.precision).lower() != "auto":
        logger.warning("index %s was encoded in %s; queries are encoded in %s (--precision %s): the top-k may "
                       "differ slightly from an exact search; leave --precision out to use %s", index.path, recorded,
                       precision, config.precision, recorded)
        return precision
    native = resolve_precision("auto", device)
    if recorded != "fp32" and recorded != native:
        logger.warning("index %s was encoded in %s, which %s does not compute natively: queries are encoded in %s, "
                       "so the top-k may differ slightly from an exact search", index.path, recorded, device, precision)
        return precision
    logger.info("index %s was encoded in %s: queries are encoded in %s too", index.path, recorded, recorded)
    return recorded


def _workers(config: ServeConfig, device, precision: str = "fp32") -> tuple[int, int]:
    """``(workers, texts per forward pass)``. A GPU: one worker, whole batches. The CPU: ``cpus`` =
    :func:`robustir.hardware.available_cpus` (affinity and cgroup quota, not the host's cores); in fp32 one worker
    with ``cpus`` torch threads, in bf16/fp16 one worker per CPU with one thread each (``--workers`` overrides; the
    threads are then ``cpus // workers``, set here for the whole process), and forward passes of 16 length-sorted
    texts.

    Measured on 2 quiet cores with MiniLM (docs/benchmarks.md, "Serving: workers x threads", 3 repeats): in fp32 one
    2-thread worker gave 1.14-1.18x the throughput of two 1-thread workers at 8 clients with 0.64-0.76x the p99, and
    0.92-0.94x the throughput at 32 clients with 0.73-0.89x the p99; in bf16 two 1-thread workers gave 1.19-1.27x
    the throughput at 32 clients and tied at 8 (a bf16 forward pass is ~2.5x cheaper, so intra-op threads mostly wait
    on each other); at 1 client all settings tied."""
    if device.type == "cuda":
        return config.workers or 1, config.encode_batch_size or config.max_batch_size
    from ..hardware import available_cpus

    cores = available_cpus()
    workers = config.workers or (1 if precision == "fp32" else cores)
    threads = max(1, cores // workers)
    if torch.get_num_threads() != threads:  # said once by create_app, with the precision queries are served in
        torch.set_num_threads(threads)
    return workers, min(config.encode_batch_size or 16, config.max_batch_size)
