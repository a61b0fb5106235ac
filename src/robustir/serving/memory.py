"""Bounded native memory for a long-lived server.

A server's forward passes see a new input shape (rows x tokens) on almost every request. Two native caches grow with
the shapes seen, and neither is PyTorch's to bound:

* **oneDNN's primitive cache** (the CPU kernels, one per op and shape; 1,024 by default, each holding its own
  scratch and re-laid-out weights in bf16): ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, read when the first primitive is
  made, so :func:`bound_native_memory` runs before the model's first forward pass;
* **glibc's heap**: freed activations of ever-changing sizes stay in the heap as fragments; a lower
  ``M_MMAP_THRESHOLD`` serves blocks from 64 kB up by ``mmap`` (returned to the system when freed) and
  ``M_TRIM_THRESHOLD`` returns the top of the heap sooner.

Measured on the 2-core AVX512-BF16 box (issue 35; ``bench/serve_memory.py`` through the HTTP server, and the MiniLM
encoder alone over 1,600 batches of 1-16 texts of 4-128 tokens): bf16 grew 1,330 -> 1,750 MB over the last three
quarters and still rose (the issue's campaign: 0.72 -> 2.16 GB over 7,200 requests); with a cache of 128 primitives
and the heap settings it stayed at 894-898 MB, with 16 at 864-867 MB. fp32 grew too, more slowly (489 -> 1,154 MB
over 2,000 batches unbounded; 489 -> 522 MB with the heap settings). The costs are in docs/benchmarks.md.

Without glibc (musl, macOS) the heap part is skipped; a value the operator set in the environment is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["bound_native_memory", "PRIMITIVE_CACHE", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

PRIMITIVE_CACHE = 128
MMAP_THRESHOLD = 64 * 1024
TRIM_THRESHOLD = 128 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def bound_native_memory(primitive_cache: int = PRIMITIVE_CACHE) -> dict:
    """Bound oneDNN's primitive cache (unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is set already) and glibc's heap
    growth for this process; returns what was applied. Call it before the model's first forward pass."""
    applied: dict = {}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(primitive_cache)
    applied["onednn_primitive_cache"] = int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
            applied.update(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    logger.debug("native memory bounds: %s", applied)
    return applied


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: mallopt's parameters differ elsewhere
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc
