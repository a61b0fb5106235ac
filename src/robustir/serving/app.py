"""The FastAPI app of ``robustir serve``: OpenAI-compatible embeddings and search over a :class:`SearchIndex`.

Routes:

* ``POST /v1/embeddings`` -- OpenAI's request and response: ``input`` (a string or a list of strings; token-id
  arrays are refused with 400), ``model``, ``encoding_format`` (``float``, or ``base64``: little-endian float32, what
  the ``openai`` client asks for by default), ``dimensions`` (only for sizes the model was trained for, declared
  with ``--matryoshka-dims``; the vector is cut and re-normalised), ``user`` (ignored); plus the extension
  ``input_type``: ``document`` (default) or ``query`` (the model's query instruction and query length apply).
  ``usage`` counts the tokens the model saw (instruction and special tokens included, after truncation).
* ``POST /search`` -- ``{"query": str | [str], "top_k": int, "filter": {...}, "mode": "dense" | "lexical" |
  "hybrid", "fusion": {"rrf_k", "dense_weight", "lexical_weight", "candidates"}}`` ->
  ``{"hits": [{"id", "score", "title", "text", "fields"}]}`` (for a list of queries, a list of such lists). ``dense``
  (default) searches with the model, ``lexical`` with BM25 over title and text (no model), ``hybrid`` fuses both
  lists by reciprocal rank (``fusion``, as ``robustir eval --mode hybrid``; only with ``hybrid``). The filter is
  :mod:`robustir.serving.filters`' JSON language: ``{"lang": "en"}``, ``{"lang": ["en", "de"]}``,
  ``{"year": {"$gte": 2020, "$lt": 2024}}``, ``$eq``/``$ne``/``$in``/``$nin``, nested fields by dotted name
  (``{"meta.source": "pubmed"}``) and ``$and``/``$or``/``$not``; it is checked before the model runs. Every query
  reads the index's latest committed version: ``robustir index --add / --upsert / --delete`` while the server runs
  show on the next query, with no restart.
* ``GET /health`` (no key needed; says nothing about the data) and ``GET /v1/models``.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed request (bad JSON,
a missing or unknown field, a wrong type, too many inputs, an input too long, an unsupported ``dimensions``, a bad
filter, whose message names the place in it, e.g. ``filter.year.$gt``), 401 without the right ``Authorization:
Bearer KEY`` when the server has an API key, 404 for a ``model`` that is not the served one (OpenAI's
``model_not_found``) and for ``/search`` on a server without an index, 413 for a body over ``max_body_bytes``, 500
when the model fails.

Concurrent requests are batched (:class:`~robustir.serving.batcher.MicroBatcher`); the model and LanceDB run on worker
threads (one on a GPU; one per core on the CPU, each with its own tokenizer and one torch thread), the event loop only
parses, validates and answers.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request  # module level: FastAPI reads the handlers' annotations from these globals
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError, RobustIRError
from ..index.fusion import FusionConfig
from ..validation import OptionError
from .config import ServeConfig

logger = logging.getLogger(__name__)

__all__ = ["ServeConfig", "create_app", "ApiError"]


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------ validation

def _texts(value: Any, param: str, config: ServeConfig) -> list[str]:
    """A string or a non-empty list of non-empty strings, within the limits."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list):
        if not value:
            raise ApiError(400, f"'{param}' is an empty list; send at least one string", param=param)
        items = value
    else:
        raise ApiError(400, f"'{param}' must be a string or a list of strings, got {_type(value)}", param=param)
    if len(items) > config.max_inputs_per_request:
        raise ApiError(400, f"'{param}' holds {len(items)} items; at most {config.max_inputs_per_request} per request "
                       "(split it into several requests)", param=param, code="too_many_inputs")
    for i, item in enumerate(items):
        where = f"{param}[{i}]" if isinstance(value, list) else param
        if isinstance(item, (int, list)) and not isinstance(item, bool):
            raise ApiError(400, f"'{where}' is a token-id array; this server takes text only: send the text itself",
                           param=where, code="token_ids_not_supported")
        if not isinstance(item, str):
            raise ApiError(400, f"'{where}' must be a string, got {_type(item)}", param=where)
        if not item.strip():
            raise ApiError(400, f"'{where}' is empty; every input needs some text", param=where)
        if len(item) > config.max_chars_per_input:
            raise ApiError(400, f"'{where}' has {len(item)} characters; at most {config.max_chars_per_input} per input "
                           "(split it into passages)", param=where, code="input_too_long")
    return items


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _check_fields(body: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type(body)}")
    unknown = [key for key in body if key not in allowed]
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(map(repr, unknown))}; this endpoint takes "
                       f"{', '.join(allowed)}", param=unknown[0])
    for key in required:
        if key not in body:
            raise ApiError(400, f"'{key}' is required", param=key)
    return body


