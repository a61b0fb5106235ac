"""Dynamic batching of concurrent requests: worker threads run the model on everything that is waiting.

Requests put their texts on an asyncio queue and await a future. When a worker is free, a batching task takes the
first waiting request, then keeps taking more until the batch holds ``max_batch_size`` texts or ``max_wait_ms`` have
passed since the first one arrived (a request that would overflow the batch waits for the next one; a request larger
than a batch goes alone). The batch is encoded on a worker thread -- one ``encode`` call per input kind (queries,
documents) -- and each request gets its own rows back. While the workers are busy the event loop keeps accepting
requests, so under load the next batch is already full when a worker is free and no time is spent waiting.

``workers``: how many batches run at once. One on a GPU (a batch fills it); on a CPU, one per core with one torch
thread each is the most work per CPU-second for small encoders (``robustir serve``'s default; ``docs/benchmarks.md``).
Other work for the model's threads (a FAISS search) goes through :meth:`run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[str], str], "tuple[np.ndarray, list[int]]"]


@dataclass
class _Item:
    texts: list[str]
    kind: str
    future: asyncio.Future


@dataclass
class BatchStats:
    """What the batcher has done: batches run, texts encoded, the largest batch, requests served."""

    batches: int = 0
    texts: int = 0
    requests: int = 0
    largest: int = 0

    def record(self, texts: int, requests: int) -> None:
        self.batches += 1
        self.texts += texts
        self.requests += requests
        self.largest = max(self.largest, texts)

    def to_dict(self) -> dict:
        return {"batches": self.batches, "texts": self.texts, "requests": self.requests, "largest_batch": self.largest,
                "mean_batch": round(self.texts / self.batches, 2) if self.batches else 0.0}


class MicroBatcher:
    """Batch concurrent ``embed`` calls into few calls of ``encode(texts, kind) -> (vectors, token_counts)``.

    Start it inside the event loop that serves requests (:meth:`start`), stop it with :meth:`stop`.
    """

    def __init__(self, encode: EncodeFn, *, max_batch_size: int = 64, max_wait_ms: float = 5.0,
                 workers: int = 1) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.encode = encode
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.workers = workers
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

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

    async def embed(self, texts: list[str], kind: str) -> tuple[np.ndarray, list[int]]:
        """The vectors and token counts of ``texts`` (``kind``: ``query`` or ``passage``), batched with other
        callers'."""
        if not self.running:
            raise RuntimeError("the batcher is not running (start() it inside the serving event loop)")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Item(list(texts), kind, future))
        return await future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on one of the model's worker threads."""
        if self._executor is None:
            raise RuntimeError("the batcher is not running")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ internals
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        free = asyncio.Semaphore(self.workers)
        carry: _Item | None = None
        batch: list[_Item] = []
        try:
            while True:
                await free.acquire()  # a batch is formed only when a worker can take it: meanwhile requests pile up
                first = carry if carry is not None else await self._queue.get()
                carry = None
                batch, size = [first], len(first.texts)
                deadline = loop.time() + self.max_wait
                while size < self.max_batch_size:
                    try:
                        item = self._queue.get_nowait()
                    except asyncio.QueueEmpty:
                        remaining = deadline - loop.time()
                        if remaining <= 0:
                            break
                        try:
                            item = await asyncio.wait_for(self._queue.get(), remaining)
                        except asyncio.TimeoutError:
                            break
                    if size + len(item.texts) > self.max_batch_size:
                        carry = item  # first in the next batch: never split a request, never reorder
                        break
                    batch.append(item)
                    size += len(item.texts)
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
        for kind in dict.fromkeys(item.kind for item in live):
            group = [item for item in live if item.kind == kind]
            texts = [text for item in group for text in item.texts]
            try:
                vectors, counts = await self.run(self.encode, texts, kind)
            except Exception as exc:  # every request of the group gets the error; the batcher goes on
                logger.exception("encoding a batch of %d texts failed", len(texts))
                for item in group:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            self.stats.record(len(texts), len(group))
            start = 0
            for item in group:
                end = start + len(item.texts)
                if not item.future.done():
                    item.future.set_result((vectors[start:end], counts[start:end]))
                start = end
