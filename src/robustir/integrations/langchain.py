"""LangChain on ``robustir serve``: :class:`RobustirRetriever` (``/search``) and :class:`RobustirVectorStore`
(``/search`` + ``/documents`` + ``/v1/embeddings``). The server embeds, so neither takes an ``Embeddings`` object.

    from robustir.integrations.langchain import RobustirRetriever, RobustirVectorStore
    retriever = RobustirRetriever(base_url="http://127.0.0.1:8080", api_key="secret", top_k=5, mode="hybrid")
    docs = retriever.invoke("does aspirin protect the heart?")        # Document(page_content=text, metadata=...)
    store = RobustirVectorStore(base_url="http://127.0.0.1:8080", api_key="secret")
    store.add_texts(["a new passage"], metadatas=[{"source": "wiki"}], ids=["n1"])   # POST /documents
    store.similarity_search("passage", k=3, filter={"source": "wiki"})
    store.similarity_search_with_relevance_scores("passage", k=3, score_threshold=0.5)
    store.max_marginal_relevance_search("passage", k=3, fetch_k=20, lambda_mult=0.5)
    store.as_retriever(search_type="mmr")                 # or "similarity_score_threshold"
    store.get_by_ids(["n1"])

A document's metadata holds its ``id``, ``title``, ``score`` (``rerank_score`` too when reranked) and its fields.
Writes go in as many requests as the server's limits ask (:mod:`robustir.integrations.http`); a document without
an id gets a new uuid4 (ids on only some documents are fine). Relevance scores in [0, 1]: a dense search's cosine
(clipped at 0), a reranked search's cross-encoder score, a hybrid search's RRF score over its best possible; a
lexical search has none (BM25 has no scale). The server returns no stored vectors, so maximal marginal relevance
re-embeds its ``fetch_k`` candidates through ``/v1/embeddings``; the ``*_by_vector`` searches send the vector
(``/search`` with ``vector``: dense, the index's dimension; ``filter=`` only).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore
from langchain_core.vectorstores.utils import maximal_marginal_relevance

from .http import (Connection, Mode, candidates_with_vectors, delete, document_ids, get_documents, hit_vectors,
                   relevance_fn, score_of, search, search_body, search_by_vector, upsert)

__all__ = ["RobustirRetriever", "RobustirVectorStore"]

#: keyword arguments of a search that go to ``POST /search``
_SEARCH_OPTIONS = ("mode", "filter", "rerank", "fusion")



def _vector_options(kwargs: dict) -> dict | None:
    """The filter of a search by vector (the only option it takes: it is dense, with no query text to rerank)."""
    unknown = set(kwargs) - {"filter"}
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)} for a search by vector: it takes filter= only (dense, "
                        "no query text for rerank or lexical)")
    return kwargs.get("filter")


def _document(hit: dict) -> Document:
    metadata = {**hit.get("fields", {}), "id": hit["id"], "title": hit.get("title", "")}
    if "score" in hit:
        metadata["score"] = hit["score"]
    if "rerank_score" in hit:
        metadata["rerank_score"] = hit["rerank_score"]
    return Document(page_content=hit["text"], metadata=metadata, id=hit["id"])


def _relevant(hits: list[dict], relevance: Callable[[float], float], threshold: float | None) -> list[dict]:
    """``hits`` whose relevance is at least ``threshold`` (all when None)."""
    return hits if threshold is None else [hit for hit in hits if relevance(score_of(hit)) >= threshold]


class RobustirRetriever(BaseRetriever):
    """``POST /search`` as a LangChain retriever (sync and async); ``score_threshold`` keeps the hits whose relevance
    (in [0, 1], as :meth:`RobustirVectorStore.similarity_search_with_relevance_scores` gives it) reaches it."""

    base_url: str = "http://127.0.0.1:8080"
    api_key: str | None = None
    top_k: int = 4
    mode: Mode = "dense"
    filter: dict | None = None
    rerank: bool = False
    fusion: dict | None = None
    score_threshold: float | None = None
    timeout: float = 60.0

    def _connection(self) -> Connection:
        return Connection(self.base_url, self.api_key, self.timeout)

    def _kept(self, hits: list[dict]) -> list[Document]:
        relevance = relevance_fn(self.mode, self.rerank, self.fusion) if self.score_threshold is not None else None
        return [_document(hit) for hit in _relevant(hits, relevance, self.score_threshold)]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self._kept(search(self._connection(), query, top_k=self.top_k, mode=self.mode, filter=self.filter,
                                 rerank=self.rerank, fusion=self.fusion))

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        answer = await self._connection().apost("/search", search_body(query, self.top_k, self.mode, self.filter,
                                                                       self.rerank, self.fusion))
        return self._kept(answer["hits"])


class RobustirVectorStore(VectorStore):
    """A served robustir index as a LangChain vector store: ``add_texts`` / ``add_documents`` upsert through
    ``POST /documents``, ``delete`` through ``DELETE /documents``, ``get_by_ids`` through ``GET /documents/{id}``,
    the searches through ``/search`` (the server's mode, filter language, fusion and reranker: each search takes
    ``mode=``, ``filter=``, ``rerank=``, ``fusion=``; the store's ``mode`` is the default)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, *, mode: Mode = "dense",
                 timeout: float = 600.0) -> None:
        self.connection = Connection(base_url, api_key, timeout)
        self.mode = mode

    @property
    def embeddings(self) -> None:  # the server embeds
        return None

    # -- writes

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: Sequence[str | None] | None = None, **kwargs: Any) -> list[str]:
        """Upsert ``texts`` (``metadatas`` become fields; a ``title`` in them is the document's title) under ``ids``
        (None, or None for a text: a new uuid4), in as many requests as the server's limits ask."""
        texts = list(texts)
        ids = document_ids(ids, len(texts))
        metadatas = metadatas or [{} for _ in texts]
        if len(metadatas) != len(texts):
            raise ValueError(f"{len(texts)} texts and {len(metadatas)} metadatas: give one metadata per text")
        documents = [{**{k: v for k, v in (meta or {}).items() if k not in ("_id", "id", "text", "score",
                                                                            "rerank_score")},
                      "_id": doc_id, "text": text}
                     for text, meta, doc_id in zip(texts, metadatas, ids)]
        upsert(self.connection, documents)
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Delete by ``ids`` (an id not in the index fails, nothing of its request deleted) or ``filter=...``; True
        when the server deleted them."""
        if ids is None and kwargs.get("filter") is None:
            raise ValueError("give ids, or filter= (the /search filter language)")
        delete(self.connection, ids, kwargs.get("filter"))
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The documents with these ids, in the order asked; ids the index does not hold are left out."""
        return [_document(hit) for hit in get_documents(self.connection, ids)]

    # -- searches

    def _options(self, kwargs: dict) -> dict:
        unknown = set(kwargs) - set(_SEARCH_OPTIONS) - {"score_threshold"}
        if unknown:
            raise TypeError(f"unknown search option(s) {sorted(unknown)}; robustir serve's searches take "
                            f"{', '.join(_SEARCH_OPTIONS)} (and score_threshold)")
        options = {key: kwargs[key] for key in _SEARCH_OPTIONS if kwargs.get(key) is not None}
        options.setdefault("mode", self.mode)
        options["rerank"] = bool(options.get("rerank", False))
        return options

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """The server's own scores: cosine (dense), BM25 (lexical), RRF (hybrid), the reranker's (``rerank=True``);
        ``score_threshold=`` keeps the hits whose relevance (in [0, 1]) reaches it."""
        options = self._options(kwargs)
        threshold = kwargs.get("score_threshold")
        relevance = relevance_fn(options["mode"], options["rerank"], options.get("fusion")) \
            if threshold is not None else None
        hits = _relevant(search(self.connection, query, top_k=k, **options), relevance, threshold)
        return [(_document(hit), score_of(hit)) for hit in hits]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        """For the store's own ``mode`` (a search given ``mode=`` / ``rerank=`` / ``fusion=`` uses its own)."""
        return relevance_fn(self.mode)

    def _similarity_search_with_relevance_scores(self, query: str, k: int = 4,
                                                 **kwargs: Any) -> list[tuple[Document, float]]:
        options = self._options(kwargs)
        relevance = relevance_fn(options["mode"], options["rerank"], options.get("fusion"))  # before any request
        return [(_document(hit), relevance(score_of(hit)))
                for hit in search(self.connection, query, top_k=k, **options)]

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      **kwargs: Any) -> list[Document]:
        """Maximal marginal relevance (LangChain's own) over the query's ``fetch_k`` best hits, whose vectors come
        from ``/v1/embeddings`` (the server returns no stored vectors); ``score_threshold=`` drops the candidates
        below it first."""
        options = self._options(kwargs)
        threshold = kwargs.get("score_threshold")
        hits, query_vector, vectors = candidates_with_vectors(self.connection, query, max(fetch_k, k), **options)
        if threshold is not None:
            relevance = relevance_fn(options["mode"], options["rerank"], options.get("fusion"))
            keep = [i for i, hit in enumerate(hits) if relevance(score_of(hit)) >= threshold]
            hits, vectors = [hits[i] for i in keep], vectors[keep]
        if not hits:
            return []
        chosen = maximal_marginal_relevance(query_vector, list(vectors), lambda_mult=lambda_mult, k=k)
        return [_document(hits[i]) for i in chosen]

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        """Dense search by ``embedding`` (the index's dimension: the server's model's); ``filter=`` applies."""
        return [_document(hit) for hit in search_by_vector(self.connection, embedding, top_k=k,
                                                            filter=_vector_options(kwargs))]

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20,
                                                lambda_mult: float = 0.5, **kwargs: Any) -> list[Document]:
        """Maximal marginal relevance over ``embedding``'s ``fetch_k`` best hits (their vectors re-embedded through
        ``/v1/embeddings``); ``filter=`` applies."""
        hits = search_by_vector(self.connection, embedding, top_k=max(fetch_k, k), filter=_vector_options(kwargs))
        if not hits:
            return []
        chosen = maximal_marginal_relevance(np.asarray(embedding, dtype=np.float32), list(hit_vectors(
            self.connection, hits)), lambda_mult=lambda_mult, k=k)
        return [_document(hits[i]) for i in chosen]

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Any = None, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, **kwargs: Any) -> "RobustirVectorStore":
        """A store on the server at ``base_url=`` with ``texts`` upserted; ``embedding`` is ignored (the server's
        model embeds)."""
        store = cls(**{k: v for k, v in kwargs.items() if k in ("base_url", "api_key", "mode", "timeout")})
        store.add_texts(texts, metadatas, ids=ids)
        return store
