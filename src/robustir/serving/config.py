"""The settings of ``robustir serve`` (kept apart from the app so that ``robustir --help`` does not import FastAPI)."""

from __future__ import annotations

from typing import Annotated, Literal

import re

from ..errors import ConfigError
from ..precision import Precision
from ..validation import config_dataclass, Items, ModelName, NonNegativeFloat, PositiveFloat, PositiveInt, Range

__all__ = ["ServeConfig", "DEFAULT_PORT"]

#: ``robustir serve``'s port. Not 8000: that is vLLM's, the LLM endpoint ``robustir generate`` talks to by default.
DEFAULT_PORT = 8080


#: what a browser's Origin header holds: scheme://host[:port] (the host a name, an IPv4 or a bracketed IPv6 address)
_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?")


@config_dataclass
class ServeConfig:
    """How ``robustir serve`` serves: where it listens, who may call it, how it batches and what it accepts."""

    host: str = "127.0.0.1"
    """Address to listen on; 127.0.0.1 = this machine only (0.0.0.0 exposes it)"""
    port: Annotated[int, Range(ge=0, le=65535)] = DEFAULT_PORT
    """TCP port."""
    api_key: str | None = None
    """Required as "Authorization: Bearer KEY" when set (or env ROBUSTIR_API_KEY); it may read and write"""
    read_api_key: str | None = None
    """A key that may only read: search, embeddings, rerank, models, info, GET /documents (or env
    ROBUSTIR_READ_API_KEY); POST/DELETE /documents answer it 403. With it alone the server takes no writes"""
    served_model_name: str | None = None
    """The model name clients send; default: the model folder's name."""
    default_input_type: Literal["document", "query"] = "document"
    """What an input without input_type is embedded as (LangChain and LlamaIndex send none)"""
    device: str = "auto"
    """Where the model runs: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    index_refresh_s: NonNegativeFloat = 0.0
    """How stale a search may be, in seconds: 0 (default) checks for a writer's commits on every query; on an S3 index
    each check is a few requests (docs/scale.md: ~7 per query against a local endpoint), so a replica under load can
    check at most this often instead."""
    max_batch_size: PositiveInt = 64
    """Texts batched together at most."""
    max_wait_ms: NonNegativeFloat = 0.0
    """Extra wait for a batch to fill when a worker is free (0: none; under load batches fill while workers are busy)"""
    workers: PositiveInt | None = None
    """Batches encoded at once; default: 1 on a GPU; CPU: 1 in fp32, one per CPU in bf16."""
    encode_batch_size: PositiveInt | None = None
    """Texts per forward pass (length-sorted); default: 16 CPU, batch GPU."""
    ingest_batch_size: PositiveInt | None = None
    """Documents of an HTTP upsert encoded per micro-batch; default: encode_batch_size. On a CPU with one model
    worker they run on a lane of their own beside the searches' and embeddings' batches; else they take turns with
    them, so a search during an upsert waits at most for one of them"""
    max_inputs_per_request: PositiveInt = 2048
    """Texts in one request (embeddings input or search queries)"""
    max_chars_per_input: PositiveInt = 32768
    """Characters of one text."""
    max_body_bytes: PositiveInt = 16 << 20
    """Request body size (larger: 413)"""
    max_top_k: PositiveInt = 1000
    """Largest top_k a search may ask for."""
    max_hits_per_request: PositiveInt = 20000
    """Queries x top_k of one search request (more: 413)"""
    max_response_bytes: PositiveInt = 64 << 20
    """Size of one search answer (more: 413; ask fewer queries or a smaller top_k)"""
    max_queued_texts: PositiveInt = 4096
    """Texts waiting for the models (a rerank's query-document pairs count as texts); a request that would go over
    gets 429 with Retry-After"""
    request_timeout_s: PositiveFloat = 60.0
    """Longest one micro-batch of a request (max_batch_size texts) may wait in the queue for a model worker, then 503
    with Retry-After; time spent encoding does not count, so a large request on an idle server always finishes"""
    receive_timeout_s: PositiveFloat = 30.0
    """Longest a connection may take to send a whole request (headers and body), from when it opens or starts the
    request; an idle connection, a slow-header or a slow-body client is closed then. Between requests uvicorn's own
    keep-alive timeout (5 s) applies."""
    max_connections: PositiveInt | None = None
    """Open connections at most (more: the longest-idle ones are closed, or the new one if none is idle); default:
    the process's open-file limit (raised to its hard limit) less 256 spare."""
    pad_to_multiple_of: PositiveInt = 16
    """Each forward pass pads its texts to a multiple of this many tokens: a bounded set of input shapes keeps the
    native kernel caches and the heap from growing with every new size (measured, bf16: flat instead of +440 MB per
    1,200 batches); 1: pad to the longest text only."""
    cors_allow_origin: Items[str] | None = None
    """Origins a browser may call from (comma-separated, or * for any); default: no CORS headers"""
    matryoshka_dims: list[int] | None = None
    """Dimensions the model was trained to be cut to (enables "dimensions")"""
    rerank_model: ModelName | None = None
    """A cross-encoder (a ...ForSequenceClassification model with one label: its relevance score) for POST /v1/rerank
    and /search with rerank: true: a folder saved by any sentence-transformers (3 to 6) or save_pretrained, a Hugging
    Face cache folder, or a cached hub id; /v1/models lists it by its name; its work shares the embeddings' queue and
    limits; default: rerank by the served embedding model's cosine"""
    rerank_candidates: PositiveInt = 100
    """Hits per query /search re-scores when it reranks (the top_k returned are the best of these); each is one
    (query, document) pair for the reranker: time per query ~ this / the reranker's pairs per second"""
    max_rerank_pairs: PositiveInt = 1000
    """(query, document) pairs one request may have the reranker score: /v1/rerank's documents, /search's queries x
    rerank_candidates (x top_k when larger; more: 400 naming both); bounds a request's rerank time to this / the reranker's pairs per
    second"""

    def validate(self) -> "ServeConfig":
        if self.rerank_candidates > self.max_rerank_pairs:
            raise ConfigError(f"rerank_candidates {self.rerank_candidates} is over max_rerank_pairs "
                              f"{self.max_rerank_pairs}: no /search with rerank could run. Fix: lower "
                              "--rerank-candidates or raise --max-rerank-pairs")
        for dim in self.matryoshka_dims or []:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ConfigError(f"matryoshka_dims: {dim!r} is not a dimension (an integer >= 1)")
        for name, key in (("api_key", self.api_key), ("read_api_key", self.read_api_key)):
            flag = "--" + name.replace("_", "-")
            if key is not None and not key.strip():
                raise ConfigError(f"{name} is empty (was it given as {flag} \"$KEY\" with KEY unset?): every request "
                                  f"would be refused. Fix: set the key, or leave {flag} out")
            if key is not None and key != key.strip():
                raise ConfigError(f"{name} starts or ends with whitespace; clients would have to send it too. Fix: "
                                  "strip it")
        if self.api_key is not None and self.api_key == self.read_api_key:
            raise ConfigError("read_api_key is the same as api_key, so it could write too. Fix: give the read-only "
                              "key a value of its own")
        for origin in self.cors_allow_origin or []:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                # a browser sends exactly scheme://host[:port]: a path, a trailing slash or a wildcard never matches
                raise ConfigError(f"cors_allow_origin: {origin!r} is not an origin a browser sends, so it would never "
                                  "match; write it as scheme://host[:port] with no path, trailing slash or wildcard "
                                  "(e.g. http://localhost:3000), or * for any")
        return self

    def resolved_api_key(self, environ: dict | None = None) -> str | None:
        """The key requests must carry: ``api_key``, else the environment's ``ROBUSTIR_API_KEY``; an empty or blank
        ``ROBUSTIR_API_KEY`` is an error (a server that would refuse everyone), not "no key"."""
        return _resolved(self.api_key, "ROBUSTIR_API_KEY", environ)

    def resolved_read_api_key(self, environ: dict | None = None) -> str | None:
        """The read-only key: ``read_api_key``, else the environment's ``ROBUSTIR_READ_API_KEY`` (checked the same
        way); never the same as the read-write key."""
        key = _resolved(self.read_api_key, "ROBUSTIR_READ_API_KEY", environ)
        if key is not None and key == self.resolved_api_key(environ):
            raise ConfigError("the read-only key is the same as the read-write key (--api-key / ROBUSTIR_API_KEY), so "
                              "it could write too. Fix: give the read-only key a value of its own")
        return key


def _resolved(given: str | None, variable: str, environ: dict | None) -> str | None:
    import os

    if given is not None:
        return given
    env = (environ if environ is not None else os.environ).get(variable)
    if env is None:
        return None
    if not env.strip() or env != env.strip():
        raise ConfigError(f"{variable} is set but empty or padded with whitespace. Fix: export the key itself, "
                          f"or unset {variable}")
    return env
