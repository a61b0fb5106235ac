"""``GET /metrics`` of ``robustir serve``: Prometheus metrics.

HTTP metrics (requests by route, method and status; latency histograms; requests in progress) come from
``prometheus-fastapi-instrumentator``; the model's own are added here: batch sizes and times, how long requests
waited for a worker, texts and tokens embedded, texts waiting, requests refused (by reason).

Each app has its own :class:`prometheus_client.CollectorRegistry`, so several apps in one process (tests, notebooks)
never collide on metric names.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ServerMetrics"]


class _UntypedFields:
    """A collector: the served index's fields without their typed column, read when /metrics is scraped."""

    def __init__(self, untyped: Callable[[], dict[str, str]]) -> None:
        self.untyped = untyped

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("robustir_index_untyped_fields", "Fields of the index that lost their typed "
                                   "column (filters read the JSON column, slower)", labels=["field", "kind"])
        try:
            fields = self.untyped()
        except Exception:  # noqa: BLE001 - an index that cannot be read is /health's to report, not the scrape's
            fields = {}
        for name, kind in sorted(fields.items()):
            family.add_metric([name, kind], 1)
        yield family

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """The registry and the model-side metrics of one app."""

    def __init__(self, queued: Callable[[], float], workers: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batch_texts = Histogram("robustir_batch_texts", "Texts (or rerank pairs) per model batch",
                                     buckets=_BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("robustir_batch_seconds", "Seconds a model batch ran", buckets=_SECONDS,
                                       registry=r)
        self.queue_seconds = Histogram("robustir_queue_seconds", "Seconds a request waited for a model worker",
                                       buckets=_SECONDS, registry=r)
        self.texts = Counter("robustir_embedded_texts", "Texts embedded", ["input_type"], registry=r)
        self.tokens = Counter("robustir_embedded_tokens", "Tokens the model read (after truncation)", registry=r)
        self.rejected = Counter("robustir_rejected_requests", "Requests refused", ["reason"], registry=r)
        self.queued = Gauge("robustir_queued_texts", "Texts (and rerank pairs) waiting for a model worker",
                            registry=r)
        self.queued.set_function(queued)
        Gauge("robustir_model_workers", "Model worker threads", registry=r).set(workers)
        # per route, what it did (the instrumentator's HTTP metrics count requests, not queries, documents or pairs)
        self.search_seconds = Histogram("robustir_search_seconds", "Seconds a /search took, by mode", ["mode"],
                                        buckets=_SECONDS, registry=r)
        self.search_queries = Counter("robustir_search_queries", "Queries searched, by mode and by what (text or "
                                      "vector)", ["mode", "by"], registry=r)
        self.ingest_seconds = Histogram("robustir_ingest_seconds", "Seconds an HTTP write of /documents took",
                                        ["action"], buckets=_SECONDS, registry=r)
        self.ingest_documents = Counter("robustir_ingest_documents", "Documents upserted or deleted over HTTP",
                                        ["action"], registry=r)
        self.rerank_seconds = Histogram("robustir_rerank_seconds", "Seconds a rerank took (/v1/rerank, or one "
                                        "query of /search with rerank)", buckets=_SECONDS, registry=r)
        self.rerank_pairs = Counter("robustir_rerank_pairs", "(query, document) pairs reranked", registry=r)

    def searched(self, mode: str, by: str, queries: int, seconds: float) -> None:
        self.search_seconds.labels(mode=mode).observe(seconds)
        self.search_queries.labels(mode=mode, by=by).inc(queries)

    def ingested(self, action: str, documents: int, seconds: float) -> None:
        self.ingest_seconds.labels(action=action).observe(seconds)
        self.ingest_documents.labels(action=action).inc(documents)

    def reranked(self, pairs: int, seconds: float) -> None:
        self.rerank_seconds.observe(seconds)
        self.rerank_pairs.inc(pairs)

    def watch_index(self, untyped: Callable[[], dict[str, str]]) -> None:
        """``robustir_index_untyped_fields{field, kind}`` = 1 for each field of the served index that lost its typed
        column (``untyped()``: :attr:`robustir.index.store.SearchIndex.untyped_fields`, read at scrape time): its
        filters read the JSON column, slower; the index logs a warning when it happens."""
        self.registry.register(_UntypedFields(untyped))

    def on_batch(self, texts: int, requests: int, seconds: float, waits: Sequence[float]) -> None:
        self.batch_texts.observe(texts)
        self.batch_seconds.observe(seconds)
        for wait in waits:
            self.queue_seconds.observe(wait)

    def embedded(self, kind: str, texts: int, tokens: int) -> None:
        self.texts.labels(input_type=kind).inc(texts)
        self.tokens.inc(tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def instrument(self, app: Any) -> None:
        """HTTP metrics for every route and ``GET /metrics`` on ``app`` (no API key: like ``/health`` it says
        nothing about the data)."""
        from prometheus_fastapi_instrumentator import Instrumentator

        Instrumentator(registry=self.registry, excluded_handlers=["/metrics"], should_group_untemplated=True
                       ).instrument(app).expose(app, endpoint="/metrics", include_in_schema=False)
