"""Training input off the critical path: the batches of the coming steps are made while the current one trains.

:class:`InputPipeline` turns ``make(step) -> batch`` (fine-tuning: :class:`~robustir.training.data.StepBatches`,
sampling and tokenisation) into the batches of steps ``first .. stop-1``, in order, made ahead of the step that
uses them:

* ``prefetch = 0``: on the main thread when the step asks for it (the synchronous path, as before);
* ``workers = 0``, ``prefetch >= 1``: one background thread keeps up to ``prefetch`` batches ready. The fast
  tokenizer encodes in Rust without the GIL, so the thread and the training step run at once;
* ``workers >= 1``: a :class:`torch.utils.data.DataLoader` over the steps, ``workers`` processes, about
  ``prefetch`` batches in flight (``prefetch_factor`` per worker, at least 1). For when even the Python part of
  making a batch (sampling, ids) costs the step time, or competes with the main thread for the GIL.

Determinism: a batch is ``make(step)``, a function of (seed, epoch, step, rank) only. No mode draws from the global
random number generators (the DataLoader gets its own generator: its base seed would otherwise come from torch's
global one and shift every later dropout mask), so the training result does not depend on the mode, the number of
workers, their timing, or on where a run resumes.

Shutdown: :meth:`InputPipeline.close` (called by :meth:`~robustir.training.loop.TrainingLoop.run` in its
``finally``, also when the step raises) stops the thread or the workers and waits for them; an error raised while
making a batch is raised again by :meth:`~InputPipeline.get` for that step, in the main thread.

``pin_memory`` (CUDA): the batch's tensors are page-locked as they are made, so the copy to the GPU can overlap
(``tensor.to(device, non_blocking=True)``).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["InputPipeline", "pin"]

logger = logging.getLogger(__name__)

_JOIN_SECONDS = 60.0  # how long close() waits for a thread still making a batch before leaving it (a daemon)


def pin(value: Any) -> Any:
    """``value`` with every CPU tensor in it (dicts, lists, tuples) in page-locked memory."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda leaf: leaf.pin_memory() if torch.is_tensor(leaf) else leaf, value)


class _Steps(torch.utils.data.Dataset):
    """Item ``i`` of the DataLoader = ``(first + i, make(first + i))``."""

    def __init__(self, make: Callable[[int], Any], first: int, stop: int) -> None:
        self.make, self.first, self.stop = make, first, stop

    def __len__(self) -> int:
        return self.stop - self.first

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return self.first + index, self.make(self.first + index)


def _worker_init(_: int) -> None:
    # a forked worker must not start the tokenizer's thread pool (the parent may have used it: deadlock risk)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _identity(item: Any) -> Any:
    return item


class InputPipeline:
    """The batches of steps ``first .. stop-1`` for :meth:`~robustir.training.loop.TrainingLoop.run`.

    ``make(step)``: the batch of a step (a function of the step alone; picklable when ``workers > 0``);
    ``prefetch``: batches made ahead (0 = synchronous); ``workers``: DataLoader processes (0 = one thread);
    ``pin_memory``: page-lock the tensors (for a CUDA device). Use: :meth:`start`, then :meth:`get` for each step in
    order, then :meth:`close` (or ``with``)."""

    def __init__(self, make: Callable[[int], Any], *, prefetch: int = 2, workers: int = 0,
                 pin_memory: bool = False) -> None:
        if prefetch < 0 or workers < 0:
            raise ValueError(f"prefetch and workers must be >= 0, got {prefetch} and {workers}")
        self.make, self.prefetch, self.workers, self.pin_memory = make, prefetch, workers, pin_memory
        self.mode = "sync" if prefetch == 0 else ("thread" if workers == 0 else "workers")
        self._next: int | None = None
        self._stop_step = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stopping = threading.Event()
        self._loader_iter: Any = None
        self._processes: list = []
        self.closed = False

    # ------------------------------------------------------------------------ lifecycle

    def start(self, first: int, stop: int) -> "InputPipeline":
        """Begin making the batches of steps ``first .. stop-1`` (in the background unless synchronous)."""
        if self._next is not None:
            raise RuntimeError("InputPipeline.start called twice")
        self._next, self._stop_step = first, stop
        if first >= stop or self.mode == "sync":
            return self
        if self.mode == "thread":
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._produce, args=(first, stop), name="robustir-input",
                                            daemon=True)
            self._thread.start()
        else:
            loader = torch.utils.data.DataLoader(
                _Steps(self.make, first, stop), batch_size=None, shuffle=False, num_workers=self.workers,
                prefetch_factor=max(1, math.ceil(self.prefetch / self.workers)), collate_fn=_identity,
                pin_memory=self.pin_memory, worker_init_fn=_worker_init,
                generator=torch.Generator().manual_seed(0))  # never the global generator (see the module doc)
            self._loader_iter = iter(loader)
            self._processes = list(getattr(self._loader_iter, "_workers", []))
        return self

    def _produce(self, first: int, stop: int) -> None:
        """The background thread: make the batches in order; an error is handed to the step that needed it."""
        for step in range(first, stop):
            if self._stopping.is_set():
                return
            try:
                item = (step, self._made(step), None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread by get()
                item = (step, None, exc)
            self._queue.put(item)  # blocks while `prefetch` batches wait; close() drains the queue to free it
            if item[2] is not None:
                return

    def _made(self, step: int) -> Any:
        batch = self.make(step)
        return pin(batch) if self.pin_memory else batch

    def close(self) -> None:
        """Stop making batches and wait for the thread or the workers to end (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
        if self._thread is not None:
            # after the drain the producer's one pending put (blocked on a full queue, or of the batch it is making)
            # has room; it then sees the stop and returns
            self._drain()
            self._thread.join(timeout=_JOIN_SECONDS)
            if self._thread.is_alive():
                logger.warning("the input thread is still making a batch after %.0f s; leaving it (a daemon)",
                               _JOIN_SECONDS)
            self._drain()
        if self._loader_iter is not None:
            shutdown = getattr(self._loader_iter, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._loader_iter = None

    def _drain(self) -> None:
        if self._queue is None:
            return
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    @property
    def alive(self) -> bool:
        """Whether a thread or worker process of this pipeline is still running."""
        if self._thread is not None and self._thread.is_alive():
            return True
        return any(process.is_alive() for process in self._processes)

    def __enter__(self) -> "InputPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ batches

    def get(self, step: int) -> Any:
        """The batch of ``step``: the steps must be asked for in order, from ``first``."""
        if self._next is None:
            raise RuntimeError("InputPipeline.get before start")
        if self.closed:
            raise RuntimeError("InputPipeline.get after close")
        if step != self._next or step >= self._stop_step:
            raise RuntimeError(f"InputPipeline: asked for step {step}, the next one is {self._next} "
                               f"(of {self._stop_step})")
        self._next = step + 1
        if self.mode == "sync":
            return self.make(step)  # nothing to overlap: not pinned
        if self.mode == "thread":
            made, batch, error = self._queue.get()
        else:
            made, batch = next(self._loader_iter)
            error = None
        if error is not None:
            raise error
        if made != step:  # cannot happen: the producer makes the steps in order
            raise RuntimeError(f"InputPipeline: got the batch of step {made} for step {step}")
        return batch