# ------------------------------------------------------------------------------------------------ the app

def create_app(model: Any = None, index: Any = None, config: ServeConfig | None = None, *,
               encoder_options: dict | None = None):
    """The FastAPI app serving ``model`` (a folder, hub id or :class:`~robustir.models.encoder.Encoder`; default: the
    index's model, else the bundled MiniLM) and, optionally, ``index`` (a folder or an open
    :class:`~robustir.serving.index.SearchIndex`, checked to be built with ``model``).

    The model loads here, so a bad model or index fails before any port is opened.
    """
    from ..device import resolve_device
    from ..models.encoder import Encoder
    from ..precision import resolve_precision
    from .batcher import MicroBatcher
    from .index import SearchIndex, _model_label

    config = (config or ServeConfig()).validate()
    api_key = config.api_key if config.api_key is not None else (os.environ.get("ROBUSTIR_API_KEY") or None)
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    workers, encode_batch = _workers(config, device, precision)
    options = {k: v for k, v in (encoder_options or {}).items() if v is not None}

    search_index: SearchIndex | None = None
    if index is not None:
        if options:
            raise ConfigError(f"encoder options ({', '.join(sorted(options))}) come from the index's manifest when an "
                              "index is served: leave them out")
        search_index = index if isinstance(index, SearchIndex) else SearchIndex.open(index)
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
    allowed_dims = sorted({dim, *[d for d in config.matryoshka_dims or [] if d <= dim]})
    created = int(time.time())
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

    def encode(texts: list[str], kind: str) -> tuple[np.ndarray, list[int]]:
        model = worker_encoder()
        vectors = model.encode(texts, kind, batch_size=encode_batch, precision=precision, show_progress=False)
        ids = model.tokenizer(model.config.with_instruction(texts, kind), truncation=True,
                              max_length=model.config.max_length(kind), return_attention_mask=False,
                              return_token_type_ids=False)["input_ids"]
        return vectors, [len(x) for x in ids]

    batcher = MicroBatcher(encode, max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms,
                           workers=workers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="robustir", description="OpenAI-compatible embeddings and search with a robustir retriever",
                  lifespan=lifespan)
    app.state.batcher = batcher
    app.state.encoder = encoder
    app.state.index = search_index
    app.state.model_name = name

    def answer(payload: Any, status: int = 200) -> Response:
        return Response(json.dumps(payload, ensure_ascii=False, separators=(",", ":")), status_code=status,
                        media_type="application/json")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; routes: POST /v1/embeddings, POST /search, GET /v1/models, GET /health"
        return JSONResponse(ApiError(exc.status_code, message, code=code).body(), status_code=exc.status_code)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, f"Content-Length {length!r} is not a number")
            if int(length) > config.max_body_bytes:
                raise ApiError(413, f"the request body has {int(length)} bytes; at most {config.max_body_bytes} "
                               "(send fewer or shorter inputs per request)", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_body_bytes:
                raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes (send fewer or shorter "
                               "inputs per request)", code="request_too_large")
        try:
            return json.loads(bytes(body))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None

    def check_model(value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise ApiError(400, f"'model' must be a string, got {_type(value)}", param="model")
        if value not in aliases:
            raise ApiError(404, f"the model '{value}' does not exist on this server; it serves '{name}' (GET "
                           "/v1/models)", param="model", code="model_not_found")

    async def run_model(texts: list[str], kind: str) -> tuple[np.ndarray, list[int]]:
        try:
            return await batcher.embed(texts, kind)
        except RobustIRError as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:
            logger.exception("the model failed")
            raise ApiError(500, f"the model failed: {type(exc).__name__}: {exc}", kind="server_error",
                           code="internal_error") from None

    @app.get("/health")
    async def health():
        return answer({"status": "ok", "model": name, "dimension": dim, "device": str(device), "precision": precision,
                       "workers": workers, "torch_threads": torch.get_num_threads(),
                       "index": None if search_index is None else {
                           "path": str(search_index.path), "documents": search_index.count,
                           "kind": search_index.kind},
                       "batching": {"max_batch_size": config.max_batch_size, "max_wait_ms": config.max_wait_ms,
                                    "encode_batch_size": encode_batch,
                                    **batcher.stats.to_dict()}})

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return answer({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                   "owned_by": "robustir"}]})

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request):
        authorize(request)
        check_model(model_id)
        return answer({"id": name, "object": "model", "created": created, "owned_by": "robustir"})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        authorize(request)
        body = _check_fields(await read_json(request),
                             ("input", "model", "encoding_format", "dimensions", "user", "input_type"), ("input",))
        check_model(body.get("model"))
        texts = _texts(body["input"], "input", config)
        fmt = body.get("encoding_format", "float")
        if fmt is None:
            fmt = "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {json.dumps(fmt)[:40]}",
                           param="encoding_format")
        kind = body.get("input_type", "document")
        if kind not in ("query", "document"):
            raise ApiError(400, f"'input_type' must be 'query' or 'document', got {json.dumps(kind)[:40]}",
                           param="input_type")
        dims = body.get("dimensions")
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int):
                raise ApiError(400, f"'dimensions' must be an integer, got {_type(dims)}", param="dimensions")
            if dims not in allowed_dims:
                hint = (f"this model supports {', '.join(map(str, allowed_dims))}" if len(allowed_dims) > 1 else
                        f"this model was not trained to be cut (Matryoshka): it gives {dim} dimensions only (a server "
                        "for a Matryoshka model declares its sizes with --matryoshka-dims)")
                raise ApiError(400, f"'dimensions' = {dims} is not supported: {hint}", param="dimensions")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ApiError(400, f"'user' must be a string, got {_type(user)}", param="user")
        vectors, counts = await run_model(texts, "query" if kind == "query" else "passage")
        if dims is not None and dims != dim:
            vectors = vectors[:, :dims]
            if encoder.config.normalize:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(row.tobytes()).decode("ascii") if fmt == "base64" else row.tolist()}
                for i, row in enumerate(vectors)]
        tokens = int(sum(counts))
        return answer({"object": "list", "data": data, "model": name,
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/search")
    async def search(request: Request):
        authorize(request)
        if search_index is None:
            raise ApiError(404, "this server has no index: start it with --index IDX (built by robustir index)",
                           code="no_index")
        body = _check_fields(await read_json(request),
                             ("query", "top_k", "filter", "model", "mode", "fusion"), ("query",))
        check_model(body.get("model"))
        queries = _texts(body["query"], "query", config)
        top_k = body.get("top_k", 10)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= config.max_top_k:
            raise ApiError(400, f"'top_k' must be an integer from 1 to {config.max_top_k}, got "
                           f"{json.dumps(top_k)[:40]}", param="top_k")
        mode = body.get("mode", "dense")
        if mode not in ("dense", "lexical", "hybrid"):
            raise ApiError(400, f"'mode' must be 'dense', 'lexical' or 'hybrid', got {json.dumps(mode)[:40]}",
                           param="mode")
        fusion = body.get("fusion")
        if fusion is not None:
            if mode != "hybrid":
                raise ApiError(400, f"'fusion' goes with mode 'hybrid', not {mode!r}", param="fusion")
            if not isinstance(fusion, dict):
                raise ApiError(400, f"'fusion' must be an object ({{\"rrf_k\", \"dense_weight\", \"lexical_weight\", "
                               f"\"candidates\"}}), got {_type(fusion)}", param="fusion")
            try:
                fusion = FusionConfig(**fusion)
            except OptionError as exc:
                raise ApiError(400, str(exc.under("fusion")), param="fusion") from None
            if fusion.candidates > config.max_top_k:
                raise ApiError(400, f"fusion.candidates must be at most {config.max_top_k}, got {fusion.candidates}",
                               param="fusion")
        where = body.get("filter")
        if where is not None and not isinstance(where, dict):
            raise ApiError(400, f"'filter' must be an object of field: value, got {_type(where)}", param="filter")
        if where:
            try:  # a bad filter is refused before the model runs
                search_index.check_filter(where)
            except ConfigError as exc:
                raise ApiError(400, str(exc), param="filter") from None
        vectors = None if mode == "lexical" else (await run_model(queries, "query"))[0]
        try:
            hits = await batcher.run(functools.partial(search_index.search_encoded, queries, vectors, top_k,
                                                       where or None, mode=mode, fusion=fusion))
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="filter") from None
        rows = [[hit.to_dict() for hit in row] for row in hits]
        return answer({"hits": rows[0] if isinstance(body["query"], str) else rows})

    return app


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
    if torch.get_num_threads() != threads:
        logger.info("robustir serve: %d model worker(s) with %d torch thread(s) each on %d CPUs (%s)", workers,
                    threads, cores, precision)
        torch.set_num_threads(threads)
    return workers, min(config.encode_batch_size or 16, config.max_batch_size)
