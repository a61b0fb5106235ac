"""The engine behind the routes (:class:`Server`, ``app.state.server``): the model and its batcher, the reranker,
the index, the tokenizers, the limits, and how model and index work is sized and scheduled."""

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fastapi import Request

from .batcher import EncodeFailed, MicroBatcher, Overloaded
from .config import ServeConfig

from .errors import ApiError

logger = logging.getLogger(__name__)


#: characters of one request tokenized on the event loop (MiniLM's fast tokenizer: 2.9-4.1 ms median for 16,384
#: characters on the 2-core dev box); longer requests go to the tokenizer thread
INLINE_TOKENIZE_CHARS = 16384


@dataclass
class Server:
    """What the routes need: the model, the index, the batcher, the limits (``app.state.server``)."""

    config: ServeConfig
    encoder: Any
    index: Any
    name: str
    aliases: set[str]
    dim: int
    allowed_dims: list[int]
    api_key: str | None  # reads and writes
    batcher: MicroBatcher
    metrics: Any
    device: str
    precision: str
    workers: int
    encode_batch: int
    created: int = field(default_factory=lambda: int(time.time()))
    _loop_tokenizer: Any = None
    _pool: Any = None  # one thread, its own tokenizer: long requests are tokenized off the event loop
    _pool_tokenizer: Any = None
    reranker: Any = None  # a cross-encoder (robustir.models.cross_encoder.CrossEncoder) for /v1/rerank, or None
    reranker_name: str | None = None
    read_key: str | None = None  # reads only (--read-api-key): POST/DELETE /documents answer it 403
    write_lock: Any = field(default_factory=asyncio.Lock)  # HTTP writes of this server, one at a time
    _search_pool: Any = None  # index work that needs no model: its own threads (Server.searching)
    _write_pool: Any = None  # one thread: an HTTP upsert's job (its encoding goes through the batcher: Server.upsert)
    _write_tokenizer: Any = None  # that thread's own tokenizer

    async def rerank_scores(self, query: str, documents: list[str], request: Request | None = None) -> np.ndarray:
        """Relevance of each document to ``query``: the cross-encoder's score (``--rerank-model``), else the served
        embedding model's cosine (query and documents embedded as /v1/embeddings does). Either way the work goes
        through the batcher's queue (:meth:`model_work`): its limits, 429/503 and a client's disconnect hold for it,
        and it takes turns with the embeddings micro-batch by micro-batch."""
        if not documents:
            return np.zeros(0, dtype=np.float32)
        started = time.perf_counter()
        if self.reranker is not None:
            pairs = [(query, document) for document in documents]
            scores = (await self.model_work(RERANK, pairs, request)).vectors.astype(np.float32)
        else:
            ids = await self.tokenize([query], "query", "query") + await self.tokenize(documents, "passage",
                                                                                      "documents")
            vectors = (await self.embed(ids, request)).vectors.astype(np.float32)
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            scores = vectors[1:] @ vectors[0]
        self.metrics.reranked(len(documents), time.perf_counter() - started)
        return scores

    def check_model(self, value: str | None, *also: str | None) -> None:
        """404 unless ``value`` names the served model (or one of ``also``: the reranker's names, where it may)."""
        if value is not None and value not in self.aliases and value not in also:
            other = f" and the reranker '{also[0]}'" if also and also[0] else ""
            raise ApiError(404, f"the model '{value}' does not exist on this server; it serves '{self.name}'{other} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def model_names(self) -> list[str]:
        """What GET /v1/models lists: the embedding model, then the reranker (``--rerank-model``) if there is one."""
        return [self.name] + ([self.reranker_name] if self.reranker_name not in (None, self.name) else [])

    def describe(self) -> str:
        """The model workers as they run: "1 model worker x 2 torch threads, fp32 on cpu"."""
        threads = torch.get_num_threads() if self.device.startswith("cpu") else None
        return (f"{self.workers} model worker{'s' if self.workers != 1 else ''}"
                + (f" x {threads} torch thread{'s' if threads != 1 else ''}" if threads else "")
                + f", {self.precision} on {self.device}")

    async def tokenize(self, texts: list[str], kind: str, param: str) -> list[list[int]]:
        """This request's token ids (``kind``: ``query`` or ``passage``); a tokenizer failure is this request's 400."""
        try:
            if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
                return self.encoder.token_ids(texts, kind, tokenizer=self._loop_tokenizer)
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
                self.encoder.token_ids, texts, kind, tokenizer=self._pool_tokenizer))
        except Exception as exc:
            raise ApiError(400, f"'{param}' could not be tokenized ({type(exc).__name__}: {exc})", param=param) from None

    async def embed(self, ids: list[list[int]], request: Request | None = None) -> Any:
        """The vectors of ``ids`` from the batcher (micro-batches of ``--max-batch-size``, interleaved with other
        requests). With ``request``, a client that disconnects cancels what has not started."""
        return await self.model_work(MicroBatcher.EMBED, ids, request)

    async def model_work(self, kind: str, rows: list, request: Request | None = None) -> Any:
        """Model ``kind``'s results for ``rows`` from the batcher -- every model's work comes here, so each gets the
        same answers: 429 when the queue is full, 503 when a micro-batch waited too long, 500 when the model fails on
        this request, 499 (and its queued work dropped) when the client disconnects."""
        noun = "pair" if kind == RERANK else "text"
        try:
            work = self.batcher.submit(kind, rows, timeout=self.config.request_timeout_s)
            return await (work if request is None else _unless_client_leaves(request, work, self.metrics))
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        except asyncio.TimeoutError:
            self.metrics.reject("timeout")
            retry = self.batcher.retry_after(self.batcher.queued)
            raise ApiError(503, f"part of this request waited {self.config.request_timeout_s:g} s in the queue "
                           "without reaching a model worker (time spent encoding does not count), so it was "
                           f"dropped: the server is overloaded; retry in {retry} s, send smaller requests, or raise "
                           "--request-timeout-s", kind="server_error", code="timeout",
                           headers={"Retry-After": str(retry)}) from None
        except EncodeFailed as exc:
            what = "the reranker" if kind == RERANK else "the model"
            raise ApiError(500, str(exc).replace("the model", what, 1), kind="server_error",
                           code="internal_error") from None
        except ClientGone:  # nobody reads this answer; 499 is what proxies log for it
            raise ApiError(499, f"the client disconnected before the answer was ready; its queued {noun}s were "
                           "dropped", code="client_closed_request") from None

    def _overloaded(self, exc: Overloaded) -> ApiError:
        self.metrics.reject("overloaded")
        return ApiError(429, f"{exc} (or raise --max-queued-texts)", kind="rate_limit_error", code="overloaded",
                        headers={"Retry-After": str(exc.retry_after)})

    async def upsert(self, documents: list[dict]) -> Any:
        """Upsert ``documents`` into the index (:func:`robustir.index.store.spool.upsert_documents`: one ``--upsert``
        job, answered once committed). The job runs on the write thread; its documents are encoded through the
        batcher as background micro-batches (:class:`BatcherPool`), so searches and embeddings go first and an
        upsert never holds a model worker for longer than one micro-batch (issue 55: a 100-document upsert used to
        hold it for the whole job, and searches waited 25 s). Let in by the queue's limit like any request (429)."""
        from ..index.store.spool import upsert_documents

        try:
            self.batcher.admit(INGEST, len(documents))
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        pool = BatcherPool(self.encoder, self._write_tokenizer, self.batcher, asyncio.get_running_loop())
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._write_pool, upsert_documents, self.index.store, self.encoder, documents, pool)
        except EncodeFailed as exc:
            raise ApiError(500, f"{str(exc).replace('request', 'upsert', 1)}; nothing of it was acknowledged (the "
                           "server's next write finishes it)", kind="server_error", code="internal_error") from None

    async def searching(self, fn: Any, *args: Any) -> Any:
        """Run index work that needs no model (vector, full-text and filtered search, reads, deletes) on the search
        threads, not the model's: a lexical search or a lookup never waits behind embedding work."""
        return await asyncio.get_running_loop().run_in_executor(self._search_pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._search_pool is not None:
            self._search_pool.shutdown(wait=False)
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=False)


