"""Parallel runs that fit the device's memory: a job starts only when the GPU has what runs were seen to need.

``noise-bench --jobs 14`` started 14 GPU-preset runs of ~8.5 GB each on an 80 GB H100 (issue 54): they ran out of
memory and were re-run one by one (correct, but the parallel speed-up was lost). Here each run records its peak
device memory (:func:`peak_device_memory`, in its results row), and :func:`run_gated` starts the next job only when
:class:`MemoryGate` admits it:

* nothing of ours running: always (it measures the free memory then: the baseline the running jobs share);
* no peak seen yet (a fresh bench): one run alone first, to learn what a run needs;
* otherwise: ``need = largest peak seen + margin`` must fit both in the free memory now (another user's processes
  count) and in the baseline less ``need`` for every running job (a job just started has not allocated yet, so the
  free memory now would over-admit).

Without CUDA the probe gives None and every job is admitted (``--jobs`` as before). The probe and the wait are
arguments, so the policy is tested on the CPU with a simulated device and no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait as wait_futures
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryGate", "run_gated", "cuda_free_memory", "peak_device_memory", "reset_peak_device_memory"]

logger = logging.getLogger(__name__)

#: what a run may hold beyond its recorded peak: its CUDA context (~0.5 GB) and allocator slack
DEFAULT_MARGIN = 1 << 30


def cuda_free_memory() -> int | None:
    """Free bytes on the current CUDA device (``torch.cuda.mem_get_info``), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def reset_peak_device_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_device_memory() -> int | None:
    """Bytes this process's allocator held at most on the CUDA device since the last reset
    (``torch.cuda.max_memory_reserved``: what the device lent, which is at least ``max_memory_allocated``); None
    without CUDA."""
    import torch

    return int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None


@dataclass
class MemoryGate:
    """Whether one more job may start now (module docstring). ``free_memory``: the probe (bytes or None);
    ``seen``: the largest peak recorded so far (e.g. by earlier runs of the same budget)."""

    free_memory: Callable[[], int | None] = cuda_free_memory
    margin: int = DEFAULT_MARGIN
    seen: int = 0
    baseline: int | None = None

    def observe(self, peak: int | None) -> None:
        """A finished run's recorded peak (None: no device memory recorded)."""
        if isinstance(peak, int) and peak > 0:
            self.seen = max(self.seen, peak)

    @property
    def need(self) -> int | None:
        return self.seen + self.margin if self.seen else None

    def admits(self, running: int) -> bool:
        if running == 0:
            self.baseline = self.free_memory()
            return True
        free = self.free_memory()
        if free is None:
            return True
        need = self.need
        if need is None:
            return False
        return min(free, (self.baseline if self.baseline is not None else free) - running * need) >= need


def _first_completed(futures: set[Future]) -> set[Future]:
    return wait_futures(futures, return_when=FIRST_COMPLETED).done


def run_gated(items: Iterable[Any], start: Callable[[Any], Future], jobs: int, gate: MemoryGate, *,
              wait: Callable[[set[Future]], set[Future]] = _first_completed) -> Iterator[tuple[Any, Future]]:
    """``(item, its finished future)`` for every item, in the order they finish: ``start(item)`` runs an item, at
    most ``jobs`` at once and only when ``gate`` admits it; ``wait(running)`` blocks until some finish. The caller
    reads each result (and :meth:`MemoryGate.observe` its peak) before the next start is decided."""
    pending, running = list(items), {}
    while pending or running:
        while pending and len(running) < jobs and gate.admits(len(running)):
            item = pending.pop(0)
            running[start(item)] = item
        if pending and len(running) < jobs:
            logger.info("noise-bench: %d run(s) wait for device memory (%s needed per run, %d running)",
                        len(pending), gate.need, len(running))
        for future in wait(set(running)):
            yield running.pop(future), future
