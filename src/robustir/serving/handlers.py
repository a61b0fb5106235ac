"""What each route of ``robustir serve`` does (:mod:`robustir.serving.routes` only maps HTTP onto these): check the
request, call the engine (:class:`~robustir.serving.service.Server`: the model's batcher, the reranker, the index
library), shape the answer. Each takes the server and the request's parsed body."""

import base64
import functools
import json
import logging
import time
from typing import Any

import numpy as np
import pydantic_core
import torch
from fastapi import Request
from fastapi.responses import Response

from ..data.beir import encoding_text
from ..errors import ConfigError, DataError
from ..index.fusion import FusionConfig
from .errors import ApiError, _type
from .service import Server

logger = logging.getLogger(__name__)


async def health(s: Server) -> Response:
    try:
        index = None if s.index is None else {"documents": s.index.count, "kind": s.index.kind}
    except DataError as exc:  # e.g. rebuilt with another model: a restart is the fix, so health says so
        raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
    return _answer({"status": "ok", "model": s.name, "dimension": s.dim, "device": s.device,
                    "precision": s.precision, "workers": s.workers, "torch_threads": torch.get_num_threads(),
                    "queued_texts": s.batcher.queued, "index": index,
                    "batching": {"max_batch_size": s.config.max_batch_size, "max_wait_ms": s.config.max_wait_ms,
                                 "encode_batch_size": s.encode_batch, **s.batcher.stats.to_dict()}})


async def info(s: Server) -> Response:
    from .. import __version__

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


async def embeddings(s: Server, body: Any, request: Request) -> Response:
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


async def search(s: Server, body: Any, request: Request) -> Response:
    started = time.perf_counter()
    _need_index(s)
    s.check_model(body.model)
    queries, c = body.query or [""] * len(body.vector), s.config  # by vector: placeholders, dense only
    if body.vector is not None:
        _check_query_vectors(body, s.dim)
    _check_hits(body, queries, c)
    try:  # compiled once, after one look at the manifest; a bad filter is refused before the model runs
        where = s.index.compile_filter(body.filter) if body.filter else None
    except ConfigError as exc:
        raise ApiError(400, str(exc), param="filter") from None
    except DataError as exc:  # the index on disk cannot be served (rebuilt with another model, damaged)
        raise ApiError(503, f"the index cannot be served: {exc}", code="index_unavailable") from None
    vectors, headers = await _query_vectors(s, body, queries, request)
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
    payload = _hits_json(found, body.single, c.max_response_bytes)
    s.metrics.searched(body.mode, "text" if body.vector is None else "vector", len(queries),
                       time.perf_counter() - started)
    return Response('{"hits":' + payload + "}", media_type="application/json", headers=headers)


async def rerank(s: Server, body: Any, request: Request) -> Response:
    """Order ``documents`` by relevance to ``query`` (Infinity's and Cohere's shape): the cross-encoder of
--rerank-model, else the served embedding model's cosine."""
    s.check_model(body.model, s.reranker_name, s.config.rerank_model)  # the reranker's name, or the embedder's
    scores = await s.rerank_scores(body.query, list(body.documents), request)
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:body.top_n]
    results = [{"relevance_score": float(scores[i]), "index": i,
                **({"document": body.documents[i]} if body.return_documents else {})} for i in order]
    return _answer({"object": "rerank", "results": results, "model": s.reranker_name or s.name})


async def upsert_documents(s: Server, body: Any) -> Response:
    """Insert documents, replacing those whose id exists (``robustir index --upsert``), answered once committed;
``/search`` finds them on its next query."""
    from ..index.store import spool
    from ..index.store.jobs import UnfinishedJob

    _need_index(s)
    c, started = s.config, time.perf_counter()
    for i, document in enumerate(body.documents):
        _check_document(document, i, c.max_chars_per_input)
    _check_field_count(body.documents)
    async with s.write_lock:
        try:
            report = await s.upsert(body.documents)
        except spool.DocumentError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except UnfinishedJob as exc:  # a killed CLI job's record: never erased, named with its fix
            raise ApiError(409, str(exc), code="unfinished_job") from None
        except ConfigError as exc:  # another process holds the index's writer lock
            raise ApiError(409, str(exc), code="index_busy") from None
        except spool.StorageFailure as exc:  # a full disk: the cause, and the next write finishes what this began
            raise ApiError(exc.status, f"{exc} (an upsert stopped half-way is finished by the server's next "
                           "write; sending the same request again is safe)",
                           kind="server_error", code="insufficient_storage" if exc.status == 507
                           else "storage_error") from None
    s.metrics.ingested("upsert", report.added, time.perf_counter() - started)
    return _answer({"object": "documents", "upserted": report.added, "documents": report.documents})


