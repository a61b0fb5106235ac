"""The HTTP calls the framework integrations make to ``robustir serve`` (httpx; the server's errors raised with its
own message, which names the field and the fix).

Writes are split client-side under the server's limits (``GET /info``'s ``max_inputs_per_request`` documents or ids
and ``max_body_bytes`` a request), so a framework may hand over any number of documents; an error in a later request
says how many went in before it (an upsert may simply be sent again). The server returns no stored vectors, so
:func:`candidates_with_vectors` (maximal marginal relevance) re-embeds the candidates through ``/v1/embeddings``:
the served model, the text the index embedded (title and text), so the same vectors up to the precision.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Iterator, Literal, Sequence
from urllib.parse import quote

import httpx
import numpy as np

__all__ = ["RobustirServerError", "search", "upsert", "delete", "get_documents", "embed", "candidates_with_vectors",
           "relevance_fn", "document_ids", "Connection"]

Mode = Literal["dense", "lexical", "hybrid"]

_JSON = {"Content-Type": "application/json"}

class RobustirServerError(RuntimeError):
    """The server refused a request: ``status`` and its error object (``{"message", "type", "param", "code"}``)."""

    def __init__(self, status: int, error: dict) -> None:
        super().__init__(f"robustir serve answered {status}: {error.get('message', error)}")
        self.status, self.error = status, error


class Connection:
    """Where the server is and how to reach it: ``base_url`` (``http://127.0.0.1:8080``; a trailing ``/v1`` is
    accepted), ``api_key`` (the server's ``--api-key``), ``timeout`` seconds."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None,
                 timeout: float = 60.0) -> None:
        base = base_url.rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._limits: dict | None = None

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout)

    def post(self, path: str, body: dict, method: str = "POST") -> dict:
        with self.client() as client:
            return _answer(client.request(method, path, json=body))

    def limits(self) -> dict:
        """The server's ``GET /info`` limits (read once per connection)."""
        if self._limits is None:
            with self.client() as client:
                self._limits = _answer(client.get("/info"))["limits"]
        return self._limits

    async def apost(self, path: str, body: dict, method: str = "POST") -> dict:
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout) as client:
            return _answer(await client.request(method, path, json=body))


def _answer(reply: httpx.Response) -> dict:
    try:
        body = reply.json()
    except ValueError:
        body = {"error": {"message": reply.text[:500]}}
    if reply.status_code != 200:
        raise RobustirServerError(reply.status_code, body.get("error") if isinstance(body, dict) else {})
    return body


def search_body(query: str, top_k: int, mode: Mode, filter: dict | None, rerank: bool,
                fusion: dict | None = None) -> dict:
    body: dict[str, Any] = {"query": query, "top_k": top_k, "mode": mode}
    if filter:
        body["filter"] = filter
    if rerank:
        body["rerank"] = True
    if fusion:
        body["fusion"] = fusion
    return body


def search(connection: Connection, query: str, *, top_k: int = 4, mode: Mode = "dense", filter: dict | None = None,
           rerank: bool = False, fusion: dict | None = None) -> list[dict]:
    """``POST /search`` for one query: its hits, best first (``id``, ``score``, ``title``, ``text``, ``fields``;
    ``rerank_score`` with ``rerank``). ``fusion``: hybrid's ``{"rrf_k", "dense_weight", "lexical_weight",
    "candidates"}``."""
    return connection.post("/search", search_body(query, top_k, mode, filter, rerank, fusion))["hits"]


def search_by_vector(connection: Connection, vector: Sequence[float], *, top_k: int = 4,
                     filter: dict | None = None) -> list[dict]:
    """``POST /search`` with ``vector`` instead of a query (dense only; the index's dimension): its hits, best first,
    scored by inner product."""
    body: dict[str, Any] = {"vector": [float(x) for x in vector], "top_k": top_k}
    if filter:
        body["filter"] = filter
    return connection.post("/search", body)["hits"]


def hit_vectors(connection: Connection, hits: list[dict]) -> np.ndarray:
    """The hits' vectors as the index made them (title and text, embedded as documents through ``/v1/embeddings``:
    the server returns no stored vectors)."""
    from ..data.beir import encoding_text

    return embed(connection, [encoding_text(h.get("title") or "", h["text"]) for h in hits], "document")


def document_ids(ids: Sequence[str | None] | None, count: int) -> list[str]:
    """One id per document: the given one, or a new uuid4 where none is given (``None`` in ``ids``, or no ``ids``)
    -- LangChain's convention; the server itself takes no document without an id."""
    if ids is None:
        return [str(uuid.uuid4()) for _ in range(count)]
    if len(ids) != count:
        raise ValueError(f"{count} documents but {len(ids)} ids: give one id per document (None where the store "
                         "should make one)")
    return [str(uuid.uuid4()) if doc_id is None else doc_id for doc_id in ids]


