"""LlamaIndex on ``robustir serve``: :class:`RobustirLlamaRetriever` over ``POST /search``.

    from robustir.integrations.llamaindex import RobustirLlamaRetriever
    retriever = RobustirLlamaRetriever(base_url="http://127.0.0.1:8080", api_key="secret", top_k=5, mode="hybrid")
    nodes = retriever.retrieve("does aspirin protect the heart?")   # NodeWithScore(TextNode(id_, text, metadata))

Each node's metadata holds the document's ``title`` and fields; its score is the reranker's when ``rerank`` is set,
else the first stage's.
"""

from __future__ import annotations

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from .http import Connection, Mode, score_of, search, search_body

__all__ = ["RobustirLlamaRetriever"]


def _node(hit: dict) -> NodeWithScore:
    metadata = {**hit.get("fields", {}), "title": hit.get("title", "")}
    return NodeWithScore(node=TextNode(id_=hit["id"], text=hit["text"], metadata=metadata), score=score_of(hit))


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