async def delete_documents(s: Server, body: Any) -> Response:
    """Delete documents by ``ids`` or by ``filter`` (``robustir index --delete``: one commit, all or nothing)."""
    from ..index.store import spool
    from ..index.store.jobs import UnfinishedJob

    _need_index(s)
    started = time.perf_counter()
    if body.filter:
        try:
            s.index.check_filter(body.filter)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="filter") from None
    async with s.write_lock:
        try:
            report = await s.searching(spool.delete_documents, s.index.store, body.ids, body.filter,
                                         s.config.max_inputs_per_request, s.encoder)
        except DataError as exc:  # an id not in the index: nothing deleted
            raise ApiError(404, exc.problem + (f" ({exc.fix})" if exc.fix else ""), param="ids",
                           code="document_not_found") from None
        except UnfinishedJob as exc:  # a killed CLI job's record: never erased, named with its fix
            raise ApiError(409, str(exc), code="unfinished_job") from None
        except spool.StorageFailure as exc:
            raise ApiError(exc.status, str(exc), kind="server_error",
                           code="insufficient_storage" if exc.status == 507 else "storage_error") from None
        except ConfigError as exc:
            busy = "being changed by another process" in str(exc)
            raise ApiError(409 if busy else 400, str(exc), param=None if busy else "filter",
                           code="index_busy" if busy else None) from None
    s.metrics.ingested("delete", report.deleted, time.perf_counter() - started)
    return _answer({"object": "documents", "deleted": report.deleted, "documents": report.documents})


async def get_document(s: Server, document_id: str) -> Response:
    """The document with this id (an id may hold ``/``: ``GET /documents/a/b`` is the document ``a/b``)."""
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


def _answer(payload: Any, headers: dict | None = None) -> Response:
    """``payload`` as compact UTF-8 JSON, by pydantic-core's serialiser: 21 us for a one-text /v1/embeddings answer
    (384 floats) against 166 us with ``json.dumps`` on the 2-core dev box -- time on the event loop, which every
    request shares (issue 55, one-text requests at 32 clients); the same numbers (shortest round-trip floats)."""
    return Response(pydantic_core.to_json(payload), media_type="application/json", headers=headers)


def _timing(result: Any) -> dict:
    return {"X-Queue-Time": f"{result.queue_s * 1000:.2f}", "X-Inference-Time": f"{result.inference_s * 1000:.2f}"}


def _need_index(s: Server) -> None:
    """A route on the index of a server started without one: 404."""
    if s.index is None:
        raise ApiError(404, "this server has no index: start it with --index IDX (built by robustir index)",
                       code="no_index")


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


async def _query_vectors(s: Server, body: Any, queries: list[str], request: Request) -> tuple[Any, dict | None]:
    """The queries' vectors (and the timing headers) for a dense or hybrid search: the request's own (``vector``),
    or the model's through the batcher; (None, None) for a lexical one."""
    if body.vector is not None:
        return np.asarray(body.vector, dtype=np.float32), None
    if body.mode == "lexical":
        return None, None
    ids = await s.tokenize(queries, "query", "query")
    result = await s.embed(ids, request)
    s.metrics.embedded("query", len(ids), sum(map(len, ids)))
    return result.vectors, _timing(result)


def _check_query_vectors(body: Any, dim: int) -> None:
    """A search by vector: dense mode, no rerank (both need the query's text), each vector the index's dimension."""
    if body.mode != "dense" or body.rerank:
        what = "rerank" if body.rerank else f"mode {body.mode!r}"
        raise ApiError(400, f"a search by 'vector' is dense only: {what} needs the query's text (send 'query' "
                       "instead)", param="rerank" if body.rerank else "mode")
    from ..index.store.records import vector_problem

    for i, row in enumerate(body.vector):
        where = "vector" if body.single else f"vector[{i}]"
        if len(row) != dim:
            raise ApiError(400, f"'{where}' has {len(row)} numbers; this index's vectors have {dim} (GET /info: "
                           "'dimension')", param=where)
        problem = vector_problem(row)
        if problem:
            raise ApiError(400, f"'{where}': {problem}", param=where)


def _check_hits(body: Any, queries: list, c: Any) -> None:
    """A search's ``fusion`` goes with ``hybrid`` and reads at most ``--max-top-k``; its queries x depth (``top_k``,
    or the reranker's or the fusion's candidates when deeper) stay within ``--max-hits-per-request`` (413)."""
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


def _hits_json(found: list[list[dict]], single: bool, max_bytes: int) -> str:
    """The hits as JSON, serialised query by query: an answer over ``max_bytes`` is refused (413) before it is all
    built."""
    rows, size = [], 0
    for row in found:  # serialised query by query: an answer over the limit is refused before it is all built
        text = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
        size += len(text)
        if size > max_bytes:
            raise ApiError(413, f"the answer would be over {max_bytes} bytes (--max-response-bytes): "
                           "send fewer queries per request or a smaller top_k", param="top_k",
                           code="response_too_large")
        rows.append(text)
    payload = rows[0] if single else "[" + ",".join(rows) + "]"
    return payload
