"""LlamaIndex on ``robustir serve``: :class:`RobustirLlamaRetriever` over ``POST /search`` and
:class:`RobustirLlamaVectorStore`, a ``BasePydanticVectorStore`` over ``/search`` and ``/documents``.

    from robustir.integrations.llamaindex import RobustirLlamaRetriever, RobustirLlamaVectorStore
    retriever = RobustirLlamaRetriever(base_url="http://127.0.0.1:8080", api_key="secret", top_k=5, mode="hybrid")
    nodes = retriever.retrieve("does aspirin protect the heart?")   # NodeWithScore(TextNode(id_, text, metadata))

    store = RobustirLlamaVectorStore(base_url="http://127.0.0.1:8080", api_key="secret")
    store.add([TextNode(id_="n1", text="a passage", metadata={"source": "wiki"})])          # POST /documents
    store.query(VectorStoreQuery(query_str="passage", similarity_top_k=3,
                                 filters=MetadataFilters(filters=[MetadataFilter(key="source", value="wiki")])))
    store.delete("doc-1")                            # every node whose ref_doc_id is doc-1
    store.clear()                                    # every document of the served index

Each node's metadata holds the document's fields (and ``title`` when it has one); its score is the reranker's when
``rerank`` is set, else the first stage's. The store keeps a node's text, metadata and ``ref_doc_id`` (a field of
that name); the server embeds (``is_embedding_query`` is False: a query is sent as text, so a ``VectorStoreIndex``
over the store needs no embedding model of its own for queries, and the vectors it computes for inserted nodes are
not used; a query with ``query_embedding`` alone is sent as that vector: ``/search`` by vector, dense).
``MetadataFilters`` map to the server's filter language (:func:`server_filter`).
"""

from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import (BaseNode, MetadataMode, NodeRelationship, NodeWithScore, QueryBundle,
                                     RelatedNodeInfo, TextNode)
from llama_index.core.vector_stores.types import (BasePydanticVectorStore, FilterCondition, FilterOperator,
                                                  MetadataFilter, MetadataFilters, VectorStoreQuery,
                                                  VectorStoreQueryMode, VectorStoreQueryResult)

import numpy as np

from .http import (Connection, Mode, RobustirServerError, _answer, candidates_with_vectors, get_documents,
                   hit_vectors, score_of, search, search_body, search_by_vector, upsert)

__all__ = ["RobustirLlamaRetriever", "RobustirLlamaVectorStore", "server_filter"]

#: the field a node's ``ref_doc_id`` (the document it was cut from) is stored under
REF_DOC_ID = "ref_doc_id"

_OPERATORS = {FilterOperator.EQ: "$eq", FilterOperator.NE: "$ne", FilterOperator.GT: "$gt",
              FilterOperator.GTE: "$gte", FilterOperator.LT: "$lt", FilterOperator.LTE: "$lte",
              FilterOperator.IN: "$in", FilterOperator.NIN: "$nin"}

_MODES: dict[VectorStoreQueryMode, Mode] = {
    VectorStoreQueryMode.DEFAULT: "dense", VectorStoreQueryMode.MMR: "dense", VectorStoreQueryMode.HYBRID: "hybrid",
    VectorStoreQueryMode.SPARSE: "lexical", VectorStoreQueryMode.TEXT_SEARCH: "lexical"}


def server_filter(filters: MetadataFilters | MetadataFilter) -> dict:
    """LlamaIndex ``MetadataFilters`` in the server's filter language (:mod:`robustir.index.store.filters`): ``==``,
    ``!=``, ``>``, ``>=``, ``<``, ``<=``, ``in``, ``nin`` as ``$eq`` ... ``$nin``, ``is_empty`` as missing, null or
    ``""``; conditions ``and`` / ``or`` / ``not`` (none of them matches, as LlamaIndex's own stores read it) as
    ``$and`` / ``$or`` / ``$not`` of ``$or``; nested ``MetadataFilters`` too. ``any``, ``all``, ``contains`` and the
    text matches have no counterpart on the server: a ``ValueError`` naming them."""
    if isinstance(filters, MetadataFilter):
        if filters.operator == FilterOperator.IS_EMPTY:
            return {"$or": [{filters.key: None}, {filters.key: ""}]}
        operator = _OPERATORS.get(filters.operator)
        if operator is None:
            raise ValueError(f"filter on {filters.key!r}: robustir serve has no {filters.operator.value!r} operator; "
                             f"it takes {', '.join(op.value for op in _OPERATORS)} and is_empty")
        return {filters.key: {operator: filters.value}}
    parts = [server_filter(f) for f in filters.filters]
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.NOT:
        return {"$not": {"$or": parts}} if parts else {}
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    return {"$and" if condition == FilterCondition.AND else "$or": parts}


def _all_of(*filters: dict | None) -> dict | None:
    given = [f for f in filters if f]
    return None if not given else given[0] if len(given) == 1 else {"$and": given}


