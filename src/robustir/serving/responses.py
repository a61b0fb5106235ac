"""The answers of ``robustir serve`` as pydantic models: what ``/openapi.json`` and ``/docs`` show for each route
(``response_model=``). The routes still write their JSON themselves (a ``Response``, which FastAPI passes through
unvalidated: a 2,048-vector answer is not re-serialised), so these models describe the answers and cost nothing per
request; tests/test_server.py checks that real answers validate against them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["EmbeddingList", "SearchAnswer", "RerankAnswer", "ModelList", "ModelCard", "Upserted", "Deleted",
           "DocumentAnswer", "InfoAnswer", "HealthAnswer", "ROUTE_MODELS"]


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens the model read (instruction and special tokens included)")
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The vector, or base64 little-endian float32 "
                                                     "(encoding_format base64)")


class EmbeddingList(BaseModel):
    """OpenAI's embeddings answer."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Hit(BaseModel):
    id: str
    score: float = Field(description="Dense: inner product (cosine for a normalising model); lexical: BM25; hybrid: "
                                     "the fused RRF score")
    title: str
    text: str
    fields: dict[str, Any] = Field(description="The document's other fields (its metadata)")
    rerank_score: float | None = Field(None, description="With rerank: the reranker's score (hits in its order)")


class SearchAnswer(BaseModel):
    """One list of hits for a string query (or one vector), a list of lists for a list of them."""

    hits: list[Hit] | list[list[Hit]]


class RerankResult(BaseModel):
    relevance_score: float
    index: int = Field(description="The document's position in the request")
    document: str | None = Field(None, description="With return_documents")


class RerankAnswer(BaseModel):
    """Infinity's / Cohere's rerank answer: results best first."""

    object: Literal["rerank"] = "rerank"
    results: list[RerankResult]
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Upserted(BaseModel):
    object: Literal["documents"] = "documents"
    upserted: int = Field(description="Documents inserted or replaced")
    documents: int = Field(description="Documents in the index afterwards")


class Deleted(BaseModel):
    object: Literal["documents"] = "documents"
    deleted: int
    documents: int = Field(description="Documents in the index afterwards")


class DocumentAnswer(BaseModel):
    id: str
    title: str
    text: str
    fields: dict[str, Any]


class InfoAnswer(BaseModel):
    """The model, its settings, the index and the limits."""

    version: str
    model: str
    dimension: int
    dimensions: list[int] = Field(description="Sizes 'dimensions' may ask for")
    pooling: str
    normalized: bool
    max_tokens: dict[str, int]
    instructions: dict[str, str | None]
    default_input_type: str
    device: str
    precision: str
    index: dict[str, Any] | None
    limits: dict[str, Any]


class HealthAnswer(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    dimension: int
    device: str
    precision: str
    workers: int
    torch_threads: int
    queued_texts: int
    index: dict[str, Any] | None
    batching: dict[str, Any]


#: the answer model of each route, by ``"METHOD path"``
ROUTE_MODELS: dict[str, type[BaseModel]] = {
    "POST /v1/embeddings": EmbeddingList, "POST /search": SearchAnswer, "POST /v1/rerank": RerankAnswer,
    "GET /v1/models": ModelList, "GET /v1/models/{model_id}": ModelCard, "POST /documents": Upserted,
    "DELETE /documents": Deleted, "GET /documents/{document_id}": DocumentAnswer, "GET /info": InfoAnswer,
    "GET /health": HealthAnswer}
