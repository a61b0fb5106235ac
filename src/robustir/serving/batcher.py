"""Dynamic batching of concurrent requests: worker threads run the model on everything that is waiting.

A request puts its rows (token-id lists, tokenized and checked before they get here, so a malformed text never
joins a shared batch) on an asyncio queue and awaits a future. A request larger than ``max_batch_size`` rows is cut
into micro-batches of at most that many, of which at most ``workers`` wait or run at a time: the next is queued when
one is done, so requests that arrive meanwhile are served between them (a 1,500-text request no longer holds every
worker until it is done), and a request whose client went away (its task cancelled) leaves no more than that behind.
When a worker is free, a batching task takes the first waiting micro-batch and every one already waiting behind it,
up to ``max_batch_size`` rows (one that would overflow the batch waits for the next), optionally waiting up to
``max_wait_ms`` for more. With the default ``max_wait_ms=0`` a lone request starts at once: while the workers are
busy, requests pile up on the queue, so under load the next batch is already full when a worker is free and no time
is spent waiting. The batch runs on a worker thread and each request gets its own rows back.

Isolation and bounds:

* a batch that fails is run again request by request, so only the request that breaks the model gets the error;
* at most ``max_queued`` rows wait; a request that would go over is refused at once with :class:`Overloaded`
  (``robustir serve`` answers 429 with ``Retry-After``) -- unless nothing waits, so any request within the per-request
  limits is served on an idle server;
* ``embed(..., timeout=)`` bounds how long each micro-batch *waits* for a worker, not how long the model takes on
  it: a request whose micro-batch waited that long is dropped (its queued rows with it); one that is being encoded is
  never cut off, however long it is.

``workers``: how many batches run at once. One on a GPU (a batch fills it); on a CPU see
:func:`robustir.serving.app._workers`. Other work for the model's threads (the reranker, an HTTP upsert's encoding)
goes through :meth:`run`; index searches have their own threads (:meth:`robustir.serving.app.Server.searching`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[Any]], np.ndarray]

__all__ = ["MicroBatcher", "BatchStats", "Embedded", "Overloaded", "EncodeFailed"]


class Overloaded(Exception):
    """The queue is full: try again later (``retry_after`` seconds, an estimate)."""

    def __init__(self, queued: int, limit: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {queued} texts are waiting for the model (at most {limit}); retry in "
                         f"{retry_after} s")
        self.queued, self.limit, self.retry_after = queued, limit, retry_after


class EncodeFailed(Exception):
    """The model failed on this request's rows (run alone, so the rows are the cause; other requests were served)."""


@dataclass
class Embedded:
    """A request's vectors, with how long it waited for a worker and how long its batch ran (seconds)."""

    vectors: np.ndarray
    queue_s: float
    inference_s: float


@dataclass
class _Item:
    rows: list[Any]
    future: asyncio.Future
    enqueued: float
    started: asyncio.Future  # done when its batch starts on a worker: the wait is over, the timeout no longer runs


@dataclass
class BatchStats:
    """What the batcher has done: batches run, rows encoded, the largest batch, requests served, refused, failed."""

    batches: int = 0
    texts: int = 0
    requests: int = 0
    largest: int = 0
    overloaded: int = 0
    timed_out: int = 0
    failed: int = 0
    retried_batches: int = 0

    def record(self, texts: int, requests: int) -> None:
        self.batches += 1
        self.texts += texts
        self.requests += requests
        self.largest = max(self.largest, texts)

    def to_dict(self) -> dict:
        return {"batches": self.batches, "texts": self.texts, "requests": self.requests, "largest_batch": self.largest,
                "mean_batch": round(self.texts / self.batches, 2) if self.batches else 0.0,
                "overloaded": self.overloaded, "timed_out": self.timed_out, "failed": self.failed,
                "retried_batches": self.retried_batches}


