"""LangChain on ``robustir serve``: :class:`RobustirRetriever` (``/search``) and :class:`RobustirVectorStore`
(``/search`` + ``/documents``). The server embeds, so neither takes an ``Embeddings`` object.

    from robustir.integrations.langchain import RobustirRetriever, RobustirVectorStore
    retriever = RobustirRetriever(base_url="http://127.0.0.1:8080", api_key="secret", top_k=5, mode="hybrid")
    docs = retriever.invoke("does aspirin protect the heart?")        # Document(page_content=text, metadata=...)
    store = RobustirVectorStore(base_url="http://127.0.0.1:8080", api_key="secret")
    store.add_texts(["a new passage"], metadatas=[{"source": "wiki"}], ids=["n1"])   # POST /documents
    store.similarity_search("passage", k=3, filter={"source": "wiki"})

A document's metadata holds its ``id``, ``title``, ``score`` (``rerank_score`` too when reranked) and its fields.
"""

from __future__ import annotations

from typing import Any, Iterable

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from .http import Connection, Mode, delete, score_of, search, search_body, upsert

__all__ = ["RobustirRetriever", "RobustirVectorStore"]


def _document(hit: dict) -> Document:
    metadata = {**hit.get("fields", {}), "id": hit["id"], "title": hit.get("title", ""), "score": hit["score"]}
    if "rerank_score" in hit:
        metadata["rerank_score"] = hit["rerank_score"]
    return Document(page_content=hit["text"], metadata=metadata, id=hit["id"])


class RobustirRetriever(BaseRetriever):
    """``POST /search`` as a LangChain retriever (sync and async)."""

    base_url: str = "http://127.0.0.1:8080"
    api_key: str | None = None
    top_k: int = 4
    mode: Mode = "dense"
    filter: dict | None = None
    rerank: bool = False
    timeout: float = 60.0

    def _connection(self) -> Connection:
        return Connection(self.base_url, self.api_key, self.timeout)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        hits = search(self._connection(), query, top_k=self.top_k, mode=self.mode, filter=self.filter,
                      rerank=self.rerank)
        return [_document(hit) for hit in hits]

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        answer = await self._connection().apost("/search", search_body(query, self.top_k, self.mode, self.filter,
                                                                       self.rerank))
        return [_document(hit) for hit in answer["hits"]]


class RobustirVectorStore(VectorStore):
    """A served robustir index as a LangChain vector store: ``add_texts`` / ``add_documents`` upsert through
    ``POST /documents``, ``delete`` through ``DELETE /documents``, ``similarity_search`` through ``/search`` (the
    server's mode, filter language and reranker)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, *, mode: Mode = "dense",
                 timeout: float = 600.0) -> None:
        self.connection = Connection(base_url, api_key, timeout)
        self.mode = mode

    @property
    def embeddings(self) -> None:  # the server embeds
        return None

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *, ids: list[str] | None = None,
                  **kwargs: Any) -> list[str]:
        """Upsert ``texts`` (with ``metadatas`` as fields and ``ids``; without ids, new uuid4 ids) in one request."""
        import uuid

        texts = list(texts)
        ids = list(ids) if ids is not None else [str(uuid.uuid4()) for _ in texts]
        metadatas = metadatas or [{} for _ in texts]
        if not (len(ids) == len(texts) == len(metadatas)):
            raise ValueError(f"{len(texts)} texts, {len(metadatas)} metadatas and {len(ids)} ids: give one of each per "
                             "text")
        documents = [{**{k: v for k, v in meta.items() if k not in ("_id", "id", "text")}, "_id": doc_id, "text": text}
                     for text, meta, doc_id in zip(texts, metadatas, ids)]
        upsert(self.connection, documents)
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete by ``ids`` (or ``filter=...``); True when the server deleted them."""
        if ids is None and kwargs.get("filter") is None:
            raise ValueError("give ids, or filter= (the /search filter language)")
        delete(self.connection, ids, kwargs.get("filter"))
        return True

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """``filter=`` (the server's filter language), ``mode=``, ``rerank=`` pass through to ``/search``."""
        hits = search(self.connection, query, top_k=k, mode=kwargs.get("mode", self.mode),
                      filter=kwargs.get("filter"), rerank=bool(kwargs.get("rerank", False)))
        return [(_document(hit), score_of(hit)) for hit in hits]

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Any = None, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, **kwargs: Any) -> "RobustirVectorStore":
        """A store on the server at ``base_url=`` with ``texts`` upserted; ``embedding`` is ignored (the server's
        model embeds)."""
        store = cls(**{k: v for k, v in kwargs.items() if k in ("base_url", "api_key", "mode", "timeout")})
        store.add_texts(texts, metadatas, ids=ids)
        return store