#: the batcher's name for the cross-encoder's work (``--rerank-model``)
RERANK = "rerank"
#: the batcher's name for an HTTP upsert's documents: background work, searches and embeddings go first
INGEST = "ingest"


class BatcherPool:
    """The encoder pool (:class:`robustir.index.store.config.EncoderPool`) of an HTTP upsert's job: each chunk's texts
    are tokenized on the write thread (its own tokenizer) and encoded through the batcher as :data:`INGEST`
    micro-batches (``--ingest-batch-size`` documents), so they take turns with searches and embeddings instead of
    holding a model worker for the whole job. Called from the write thread, never from the event loop."""

    def __init__(self, encoder: Any, tokenizer: Any, batcher: MicroBatcher, loop: asyncio.AbstractEventLoop) -> None:
        self.encoder, self.tokenizer, self.batcher, self.loop = encoder, tokenizer, batcher, loop

    def encode(self, texts: list[str], kind: str, *, batch_size: int, precision: str) -> np.ndarray:
        ids = self.encoder.token_ids(texts, kind, tokenizer=self.tokenizer)
        work = self.batcher.submit(INGEST, [(row, precision) for row in ids], admitted=True)  # let in by the route
        return asyncio.run_coroutine_threadsafe(work, self.loop).result().vectors

    def close(self) -> None:
        """Nothing to close: the batcher is the server's."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its queued micro-batches were dropped)."""


