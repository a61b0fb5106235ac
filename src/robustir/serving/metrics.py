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
