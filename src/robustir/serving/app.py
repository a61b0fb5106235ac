"""The FastAPI app of ``robustir serve``: OpenAI-compatible embeddings and search over a :class:`SearchIndex`.

Routes (:data:`robustir.serving.routes.router`, one module-level :class:`fastapi.APIRouter` whose routes read the
app's :class:`Server` from ``app.state``; request bodies are validated with the app's copies of the pydantic models
of :mod:`robustir.serving.schemas`, so ``/docs`` shows them with that app's limits):

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

This module wires the app (:func:`create_app`); the routes are :mod:`robustir.serving.routes` (a few lines each),
what each does :mod:`robustir.serving.handlers`, the engine they call (model, batcher, reranker, index)
:mod:`robustir.serving.service`, the error handler :mod:`robustir.serving.errors`, and the index itself the library
:mod:`robustir.index.store`.
"""

import contextlib
import copy
import functools
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError
from .batcher import MicroBatcher
from .config import ServeConfig
from .middleware import RequestContext
from .schemas import Limits, request_models

from .errors import ApiError, _error_response
from .routes import openapi, router
from .service import INGEST, RERANK, Server, _query_precision, _search_threads, _workers, set_torch_threads

logger = logging.getLogger(__name__)

__all__ = ["ServeConfig", "create_app"]


def create_app(model: Any = None, index: Any = None, config: ServeConfig | None = None, *,
               encoder_options: dict | None = None, storage_options: dict | None = None) -> FastAPI:
    """The FastAPI app serving ``model`` (a folder, hub id or :class:`~robustir.models.encoder.Encoder`; default: the
    index's model, else the bundled MiniLM) and, optionally, ``index`` (a folder or an open
    :class:`~robustir.index.store.SearchIndex`, checked to be built with ``model``).

    The model loads here, so a bad model, index or setting fails before any port is opened.
    """
    import concurrent.futures

    import torch

    from ..device import resolve_device
    from ..index.store.records import _model_label
    from ..precision import resolve_precision
    from .metrics import ServerMetrics

    config = (config or ServeConfig()).validate()
    api_key, read_key = config.resolved_api_key(), config.resolved_read_api_key()
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    workers, encode_batch = _workers(config, device, precision)
    options = {k: v for k, v in (encoder_options or {}).items() if v is not None}

    search_index, encoder, given = _load_model(model, index, config, options, device, storage_options)
    if search_index is not None:
        precision = _query_precision(search_index, config, device, precision)
        workers, encode_batch = _workers(config, device, precision)
    encoder.eval()
    name = config.served_model_name or (search_index.model_name if search_index is not None else _model_label(given))
    aliases = {name, given, str(Path(given).expanduser().resolve()) if Path(given).expanduser().exists() else given}
    dim = encoder.dim
    # builds the bf16/fp16 copy once, before the workers start
    encoder.encode(["warm-up"], "query", precision=precision, show_progress=False)
    encode = _batch_encoder(encoder, workers, encode_batch, precision, config)
    metrics = ServerMetrics(lambda: batcher.queued, workers)  # read at scrape time, when the batcher exists
    lane = device.type != "cuda" and workers == 1  # an upsert's micro-batches run beside the searches' (issue 55)
    batcher = MicroBatcher(encode, max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms,
                           workers=workers, max_queued=config.max_queued_texts, on_batch=metrics.on_batch,
                           background_lane=lane, set_threads=set_torch_threads if lane else None,
                           threads=torch.get_num_threads())
    reranker, reranker_name = _reranker(config, batcher, encode_batch, precision, device)
    _ingest(batcher, encode, config, device, encode_batch)
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
    # once, with what is served (the first _workers call above may have been for another precision than the index's)
    logger.info("robustir serve: %s", server.describe())
    return _wire(server, batcher, metrics, config)


