"""The request bodies of ``robustir serve`` as pydantic models.

The models are defined here, at module level, without the server's limits; :func:`request_models` makes each app's
copies (subclasses re-declaring only the bounded fields), so each limit (texts per request, characters per text,
``top_k``) is a ``Field`` constraint with the configured value: pydantic checks it, the app's ``/docs`` shows it
(:mod:`robustir.serving.routes` validates a body with the app's copy), and the error handler of
:mod:`robustir.serving.errors` turns pydantic's errors into OpenAI-shaped 400s naming the field
(``input[3]``, ``fusion.rrf_k``). What pydantic cannot express (the dimensions a model supports, the work of a whole
search, a filter's fields) is checked in the routes.

A text must be a non-blank string that is valid Unicode: JSON may carry a lone surrogate (``"\\ud800"``) that
Python accepts but no tokenizer can read -- it is refused here, so it never reaches a batch shared with other
requests. Token-id arrays (OpenAI accepts them) are refused with their own code: this server takes text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictFloat,
                      StrictInt, StrictStr, ValidationInfo, WithJsonSchema, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from ..index.fusion import FusionConfig

__all__ = ["DeleteRequest", "DocumentsRequest", "EmbeddingRequest", "Limits", "RerankRequest", "SearchRequest",
           "request_models"]


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (:class:`~robustir.serving.config.ServeConfig`'s ``max_*`` fields)."""

    inputs: int
    chars: int
    top_k: int
    rerank_pairs: int = 1000
    """(query, document) pairs the reranker scores for one request: /v1/rerank's documents, /search's queries x
    ``rerank_candidates``"""
    rerank_candidates: int = 100

    @classmethod
    def of(cls, config: Any) -> "Limits":
        """The limits of a :class:`~robustir.serving.config.ServeConfig`."""
        return cls(config.max_inputs_per_request, config.max_chars_per_input, config.max_top_k,
                   config.max_rerank_pairs, config.rerank_candidates)