def _json(body: Any) -> bytes:
    """A request body as this module sends it (compact UTF-8: what :func:`_batches` measures)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _batches(items: Sequence[Any], most: int, max_bytes: int) -> Iterator[tuple[int, list]]:
    """``(start, items[start:end])`` chunks of at most ``most`` items whose body (:func:`_json`) stays within
    ``max_bytes``; an item too big for any request goes alone (the server names it in its 413)."""
    budget = max_bytes - 64  # the envelope: {"documents":[...]} or {"input":[...],"input_type":"document"}
    start, chunk, size = 0, [], 0
    for i, item in enumerate(items):
        item_size = len(_json(item)) + 1
        if chunk and (len(chunk) >= most or size + item_size > budget):
            yield start, chunk
            start, chunk, size = i, [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield start, chunk


def _shifted(error: dict, offset: int, done: int, what: str) -> dict:
    """The server's error for one chunk, its ``documents[i]`` / ``ids[i]`` renumbered to the caller's whole list and
    what the earlier chunks did said."""
    def shift(text: Any) -> Any:
        if not isinstance(text, str):
            return text
        return re.sub(r"\b(documents|ids)\[(\d+)\]", lambda m: f"{m.group(1)}[{int(m.group(2)) + offset}]", text)

    note = f" ({done} {what} before this request; sending the same call again is safe)" if done else ""
    return {**error, "message": shift(error.get("message", "")) + note, "param": shift(error.get("param"))}


def _in_chunks(connection: Connection, key: str, items: Sequence[Any], method: str, what: str) -> list[dict]:
    limits = connection.limits()
    answers: list[dict] = []
    with connection.client() as client:
        for start, chunk in _batches(items, limits["max_inputs_per_request"], limits["max_body_bytes"]):
            try:
                answers.append(_answer(client.request(method, "/documents", content=_json({key: chunk}),
                                                      headers=_JSON)))
            except RobustirServerError as exc:
                raise RobustirServerError(exc.status, _shifted(exc.error, start, start, what)) from None
    return answers


def upsert(connection: Connection, documents: Sequence[dict]) -> dict:
    """``POST /documents``: insert or replace (by id) ``documents`` (``_id``, ``title``, ``text``, other fields), in
    as many requests as the server's limits ask; ``{"upserted", "documents"}`` summed over them."""
    answers = _in_chunks(connection, "documents", documents, "POST", "documents were upserted")
    return {"upserted": sum(a["upserted"] for a in answers), "documents": answers[-1]["documents"] if answers else None}


def delete(connection: Connection, ids: Sequence[str] | None = None, filter: dict | None = None) -> dict:
    """``DELETE /documents`` by ``ids`` (in chunks under the server's limits; an id not in the index fails its chunk)
    or by ``filter`` (one request: at most ``max_inputs_per_request`` matches)."""
    if ids is None:
        return connection.post("/documents", {"filter": filter}, method="DELETE")
    answers = _in_chunks(connection, "ids", list(ids), "DELETE", "ids were deleted")
    return {"deleted": sum(a["deleted"] for a in answers), "documents": answers[-1]["documents"] if answers else None}


def get_documents(connection: Connection, ids: Sequence[str]) -> list[dict]:
    """``GET /documents/{id}`` for each id (an id may hold ``/``): the documents found, in the order asked; an id
    the index does not hold is left out."""
    found = []
    with connection.client() as client:
        for doc_id in dict.fromkeys(ids):
            reply = client.get("/documents/" + quote(doc_id, safe="/"))
            if reply.status_code == 404 and (reply.json().get("error") or {}).get("code") == "document_not_found":
                continue
            found.append(_answer(reply))
    return found


def embed(connection: Connection, texts: Sequence[str], input_type: Literal["query", "document"]) -> np.ndarray:
    """``POST /v1/embeddings`` of ``texts`` (in chunks under the server's limits): a ``(len(texts), dim)`` array."""
    limits = connection.limits()
    rows: list[list[float]] = []
    with connection.client() as client:
        for _, chunk in _batches(list(texts), limits["max_inputs_per_request"], limits["max_body_bytes"]):
            answer = _answer(client.post("/v1/embeddings", content=_json({"input": chunk, "input_type": input_type}),
                                         headers=_JSON))
            rows.extend(item["embedding"] for item in sorted(answer["data"], key=lambda item: item["index"]))
    return np.asarray(rows, dtype=np.float32)


def candidates_with_vectors(connection: Connection, query: str, fetch_k: int,
                            **options: Any) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """What maximal marginal relevance needs: the query's ``fetch_k`` best hits (``/search`` with ``options``), the
    query's vector and the hits' vectors. The server returns no stored vectors, so the hits are embedded again
    through ``/v1/embeddings`` as the index embedded them (title and text, as documents) and the query as a query."""
    hits = search(connection, query, top_k=fetch_k, **options)
    if not hits:
        return [], np.zeros(0, dtype=np.float32), np.zeros((0, 0), dtype=np.float32)
    return hits, embed(connection, [query], "query")[0], hit_vectors(connection, hits)


def relevance_fn(mode: Mode, rerank: bool = False, fusion: dict | None = None) -> Callable[[float], float]:
    """Score -> relevance in [0, 1] (1 most relevant) for a search of ``mode``: a dense (or reranked) score is a
    cosine similarity (or a cross-encoder's sigmoid), taken as it is and clipped to [0, 1] (a negative cosine is
    0); a hybrid score is RRF's, divided by the best a document can get (first in both lists:
    ``(dense_weight + lexical_weight) / (rrf_k + 1)``). A lexical (BM25) score has no such scale: refused."""
    if rerank or mode == "dense":
        return lambda score: min(1.0, max(0.0, float(score)))
    if mode == "hybrid":
        from ..index.fusion import FusionConfig

        config = FusionConfig(**(fusion or {}))
        best = (config.dense_weight + config.lexical_weight) / (config.rrf_k + 1)
        return lambda score: min(1.0, max(0.0, float(score) / best)) if best > 0 else 0.0
    raise ValueError("relevance scores need a dense, hybrid or reranked search: a lexical (BM25) score has no "
                     "scale to put in [0, 1]; use mode='dense' or 'hybrid', or rerank=True")


def score_of(hit: dict) -> float:
    """The score a framework sorts by: the reranker's when the search reranked, else the first stage's."""
    return float(hit.get("rerank_score", hit["score"]))