def _node(hit: dict) -> NodeWithScore:
    fields = dict(hit.get("fields", {}))
    ref = fields.pop(REF_DOC_ID, None)
    metadata = {**fields, **({"title": hit["title"]} if hit.get("title") else {})}
    relationships = {NodeRelationship.SOURCE: RelatedNodeInfo(node_id=str(ref))} if ref is not None else {}
    node = TextNode(id_=hit["id"], text=hit["text"], metadata=metadata, relationships=relationships)
    return NodeWithScore(node=node, score=score_of(hit) if "score" in hit else None)


class RobustirLlamaRetriever(BaseRetriever):
    """``POST /search`` as a LlamaIndex retriever (sync and async)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, *, top_k: int = 4,
                 mode: Mode = "dense", filter: dict | None = None, rerank: bool = False, timeout: float = 60.0) -> None:
        super().__init__()
        self.connection = Connection(base_url, api_key, timeout)
        self.top_k, self.mode, self.filter, self.rerank = top_k, mode, filter, rerank

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = search(self.connection, query_bundle.query_str, top_k=self.top_k, mode=self.mode, filter=self.filter,
                      rerank=self.rerank)
        return [_node(hit) for hit in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        answer = await self.connection.apost("/search", search_body(query_bundle.query_str, self.top_k, self.mode,
                                                                    self.filter, self.rerank))
        return [_node(hit) for hit in answer["hits"]]


class RobustirLlamaVectorStore(BasePydanticVectorStore):
    """A served robustir index as a LlamaIndex vector store: ``add`` upserts (in requests under the server's limits),
    ``delete`` removes a ``ref_doc_id``'s nodes, ``delete_nodes`` by ids and/or filters, ``get_nodes`` by ids,
    ``query`` searches by the query's text, or by ``query_embedding`` alone (dense; mmr too), with its filters,
    ``node_ids`` and ``doc_ids`` (mode ``default`` / ``mmr``: dense, ``hybrid`` (``alpha``: the dense list's weight), ``sparse`` / ``text_search``: lexical BM25);
    ``rerank`` reranks every query with the server's reranker."""

    stores_text: bool = True
    is_embedding_query: bool = False
    base_url: str = "http://127.0.0.1:8080"
    api_key: str | None = None
    rerank: bool = False
    timeout: float = 600.0
    _connection: Connection = PrivateAttr()

    def __init__(self, base_url: str = "http://127.0.0.1:8080", api_key: str | None = None, *, rerank: bool = False,
                 timeout: float = 600.0) -> None:
        super().__init__(base_url=base_url, api_key=api_key, rerank=rerank, timeout=timeout)
        self._connection = Connection(base_url, api_key, timeout)

    @property
    def client(self) -> Connection:
        return self._connection

    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        documents = []
        for node in nodes:
            fields = {k: v for k, v in node.metadata.items() if k not in ("_id", "id", "text", REF_DOC_ID)}
            if node.ref_doc_id is not None:
                fields[REF_DOC_ID] = node.ref_doc_id
            documents.append({**fields, "_id": node.node_id, "text": node.get_content(metadata_mode=MetadataMode.NONE)})
        upsert(self._connection, documents)
        return [node.node_id for node in nodes]

    def _delete_matching(self, filter: dict) -> None:
        try:
            self._connection.post("/documents", {"filter": filter}, method="DELETE")
        except RobustirServerError as exc:  # a field no document holds: nothing to delete
            if not (exc.status == 400 and "is in no document" in str(exc.error.get("message", ""))):
                raise

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete every node whose ``ref_doc_id`` is this one."""
        self._delete_matching({REF_DOC_ID: ref_doc_id})

    def delete_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
                     **delete_kwargs: Any) -> None:
        """Delete the nodes with these ids (ids the index does not hold are ignored) that ``filters`` match."""
        if node_ids is None and filters is None:
            raise ValueError("give node_ids and/or filters")
        extra = server_filter(filters) if filters is not None else None
        if node_ids is None:
            self._delete_matching(extra or {})
            return
        most = min(self._connection.limits()["max_inputs_per_request"], 1000)  # the filter's $in list holds 1,000
        for start in range(0, len(node_ids), most):
            self._delete_matching(_all_of({"id": {"$in": list(node_ids[start:start + most])}}, extra))

    def get_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The nodes with these ids (those the index does not hold are left out); ``filters`` alone cannot list
        documents on this server (it has no listing route)."""
        if node_ids is None:
            raise ValueError("robustir serve reads documents by id (GET /documents/{id}); give node_ids")
        nodes = [_node(hit) for hit in get_documents(self._connection, node_ids)]
        if filters is not None:
            from llama_index.core.vector_stores.utils import build_metadata_filter_fn

            by_id = {n.node.node_id: n.node for n in nodes}
            keep = build_metadata_filter_fn(lambda node_id: by_id[node_id].metadata, filters)
            nodes = [n for n in nodes if keep(n.node.node_id)]
        return [n.node for n in nodes]

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """By ``query_str`` (the server embeds it), or by ``query_embedding`` alone (``/search`` with ``vector``:
        dense, the index's dimension; mode default, no rerank)."""
        if not query.query_str and query.query_embedding is None:
            raise ValueError("give query_str (the server embeds it with its own model) or query_embedding")
        mode = _MODES.get(query.mode)
        if mode is None:
            raise ValueError(f"query mode {query.mode.value!r} has no counterpart on robustir serve; use default, "
                             "mmr, hybrid, sparse or text_search")
        filter = _all_of(server_filter(query.filters) if query.filters is not None else None,
                         {"id": {"$in": list(query.node_ids)}} if query.node_ids else None,
                         {REF_DOC_ID: {"$in": list(query.doc_ids)}} if query.doc_ids else None)
        options: dict[str, Any] = {"mode": mode, "filter": filter, "rerank": self.rerank}
        if mode == "hybrid" and query.alpha is not None:
            options["fusion"] = {"dense_weight": query.alpha, "lexical_weight": 1.0 - query.alpha}
        if not query.query_str:
            if query.mode not in (VectorStoreQueryMode.DEFAULT, VectorStoreQueryMode.MMR) or self.rerank:
                raise ValueError(f"a query by query_embedding alone is dense (mode default or mmr, no rerank); mode "
                                 f"{query.mode.value!r}{' with rerank' if self.rerank else ''} needs query_str")
            if query.mode == VectorStoreQueryMode.MMR:
                fetched = search_by_vector(self._connection, query.query_embedding, top_k=_fetch_k(query, kwargs),
                                           filter=filter)
                hits = _mmr(query, fetched, np.asarray(query.query_embedding, dtype=np.float32),
                            hit_vectors(self._connection, fetched) if fetched else None)
            else:
                hits = search_by_vector(self._connection, query.query_embedding, top_k=query.similarity_top_k,
                                        filter=filter)
        elif query.mode == VectorStoreQueryMode.MMR:
            hits = _mmr(query, *candidates_with_vectors(self._connection, query.query_str, _fetch_k(query, kwargs),
                                                        **options))
        else:
            hits = search(self._connection, query.query_str, top_k=query.similarity_top_k, **options)
        nodes = [_node(hit) for hit in hits]
        return VectorStoreQueryResult(nodes=[n.node for n in nodes], similarities=[n.score for n in nodes],
                                      ids=[n.node.node_id for n in nodes])

    def clear(self) -> None:
        """Delete every document of the served index. The server lists no documents and deletes at most
        ``max_inputs_per_request`` by a filter, so this takes the ids of up to that many at a time from a search by
        the zero vector (every document scores 0) and deletes them, until the index is empty; raises
        :class:`~robustir.integrations.http.RobustirServerError` or ``RuntimeError`` (naming how many are left)
        when a round deletes nothing."""
        with self._connection.client() as client:
            info = _answer(client.get("/info"))
            most = min(info["limits"]["max_inputs_per_request"], info["limits"]["max_top_k"])
            zero = [0.0] * int(info["dimension"])
            while True:
                hits = _answer(client.post("/search", json={"vector": zero, "top_k": most}))["hits"]
                if not hits:
                    break
                _answer(client.request("DELETE", "/documents", json={"ids": [h["id"] for h in hits]}))
            left = (_answer(client.get("/info"))["index"] or {}).get("documents", 0)
        if left:
            raise RuntimeError(f"clear: a search no longer finds the {left} documents left in the index (an ANN "
                               "index that does not reach them); delete them with robustir index --delete")

    async def aclear(self) -> None:
        """:meth:`clear`."""
        self.clear()


def _fetch_k(query: VectorStoreQuery, kwargs: dict) -> int:
    """MMR's candidates: ``mmr_prefetch_k``, default 4 x top_k."""
    return int(kwargs.get("mmr_prefetch_k") or 4 * query.similarity_top_k)


def _mmr(query: VectorStoreQuery, hits: list[dict], query_vector: Any, vectors: Any) -> list[dict]:
    """LlamaIndex's own MMR over the candidates ``hits`` and their ``vectors`` (re-embedded through
    ``/v1/embeddings``: the server returns no stored vectors); ``mmr_threshold``: LlamaIndex's lambda."""
    from llama_index.core.indices.query.embedding_utils import get_top_k_mmr_embeddings

    if not hits:
        return []
    _, chosen = get_top_k_mmr_embeddings(np.asarray(query_vector).tolist(), np.asarray(vectors).tolist(),
                                         similarity_top_k=query.similarity_top_k,
                                         embedding_ids=list(range(len(hits))), mmr_threshold=query.mmr_threshold)
    return [hits[i] for i in chosen]