def _load_model(model: Any, index: Any, config: ServeConfig, options: dict, device: Any,
                storage_options: dict | None) -> tuple[Any, Any, str]:
    """(the open index or None, the encoder, the name it was given as): the index's own model when an index is
    served (another one is refused; an HTTP upsert a killed server left is finished first), else ``model``."""
    from ..index.store import SearchIndex
    from ..models.encoder import Encoder

    if index is None:
        if isinstance(model, Encoder):
            return None, model.to(device), model.source or "model"
        from ..resources import default_model_path

        given = str(model) if model is not None else default_model_path()
        encoder = Encoder.from_pretrained(given, device=device, **options)
        encoder.source = given
        return None, encoder, given
    if options:
        raise ConfigError(f"encoder options ({', '.join(sorted(options))}) come from the index's manifest when an "
                          "index is served: leave them out")
    if not isinstance(index, SearchIndex):  # an HTTP upsert a killed server left: finished before serving
        from ..index.store.spool import finish_incoming
        from ..index.store.stores import open_store

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
    return search_index, search_index.encoder, given


def _batch_encoder(encoder: Any, workers: int, encode_batch: int, precision: str, config: ServeConfig) -> Any:
    """What the batcher runs on a micro-batch of token ids, on each worker thread with its own view of the model."""
    local = threading.local()

    def worker_encoder() -> Any:
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
        pad = config.pad_to_multiple_of if config.pad_to_multiple_of > 1 else None
        return worker_encoder().encode_ids(ids, batch_size=encode_batch, precision=at, pad_to_multiple_of=pad)

    return encode


def _wire(server: Server, batcher: MicroBatcher, metrics: Any, config: ServeConfig) -> FastAPI:
    """The FastAPI app around ``server``: its lifespan (the batcher), the routes, the error handler, the metrics,
    CORS and the request middleware."""
    from .. import __version__

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
    app.include_router(router, max_body_size=config.max_body_bytes)  # the routes' limit: a JSON 413
    app.state.server, app.state.requests = server, request_models(Limits.of(config))
    app.openapi = functools.partial(openapi, app)  # type: ignore[method-assign]
    metrics.instrument(app)
    if server.index is not None:
        metrics.watch_index(lambda: server.index.untyped_fields)
    if config.cors_allow_origin:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origin,
                           allow_methods=["GET", "POST", "DELETE"],  # every method the API has
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID", "X-Total-Time", "X-Queue-Time", "X-Inference-Time"])
    app.add_middleware(RequestContext, max_body_bytes=config.max_body_bytes)
    return app


def _reranker(config: ServeConfig, batcher: MicroBatcher, encode_batch: int, precision: str,
              device: Any) -> tuple[Any, str | None]:
    """The cross-encoder of ``--rerank-model`` and its name, loaded here (a bad folder fails before any port opens)
    and added to the batcher as a second model; (None, None) without one."""
    if not config.rerank_model:
        return None, None
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
    return reranker, reranker_name


def _ingest(batcher: MicroBatcher, encode: Any, config: ServeConfig, device: Any, encode_batch: int) -> None:
    """An HTTP upsert's documents as the batcher's background model (:data:`~robustir.serving.service.INGEST`), in
    micro-batches of ``--ingest-batch-size`` (default: a forward pass). On a CPU with one worker (fp32) they run on the
    batcher's background lane, beside the searches' batches, each lane with one of the CPUs while both have work
    (bench/upsert_search.py: turns on the one worker with 4 documents a micro-batch left a search's p99 at 1.76-1.92x
    its idle p99, most of the slowest searches' time spent waiting for the upsert's micro-batch). With several workers
    they take turns with the other batches on one worker fewer, so a search always finds one free."""

    def encode_documents(rows: list[tuple[list[int], str]]) -> np.ndarray:
        """(token ids, the index's precision) rows of one job (writes are one at a time: one precision)."""
        return encode([ids for ids, _ in rows], rows[0][1])

    size = config.ingest_batch_size or encode_batch
    batcher.add_model(INGEST, encode_documents, batch_size=size, unit="document", background=True)
