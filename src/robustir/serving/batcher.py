"""Dynamic batching of concurrent requests: worker threads run the models on everything that is waiting.

Every model's work goes through here -- the embedding model's (``/v1/embeddings``, ``/search``'s queries) and the
cross-encoder's (``/v1/rerank``, ``/search`` with ``rerank: true``), and any model added later (:meth:`MicroBatcher.
add_model`) -- so the same queue, limits, refusals and cancellation hold for all of them (issue 52: reranks used to
run beside the queue, so an embedding waited 51.8 s behind six of them while the queue read 0).

A request puts its rows (token-id lists, or a reranker's ``(query, document)`` pairs; checked before they get here,
so a malformed text never joins a shared batch) on its model's queue and awaits a future. A request larger than its
model's micro-batch size (``max_batch_size``; the reranker's is smaller, one forward pass) is cut into micro-batches,
of which at most ``workers`` wait or run at a time: the next is queued when one is done, so requests that arrive
meanwhile are served between them, and a request whose client went away (its task cancelled) leaves no more than
that behind. When a worker is free, a batching task takes the first waiting micro-batch of the next model in turn
(the models take turns while both have work: a 1,000-document rerank never holds up an embedding for more than one
of its micro-batches per worker) and every one of that model already waiting behind it, up to the micro-batch size
(one that would overflow the batch waits for the next), optionally waiting up to ``max_wait_ms`` for more. With the
default ``max_wait_ms=0`` a lone request starts at once: while the workers are busy, requests pile up, so under load
the next batch is already full when a worker is free and no time is spent waiting. The batch runs on a worker thread
and each request gets its own rows back.

Isolation and bounds:

* a batch that fails is run again request by request, so only the request that breaks the model gets the error;
* at most ``max_queued`` rows wait, of every model together (a rerank pair counts as one); a request that would go
  over is refused at once with :class:`Overloaded` (``robustir serve`` answers 429 with ``Retry-After``) -- unless
  nothing waits, so any request within the per-request limits is served on an idle server;
* ``submit(..., timeout=)`` bounds how long each micro-batch *waits* for a worker, not how long the model takes on
  it: a request whose micro-batch waited that long is dropped (its queued rows with it); one that is being encoded is
  never cut off, however long it is;
* a cancelled request (its client went away) takes its waiting micro-batches off the queue at once.

``workers``: how many batches run at once. One on a GPU (a batch fills it); on a CPU see
:func:`robustir.serving.service._workers`. Index searches have their own threads
(:meth:`robustir.serving.service.Server.searching`).

**Background work** (``add_model(..., background=True)``: an HTTP upsert's documents, issue 55): its micro-batches
take turns with the other models' batches, on at most ``workers - 1`` workers at once (one when there is one), so a
search or an embedding that arrives during a 1,000-document upsert finds a worker free when there are several. Turns,
not priority: waiting searches are batched together, so a turn costs them one micro-batch, while a strict priority
starved the upsert under steady search load (bench/upsert_search.py, fp32, 2 clients on a quiet machine: a
1,000-document upsert 194 s against 7.1 s alone). With ``background_lane`` (``robustir serve`` on a CPU with one
worker, i.e. fp32) background batches instead run on a thread of their own, one at a time, beside the workers: a
search never waits for an upsert's micro-batch (with turns on the one worker the slowest 1% of searches during an
upsert spent 57-87% of their time in the queue, behind it), and ``set_threads`` shares the CPUs between the two
lanes while both have work (:meth:`_call`). Background work is admitted by the same queue limit as any request
(:meth:`admit`) and its waiting micro-batches count in ``queued``; once admitted, a job's later micro-batches are not
refused (``admitted=True``): a half-written upsert is not stopped by a burst of searches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[Any]], np.ndarray]

__all__ = ["MicroBatcher", "BatchStats", "Embedded", "Overloaded", "EncodeFailed"]


class Overloaded(Exception):
    """The queue is full: try again later (``retry_after`` seconds, an estimate)."""

    def __init__(self, queued: int, limit: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {queued} texts (or rerank pairs) are waiting for the models (at most "
                         f"{limit}); retry in {retry_after} s")
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
    kind: str  # the model it is for
    rows: list[Any]
    future: asyncio.Future
    enqueued: float
    started: asyncio.Future  # done when its batch starts on a worker: the wait is over, the timeout no longer runs


@dataclass
class _Model:
    """A model the workers run: ``fn(rows) -> one result row per row``, in micro-batches of ``batch_size`` rows."""

    fn: Callable[[list[Any]], np.ndarray] | None  # None: the batcher's ``encode`` (read when a batch runs)
    batch_size: int
    unit: str  # what a row is, for messages: "text", "pair"
    background: bool = False  # runs on at most workers - 1 workers at once (one if there is one)
    waiting: deque = field(default_factory=deque)  # its micro-batches, first come first served


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
    """Batch concurrent calls into few calls of each model: ``encode(rows) -> vectors`` (one row of vectors per row)
    for :meth:`embed`, and the models of :meth:`add_model` for :meth:`submit`.

    Start it inside the event loop that serves requests (:meth:`start`), stop it with :meth:`stop`. ``on_batch(rows,
    requests, seconds, waits)``, if given, is called after each batch (metrics).
    """

    EMBED = "embed"

    def __init__(self, encode: EncodeFn, *, max_batch_size: int = 64, max_wait_ms: float = 0.0, workers: int = 1,
                 max_queued: int = 4096, on_batch: Callable[[int, int, float, Sequence[float]], None] | None = None,
                 background_lane: bool = False, set_threads: Callable[[int], None] | None = None, threads: int = 1,
                 busy_window_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
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
        self.background_lane = background_lane  # background batches on a thread of their own, one at a time
        self.set_threads, self.threads = set_threads, threads
        self.busy_window, self.clock = busy_window_s, clock
        self._last_foreground = float("-inf")  # clock() when a request of a model that is not background last came
        self.stats = BatchStats()
        self.queued = 0  # rows waiting, of every model, not yet in a batch
        self._models: dict[str, _Model] = {self.EMBED: _Model(None, max_batch_size, "text")}
        self._background_running = 0  # background batches on a worker now
        self._foreground_running = 0  # the other batches on a worker now
        self._turn = 0  # the models take turns: index (in self._models) of the model whose batch goes next
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._rate = 0.0  # rows per second of recent batches (for Retry-After)

    def add_model(self, kind: str, fn: Callable[[list[Any]], np.ndarray], *, batch_size: int | None = None,
                  unit: str = "row", background: bool = False) -> None:
        """Run ``fn(rows) -> one result per row`` (a numpy array whose first axis is the rows) for :meth:`submit`
        calls of ``kind``, in micro-batches of at most ``batch_size`` rows (default ``max_batch_size``), under the
        same queue, limits and workers as the embeddings. ``unit`` names a row in messages. ``background``: its
        batches run on at most ``workers - 1`` workers at once (one if there is one)."""
        if kind in self._models:
            raise ValueError(f"a model {kind!r} is already served")
        size = batch_size or self.max_batch_size
        if size < 1:
            raise ValueError(f"batch_size must be >= 1, got {size}")
        self._models[kind] = _Model(fn, min(size, self.max_batch_size), unit, background)

    def _slots(self, model: _Model) -> int:
        """How many of ``model``'s micro-batches may run (and so wait, per request) at once."""
        if model.background:
            return 1 if self.background_lane else max(1, self.workers - 1)
        return self.workers

    def admit(self, kind: str, rows: int) -> None:
        """Raise :class:`Overloaded` when a request of ``rows`` rows for ``kind`` is not let in now: what it would put
        on the queue at once (its first micro-batches) would take the queue over ``max_queued`` -- unless nothing
        waits, so any request within the per-request limits is served on an idle server."""
        model = self._models.get(kind)
        if model is None:
            raise ValueError(f"no model {kind!r} is served (add_model)")
        ahead = min(rows, model.batch_size * self._slots(model))
        if self.queued and self.queued + ahead > self.max_queued:
            self.stats.overloaded += 1
            raise Overloaded(self.queued, self.max_queued, self.retry_after(self.queued + rows))

    async def start(self) -> None:
        self._arrived = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers + self.background_lane,
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
        for model in self._models.values():
            while model.waiting:
                item = self._took(model.waiting.popleft())
                if not item.future.done():
                    item.future.set_exception(RuntimeError("the server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def embed(self, rows: Sequence[Any], *, timeout: float | None = None) -> Embedded:
        """The vectors of ``rows`` (token-id lists): :meth:`submit` to the embedding model."""
        return await self.submit(self.EMBED, rows, timeout=timeout)

    async def submit(self, kind: str, rows: Sequence[Any], *, timeout: float | None = None,
                     admitted: bool = False) -> Embedded:
        """Model ``kind``'s results for ``rows``, batched with other callers' (in micro-batches of at most its batch
        size). Raises :class:`Overloaded` at once when the queue is full (:meth:`admit`; not with ``admitted``: the
        caller was let in before, e.g. a job's later chunk), :class:`asyncio.TimeoutError` when a micro-batch waited
        ``timeout`` seconds for a worker (encoding time does not count), :class:`EncodeFailed` when the model fails
        on these rows. Cancelling the call takes its micro-batches that have not started off the queue."""
        if not self.running:
            raise RuntimeError("the batcher is not running (start() it inside the serving event loop)")
        if not admitted:
            self.admit(kind, len(rows))
        model = self._models[kind]
        rows = list(rows)
        size = model.batch_size
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)] or [rows]
        slots = self._slots(model)  # its micro-batches on the queue or a worker at once
        pending: deque[_Item] = deque()
        parts: list[Embedded] = []
        try:
            following = 0
            while following < len(chunks) or pending:
                while following < len(chunks) and len(pending) < slots:
                    pending.append(self._put(kind, chunks[following]))
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
                self._drop(item)
        if len(parts) == 1:
            return parts[0]
        return Embedded(np.concatenate([p.vectors for p in parts]), sum(p.queue_s for p in parts),
                        sum(p.inference_s for p in parts))

    def _put(self, kind: str, rows: list[Any]) -> _Item:
        loop = asyncio.get_running_loop()
        item = _Item(kind, rows, loop.create_future(), loop.time(), loop.create_future())
        self.queued += len(rows)
        model = self._models[kind]
        if not model.background:
            self._last_foreground = self.clock()
        model.waiting.append(item)
        self._arrived.set()
        return item

    def _drop(self, item: _Item) -> None:
        """``item``'s request gave up on it: off the queue if it still waits (its rows no longer count)."""
        if not item.future.done():
            item.future.cancel()
        waiting = self._models[item.kind].waiting
        if not item.started.done() and item in waiting:
            waiting.remove(item)
            self._took(item)

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

    def _live_head(self, model: _Model) -> _Item | None:
        """The first micro-batch of ``model`` still wanted (those whose request went away are dropped)."""
        while model.waiting and model.waiting[0].future.done():
            self._took(model.waiting.popleft())
        return model.waiting[0] if model.waiting else None

    def _next_model(self) -> _Model | None:
        """The model whose batch goes next: the next one in turn that has work waiting (round robin); a background
        model only while it has a free slot (:meth:`_slots`)."""
        kinds = list(self._models)
        for step in range(len(kinds)):
            index = (self._turn + step) % len(kinds)
            model = self._models[kinds[index]]
            if self._live_head(model) is None:
                continue
            running = self._background_running if model.background else self._foreground_running
            if running >= self._slots(model):
                continue
            self._turn = (index + 1) % len(kinds)
            return model
        return None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        free = asyncio.Semaphore(self.workers + self.background_lane)
        batch: list[_Item] = []
        try:
            while True:
                await free.acquire()  # a batch is formed only when a worker can take it: meanwhile requests pile up
                model = self._next_model()
                while model is None:
                    self._arrived.clear()
                    await self._arrived.wait()
                    model = self._next_model()
                first = self._took(model.waiting.popleft())
                batch, size = [first], len(first.rows)
                deadline = loop.time() + self.max_wait
                while size < model.batch_size:
                    item = self._live_head(model)
                    if item is None:
                        remaining = deadline - loop.time()
                        if remaining <= 0:
                            break
                        self._arrived.clear()
                        try:
                            await asyncio.wait_for(self._arrived.wait(), remaining)
                        except asyncio.TimeoutError:
                            break
                        continue
                    if size + len(item.rows) > model.batch_size:
                        break  # first in its model's next batch: never split a request, never reorder
                    batch.append(self._took(model.waiting.popleft()))
                    size += len(item.rows)
                task = loop.create_task(self._run_batch(model, batch))
                batch = []
                self._running.add(task)
                task.add_done_callback(self._running.discard)
                if model.background:
                    self._background_running += 1
                else:
                    self._foreground_running += 1
                task.add_done_callback(functools.partial(self._batch_done, model.background))
                task.add_done_callback(lambda _: free.release())
        except asyncio.CancelledError:  # stopping: requests taken off the queue but not started get an answer too
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(RuntimeError("the server is shutting down"))
            raise

    def _batch_done(self, background: bool, _task: asyncio.Task) -> None:
        if background:
            self._background_running -= 1
        else:
            self._foreground_running -= 1
        if self._arrived is not None:
            self._arrived.set()  # work of that kind may be waiting for this slot

    def _call(self, fn: Callable[[list[Any]], np.ndarray], rows: list[Any], background: bool) -> np.ndarray:
        """``fn(rows)`` on a worker thread, ``set_threads`` told this batch's intra-op threads first: while both
        lanes have work (background work waiting or running, and other requests within ``busy_window_s``), one for
        a background batch and ``threads - 1`` for the others, so the lanes share the CPUs instead of fighting over
        them (an OpenMP pool with more threads than free cores stalls at every barrier); else all ``threads``."""
        if self.set_threads is not None:
            if background:
                busy = self.clock() - self._last_foreground < self.busy_window
            else:
                busy = self._background_running or any(m.waiting for m in self._models.values() if m.background)
            self.set_threads(1 if background and busy else max(1, self.threads - 1) if busy else self.threads)
        return fn(rows)

    async def _run_batch(self, model: _Model, batch: list[_Item]) -> None:
        live = [item for item in batch if not item.future.done()]  # a client that went away cancelled its future
        if not live:
            return
        fn = model.fn or self.encode
        loop = asyncio.get_running_loop()
        started = loop.time()
        for item in live:
            if not item.started.done():
                item.started.set_result(started)
        rows = [row for item in live for row in item.rows]
        try:
            vectors = await self.run(self._call, fn, rows, model.background)
        except Exception:
            if len(live) == 1:
                self._fail(live[0], model)
                return
            # one request may have broken the batch: run each alone, so only that one gets the error
            logger.warning("a batch of %d requests failed; running them one by one", len(live))
            self.stats.retried_batches += 1
            for item in live:
                if item.future.done():
                    continue
                begun = loop.time()
                try:
                    alone = await self.run(self._call, fn, item.rows, model.background)
                except Exception:
                    self._fail(item, model)
                    continue
                self._deliver([item], alone, begun, loop.time())
            return
        self._deliver(live, vectors, started, loop.time())

    def _fail(self, item: _Item, model: _Model) -> None:
        logger.exception("the %s model failed on a request of %d %ss", item.kind, len(item.rows), model.unit)
        self.stats.failed += 1
        if not item.future.done():
            error = EncodeFailed(f"the model failed on this request's {len(item.rows)} {model.unit}(s)")
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