class MicroBatcher:
    """Batch concurrent ``embed`` calls into few calls of ``encode(rows) -> vectors`` (one row of vectors per row).

    Start it inside the event loop that serves requests (:meth:`start`), stop it with :meth:`stop`. ``on_batch(rows,
    requests, seconds, waits)``, if given, is called after each batch (metrics).
    """

    def __init__(self, encode: EncodeFn, *, max_batch_size: int = 64, max_wait_ms: float = 0.0, workers: int = 1,
                 max_queued: int = 4096, on_batch: Callable[[int, int, float, Sequence[float]], None] | None = None
                 ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.encode = encode
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.workers = workers
        self.max_queued = max_queued
        self.on_batch = on_batch
        self.stats = BatchStats()
        self.queued = 0  # rows on the queue, not yet in a batch
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._rate = 0.0  # rows per second of recent batches (for Retry-After)

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers,
                                                               thread_name_prefix="robustir-model")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="robustir-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._running:  # batches on a worker finish (their requests get answers); none start any more
            await asyncio.gather(*self._running, return_exceptions=True)
        if self._queue is not None:
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if not item.future.done():
                    item.future.set_exception(RuntimeError("the server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def embed(self, rows: Sequence[Any], *, timeout: float | None = None) -> Embedded:
        """The vectors of ``rows``, batched with other callers' (in micro-batches of at most ``max_batch_size``).
        Raises :class:`Overloaded` at once when the queue is full, :class:`asyncio.TimeoutError` when a
        micro-batch waited ``timeout`` seconds for a worker (encoding time does not count), :class:`EncodeFailed`
        when the model fails on these rows. Cancelling the call drops its micro-batches that have not started."""
        if not self.running:
            raise RuntimeError("the batcher is not running (start() it inside the serving event loop)")
        rows = list(rows)
        size = self.max_batch_size
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)] or [rows]
        ahead = min(len(rows), size * self.workers)  # what the request puts on the queue at once
        if self.queued and self.queued + ahead > self.max_queued:
            self.stats.overloaded += 1
            raise Overloaded(self.queued, self.max_queued, self.retry_after(self.queued + len(rows)))
        pending: deque[_Item] = deque()
        parts: list[Embedded] = []
        try:
            following = 0
            while following < len(chunks) or pending:
                while following < len(chunks) and len(pending) < self.workers:
                    pending.append(self._put(chunks[following]))
                    following += 1
                item = pending[0]
                done, _ = await asyncio.wait({item.started, item.future}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    self.stats.timed_out += 1
                    raise asyncio.TimeoutError
                parts.append(await item.future)
                pending.popleft()
        finally:  # timed out, failed, or cancelled (the client went away): what has not started is dropped
            for item in pending:
                if not item.future.done():
                    item.future.cancel()
        if len(parts) == 1:
            return parts[0]
        return Embedded(np.concatenate([p.vectors for p in parts]), sum(p.queue_s for p in parts),
                        sum(p.inference_s for p in parts))

    def _put(self, rows: list[Any]) -> _Item:
        loop = asyncio.get_running_loop()
        item = _Item(rows, loop.create_future(), loop.time(), loop.create_future())
        self.queued += len(rows)
        self._queue.put_nowait(item)
        return item

    def retry_after(self, rows: int) -> int:
        """Seconds until ``rows`` queued rows are likely done, from the recent rate (at least 1)."""
        return max(1, int(rows / self._rate + 0.999)) if self._rate > 0 else 1

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on one of the model's worker threads."""
        if self._executor is None:
            raise RuntimeError("the batcher is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ internals
    def _took(self, item: _Item) -> _Item:
        """``item``, just taken off the queue: its rows no longer count as waiting."""
        self.queued -= len(item.rows)
        return item

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        free = asyncio.Semaphore(self.workers)
        carry: _Item | None = None
        batch: list[_Item] = []
        try:
            while True:
                await free.acquire()  # a batch is formed only when a worker can take it: meanwhile requests pile up
                if carry is None:
                    first = self._took(await self._queue.get())
                else:
                    first, carry = carry, None
                batch, size = [first], len(first.rows)
                deadline = loop.time() + self.max_wait
                while size < self.max_batch_size:
                    if not self._queue.empty():
                        item = self._took(self._queue.get_nowait())
                    else:
                        remaining = deadline - loop.time()
                        if remaining <= 0:
                            break
                        try:
                            item = self._took(await asyncio.wait_for(self._queue.get(), remaining))
                        except asyncio.TimeoutError:
                            break
                    if item.future.done():  # timed out or its client went away while it waited
                        continue
                    if size + len(item.rows) > self.max_batch_size:
                        carry = item  # first in the next batch: never split a request, never reorder
                        break
                    batch.append(item)
                    size += len(item.rows)
                task = loop.create_task(self._run_batch(batch))
                batch = []
                self._running.add(task)
                task.add_done_callback(self._running.discard)
                task.add_done_callback(lambda _: free.release())
        except asyncio.CancelledError:  # stopping: requests taken off the queue but not started get an answer too
            for item in batch + ([carry] if carry is not None else []):
                if not item.future.done():
                    item.future.set_exception(RuntimeError("the server is shutting down"))
            raise

    async def _run_batch(self, batch: list[_Item]) -> None:
        live = [item for item in batch if not item.future.done()]  # a client that went away cancelled its future
        if not live:
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        for item in live:
            if not item.started.done():
                item.started.set_result(started)
        rows = [row for item in live for row in item.rows]
        try:
            vectors = await self.run(self.encode, rows)
        except Exception:
            if len(live) == 1:
                self._fail(live[0])
                return
            # one request may have broken the batch: run each alone, so only that one gets the error
            logger.warning("a batch of %d requests failed; running them one by one", len(live))
            self.stats.retried_batches += 1
            for item in live:
                if item.future.done():
                    continue
                begun = loop.time()
                try:
                    alone = await self.run(self.encode, item.rows)
                except Exception:
                    self._fail(item)
                    continue
                self._deliver([item], alone, begun, loop.time())
            return
        self._deliver(live, vectors, started, loop.time())

    def _fail(self, item: _Item) -> None:
        logger.exception("the model failed on a request of %d texts", len(item.rows))
        self.stats.failed += 1
        if not item.future.done():
            error = EncodeFailed(f"the model failed on this request's {len(item.rows)} text(s)")
            item.future.set_exception(error)

    def _deliver(self, items: list[_Item], vectors: np.ndarray, started: float, ended: float) -> None:
        seconds = ended - started
        total = sum(len(item.rows) for item in items)
        self.stats.record(total, len(items))
        if seconds > 0:
            rate = total / seconds * self.workers
            self._rate = rate if self._rate == 0 else 0.8 * self._rate + 0.2 * rate
        waits = [started - item.enqueued for item in items]
        start = 0
        for item, wait in zip(items, waits):
            end = start + len(item.rows)
            if not item.future.done():
                item.future.set_result(Embedded(vectors[start:end], wait, seconds))
            start = end
        if self.on_batch is not None:
            try:
                self.on_batch(total, len(items), seconds, waits)
            except Exception:  # metrics never fail a request
                logger.exception("on_batch failed")