async def _unless_client_leaves(request: Request, work: Any, metrics: Any = None) -> Any:
    """Await ``work`` (the model's part of a request) unless the client disconnects first: then ``work`` is cancelled
    -- its micro-batches that have not started are dropped, so a client that gives up frees the model within the
    micro-batch already running -- and :class:`ClientGone` is raised. The disconnect is the ASGI server's
    ``http.disconnect`` message (the body has been read by then), no polling."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or failed meanwhile: nobody is waiting for it
        pass
    if metrics is not None:
        metrics.reject("disconnected")
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def _search_threads() -> int:
    """Threads for index work: one per CPU this process may use (LanceDB's own readers are native threads; these only
    wait on them), at least 2 so a long filtered search does not hold up a lookup."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cpus)


def _query_precision(index: Any, config: ServeConfig, device: Any, precision: str) -> str:
    """The precision queries are encoded in when an index is served: the one its documents were encoded in (recorded
    in its manifest), so ``/search`` finds the exact top-k -- unless ``--precision`` says otherwise (then a warning
    says what that costs) or the device lacks native support for it (bf16 emulated on a CPU is ~10x slower; fp32
    then, with a warning)."""
    from ..precision import resolve_precision

    recorded = index.manifest.get("precision")
    if not recorded or recorded == precision:
        if not recorded:
            logger.info("index %s does not record the precision of its documents (built by an older robustir): "
                        "queries are encoded in %s", index.path, precision)
        return precision
    if str(config.precision).lower() != "auto":
        logger.warning("index %s was encoded in %s; queries are encoded in %s (--precision %s): the top-k may "
                       "differ slightly from an exact search; leave --precision out to use %s", index.path, recorded,
                       precision, config.precision, recorded)
        return precision
    native = resolve_precision("auto", device)
    if recorded != "fp32" and recorded != native:
        logger.warning("index %s was encoded in %s, which %s does not compute natively: queries are encoded in %s, "
                       "so the top-k may differ slightly from an exact search", index.path, recorded, device, precision)
        return precision
    logger.info("index %s was encoded in %s: queries are encoded in %s too", index.path, recorded, recorded)
    return recorded


def _workers(config: ServeConfig, device, precision: str = "fp32") -> tuple[int, int]:
    """``(workers, texts per forward pass)``. A GPU: one worker, whole batches. The CPU: ``cpus`` =
    :func:`robustir.hardware.available_cpus` (affinity and cgroup quota, not the host's cores); in fp32 one worker
    with ``cpus`` torch threads, in bf16/fp16 one worker per CPU with one thread each (``--workers`` overrides; the
    threads are then ``cpus // workers``, set here for the whole process), and forward passes of 16 length-sorted
    texts.

    Measured on 2 quiet cores with MiniLM (docs/benchmarks.md, "Serving: workers x threads", 3 repeats): in fp32 one
    2-thread worker gave 1.14-1.18x the throughput of two 1-thread workers at 8 clients with 0.64-0.76x the p99, and
    0.92-0.94x the throughput at 32 clients with 0.73-0.89x the p99; in bf16 two 1-thread workers gave 1.19-1.27x
    the throughput at 32 clients and tied at 8 (a bf16 forward pass is ~2.5x cheaper, so intra-op threads mostly wait
    on each other); at 1 client all settings tied."""
    if device.type == "cuda":
        return config.workers or 1, config.encode_batch_size or config.max_batch_size
    from ..hardware import available_cpus

    cores = available_cpus()
    workers = config.workers or (1 if precision == "fp32" else cores)
    threads = max(1, cores // workers)
    set_torch_threads(threads)  # said once by create_app, with the precision queries are served in
    return workers, min(config.encode_batch_size or 16, config.max_batch_size)


def set_torch_threads(threads: int) -> None:
    """The calling thread's torch intra-op threads (thread-local under OpenMP once the thread has run torch): what
    :func:`_workers` sets for the process at start-up and the batcher's background lane per batch."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _server(request: Request) -> Server:
    return request.app.state.server
