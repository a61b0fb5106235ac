"""The HTTP calls the framework integrations make to ``robustir serve`` (httpx; the server's errors raised with its
own message, which names the field and the fix)."""

from __future__ import annotations

from typing import Any, Literal

import httpx

__all__ = ["RobustirServerError", "search", "upsert", "delete", "Connection"]

Mode = Literal["dense", "lexical", "hybrid"]


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

    def post(self, path: str, body: dict, method: str = "POST") -> dict:
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout) as client:
            return _answer(client.request(method, path, json=body))

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


def search_body(query: str, top_k: int, mode: Mode, filter: dict | None, rerank: bool) -> dict:
    body: dict[str, Any] = {"query": query, "top_k": top_k, "mode": mode}
    if filter:
        body["filter"] = filter
    if rerank:
        body["rerank"] = True
    return body


def search(connection: Connection, query: str, *, top_k: int = 4, mode: Mode = "dense", filter: dict | None = None,
           rerank: bool = False) -> list[dict]:
    """``POST /search`` for one query: its hits, best first (``id``, ``score``, ``title``, ``text``, ``fields``;
    ``rerank_score`` with ``rerank``)."""
    return connection.post("/search", search_body(query, top_k, mode, filter, rerank))["hits"]


def upsert(connection: Connection, documents: list[dict]) -> dict:
    """``POST /documents``: insert or replace (by id) ``documents`` (``_id``, ``title``, ``text``, other fields)."""
    return connection.post("/documents", {"documents": documents})


def delete(connection: Connection, ids: list[str] | None = None, filter: dict | None = None) -> dict:
    """``DELETE /documents`` by ``ids`` or ``filter``."""
    return connection.post("/documents", {"ids": ids} if ids is not None else {"filter": filter}, method="DELETE")


def score_of(hit: dict) -> float:
    """The score a framework sorts by: the reranker's when the search reranked, else the first stage's."""
    return float(hit.get("rerank_score", hit["score"]))