def _real_text(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("empty_text", "is empty; every input needs some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode", "is not valid Unicode: a lone surrogate {char} at character {position} (send text "
            "encoded as UTF-8; in JSON a \\ud8xx escape must be followed by its \\udcxx pair)",
            {"char": repr(text[exc.start])[1:-1], "position": exc.start}) from None
    return text


def _as_list(value: Any) -> Any:
    """A single string becomes a one-item list; a token-id array (ints, or lists of ints) is refused."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        for i, item in enumerate(value):
            if (isinstance(item, int) and not isinstance(item, bool)) or isinstance(item, list):
                raise PydanticCustomError(
                    "token_ids_not_supported", "is a token-id array; this server takes text only: send the text itself",
                    {"index": i})
    return value


def _as_rows(value: Any) -> Any:
    """One vector (a list of numbers) becomes a one-row list."""
    if isinstance(value, list) and value and not isinstance(value[0], list):
        return [value]
    return value


def _texts(what: str, chars: int | None = None, most: int | None = None) -> Any:
    """A string or a list of at most ``most`` strings of at most ``chars`` characters (None: unbounded, the
    module-level models; an app's limited copies bound both)."""
    item = Annotated[StrictStr, Field(max_length=chars), AfterValidator(_real_text)]
    schema = {"anyOf": [{"type": "string", "minLength": 1, **({"maxLength": chars} if chars else {})},
                        {"type": "array", "items": {"type": "string", "minLength": 1,
                                                    **({"maxLength": chars} if chars else {})},
                         "minItems": 1, **({"maxItems": most} if most else {})}],
              "description": f"{what}: a string or a list of "
                             + (f"at most {most} strings of at most {chars} characters each" if most else "strings")}
    return Annotated[list[item], Field(min_length=1, max_length=most), BeforeValidator(_as_list),
                     WithJsonSchema(schema)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    limits: ClassVar[Limits | None] = None
    """The app's limits on an app's copy (:func:`request_models`), None on the module-level model."""
    model: StrictStr | None = Field(None, description="The served model's name (GET /v1/models); optional.")


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, plus ``input_type``."""

    input: _texts("The texts to embed")  # type: ignore[valid-type]
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (default) or base64: little-endian float32, what the openai client asks for")
    dimensions: StrictInt | None = Field(None, ge=1, description="Cut vectors to this size (a Matryoshka model's "
                                                                 "trained sizes only: GET /info)")
    user: StrictStr | None = Field(None, max_length=256, description="Ignored (OpenAI's end-user id).")
    input_type: Literal["query", "document"] | None = Field(
        None, description="query: the model's query instruction and length apply; default: the server's "
                          "--default-input-type (document unless set)")


def _exactly_one(request: Any, first: str, second: str, code: str, message: str) -> Any:
    """``request`` when exactly one of its fields ``first`` and ``second`` is given, else pydantic's error ``code``."""
    if (getattr(request, first) is None) == (getattr(request, second) is None):
        raise PydanticCustomError(code, message)
    return request


_VECTOR = ("Search by vector instead of query (dense mode): one vector (a list of finite numbers, the index's "
           "dimension: GET /info) or a list of them; scores are inner products")


class SearchRequest(_Request):
    """A search over the served index: by ``query`` (texts), or by ``vector`` (dense mode only)."""

    query: _texts("The queries") | None = None  # type: ignore[valid-type]
    vector: Annotated[list[list[StrictFloat]], Field(min_length=1), BeforeValidator(_as_rows)] | None = Field(
        None, description=_VECTOR)
    top_k: StrictInt = Field(10, ge=1, description="Hits per query.")
    filter: dict[str, Any] | None = Field(None, description='Metadata filter, e.g. {"year": {"$gte": 2020}} '
                                                            '(robustir.index.store.filters)')
    mode: Literal["dense", "lexical", "hybrid"] = Field("dense", description="dense (the model), lexical (BM25) "
                                                                             "or hybrid (both, fused by RRF)")
    fusion: FusionConfig | None = Field(None, description="How hybrid fuses the two lists (only with hybrid).")
    rerank: bool = Field(False, description="Re-score each query's best hits (--rerank-candidates of them) with "
                                            "the reranker (POST /v1/rerank's) and return the top_k of that order")
    _single: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_shape(cls, data: Any, handler: Any) -> Any:
        """A string query is answered with one list of hits, a list of queries with a list of lists."""
        request = handler(data)
        given = data.get("vector") if isinstance(data, dict) else None
        request._single = isinstance(data, dict) and (isinstance(data.get("query"), str) or (
            isinstance(given, list) and bool(given) and not isinstance(given[0], list)))
        return request

    @model_validator(mode="after")
    def _query_or_vector(self) -> "SearchRequest":
        return _exactly_one(self, "query", "vector", "query_or_vector", "give exactly one of 'query' (texts) or "
                            "'vector' (a list of numbers, or a list of such lists)")

    @field_validator("rerank")
    @classmethod
    def _rerank_budget(cls, rerank: bool, info: ValidationInfo) -> bool:
        """Queries x rerank_candidates pairs at most ``rerank_pairs`` (the error names ``rerank``: a field); a
        ``top_k`` deeper than rerank_candidates re-scores ``top_k`` hits a query, so it counts instead."""
        limits = cls.limits
        if not rerank or limits is None:
            return rerank
        queries = len(info.data.get("query") or ())
        depth = max(limits.rerank_candidates, info.data.get("top_k") or 0)
        pairs = queries * depth
        if pairs > limits.rerank_pairs:
            what = ("{depth} rerank candidates" if depth == limits.rerank_candidates else "{depth} hits (top_k)")
            raise PydanticCustomError(
                "too_many_rerank_pairs", "with {queries} queries x " + what + " is {pairs} pairs for the "
                "reranker; at most {most} per request (--max-rerank-pairs): "
                + ("send a top_k of at most {most} with rerank" if depth > limits.rerank_pairs else
                   "send at most {fit} queries per request with rerank"
                   + ("" if depth == limits.rerank_candidates else ", or a smaller top_k")),
                {"queries": queries, "depth": depth, "pairs": pairs, "most": limits.rerank_pairs,
                 "fit": limits.rerank_pairs // depth})
        return rerank

    @property
    def single(self) -> bool:
        return self._single


class RerankRequest(_Request):
    """Infinity's / Cohere's rerank request: the ``documents`` ordered by relevance to ``query``."""

    query: Annotated[StrictStr, AfterValidator(_real_text)] = Field(description="The query.")
    documents: _texts("The documents to order (each one pair for the reranker)")  # type: ignore[valid-type]
    top_n: StrictInt | None = Field(None, ge=1, description="Results returned (default: all documents).")
    return_documents: bool = Field(False, description="Return each document's text with its score.")
    raw_scores: bool = Field(False, description="Infinity's flag; accepted, scores are always the model's own.")


_DOCUMENTS = ('[{"_id": "d1", "title": "...", "text": "...", "any other field": ...}, ...]: each needs an id (_id '
              "or id) and a title or a text; other fields are kept and can be filtered on")


class DocumentsRequest(_Request):
    """Documents to insert or replace (by id) in the served index: ``robustir index`` corpus records."""

    documents: Annotated[list[dict[str, Any]], Field(min_length=1)] = Field(description=_DOCUMENTS)


class DeleteRequest(_Request):
    """Documents to delete: by ``ids``, or all those ``filter`` matches (one of the two)."""

    ids: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    filter: dict[str, Any] | None = Field(None, description="The /search filter language.")

    @model_validator(mode="after")
    def _one_of(self) -> "DeleteRequest":
        return _exactly_one(self, "ids", "filter", "ids_or_filter",
                            "give exactly one of 'ids' (a list) or 'filter' (an object)")


def request_models(limits: Limits) -> dict[str, type[_Request]]:
    """The app's copies of the request models (by their name), with ``limits`` as field constraints, so pydantic
    checks them and ``/docs`` shows them; only the bounded fields are re-declared (the rest is inherited)."""
    n, chars = limits.inputs, limits.chars

    def bounded(base: type[_Request], **fields: Any) -> type[_Request]:
        made = create_model(base.__name__, __base__=base, __module__=__name__, __doc__=base.__doc__, **fields)
        made.limits = limits
        return made

    def bounded_list(kind: Any, field: Any) -> tuple:
        return Annotated[list[kind], Field(min_length=1, max_length=n)], field

    return {model.__name__: model for model in (
        bounded(EmbeddingRequest, input=(_texts("The texts to embed", chars, n), ...)),
        bounded(SearchRequest, query=(_texts("The queries", chars, n) | None, None),
                vector=(Annotated[list[list[StrictFloat]], Field(min_length=1, max_length=n),
                                  BeforeValidator(_as_rows)] | None, Field(None, description=_VECTOR)),
                top_k=(StrictInt, Field(10, ge=1, le=limits.top_k, description="Hits per query."))),
        bounded(RerankRequest, query=(Annotated[StrictStr, Field(max_length=chars), AfterValidator(_real_text)],
                                      Field(description="The query.")),
                documents=(_texts("The documents to order (each one pair for the reranker)", chars,
                                  min(n, limits.rerank_pairs)), ...)),
        bounded(DocumentsRequest, documents=bounded_list(dict[str, Any], Field(description=_DOCUMENTS))),
        bounded(DeleteRequest, ids=(Annotated[list[StrictStr], Field(min_length=1, max_length=n)] | None, None)))}
