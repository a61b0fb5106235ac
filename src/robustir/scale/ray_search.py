"""Exact dense search with the corpus split among Ray actors (``robustir mine --method dense --engine ray
--ray-search-shards N``): for a corpus whose vectors do not fit one machine's memory.

Each actor holds one contiguous shard of the corpus's embedding file (rows ``[start, stop)``, read once from the
``.npy`` file every node sees) and searches it with ``faiss.knn`` -- the kernel of a flat FAISS index. Every batch of
query vectors goes to every shard (one ``ray.put``), each answers its ``k + TIE_MARGIN`` best with global row
numbers, and the driver merges them in :func:`~robustir.index.dense.sort_hits` order. Shards start on multiples of
FAISS's database block (1024 rows), so each shard makes the very calls a whole-corpus search makes on those rows
(what :class:`~robustir.index.dense.ChunkedFlatIndex` does with chunks of a file, done here with chunks in actors):
with the same FAISS thread count the scores are bit-identical to :class:`~robustir.index.dense.DenseIndex` flat in
one process. An actor of 1 CPU runs FAISS on 1 thread, and FAISS's BLAS rounds the last bit differently with the
thread count: measured on 20k SciFact-domain passages and 809 queries, the same negative ids for every query and
scores at most 3.6e-7 apart from a 2-thread driver, bit-identical with ``faiss.omp_set_num_threads(1)`` there.

Why actors and not ``map_batches``: a Ray Data batch goes to one actor, but with the corpus split every query batch
must meet every shard; the actors are plain Ray actors, restarted by Ray when killed (they read their shard again)
and their calls retried, as :class:`~robustir.scale.ray_encode.RayEncoderPool`'s are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["RayShardedFlatIndex", "shard_bounds"]


def shard_bounds(rows: int, shards: int, block: int = 1024) -> list[tuple[int, int]]:
    """``shards`` contiguous ranges covering ``rows`` rows, each starting on a multiple of ``block`` (fewer ranges
    when the corpus has fewer blocks than shards)."""
    if shards < 1:
        raise ConfigError(f"search shards = {shards!r} is out of range: it must be >= 1")
    blocks = -(-rows // block)
    edges = sorted({min(rows, int(b) * block) for b in np.linspace(0, blocks, min(shards, max(blocks, 1)) + 1)
                    .round().astype(int)})
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class _ShardActor:
    """One shard of the corpus vectors, searched exactly."""

    def __init__(self, path: str, start: int, stop: int) -> None:
        from ..index.dense import EmbeddingFile

        self.start = start
        self.vectors = np.ascontiguousarray(EmbeddingFile(path).rows(start, stop), dtype=np.float32)

    def search(self, queries: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        top = min(keep, len(self.vectors))
        scores, rows = faiss.knn(np.ascontiguousarray(queries, dtype=np.float32), self.vectors, top,
                                 metric=faiss.METRIC_INNER_PRODUCT)
        return scores, rows.astype(np.int64) + self.start

    def rows(self) -> int:
        return len(self.vectors)


class RayShardedFlatIndex:
    """Exact inner-product search over an :class:`~robustir.index.dense.EmbeddingFile` split among ``shards`` Ray
    actors (see the module docstring); the interface of :class:`~robustir.index.dense.ChunkedFlatIndex`."""

    def __init__(self, vectors: Any, shards: int, *, address: str | None = None, num_cpus: float = 1.0) -> None:
        import ray

        from .ray_encode import _init_ray, require_scale_extra

        require_scale_extra("engine: ray")
        _init_ray(address)
        self.size = len(vectors)
        self.bounds = shard_bounds(self.size, shards)
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if len(self.bounds) * num_cpus > cpus:  # the actors would wait for CPUs forever: say so instead
            raise ConfigError(f"ray_search_shards: {len(self.bounds)} search actors of {num_cpus:g} CPU each need "
                              f"{len(self.bounds) * num_cpus:g} CPUs, and the Ray cluster has {cpus:g}; set "
                              f"--ray-search-shards to {max(1, int(cpus // num_cpus))} or fewer, or add nodes")
        remote = ray.remote(num_cpus=num_cpus, max_restarts=-1, max_task_retries=-1)(_ShardActor)
        path = str(Path(vectors.path).resolve())
        self.actors = [remote.remote(path, a, b) for a, b in self.bounds]
        try:
            held = ray.get([actor.rows.remote() for actor in self.actors])  # loaded (and a bad file fails) here
        except ray.exceptions.RayError as error:  # a shard that cannot be read: say which file and why, once
            self.close()
            detail = (str(error).strip().splitlines() or [type(error).__name__])[-1]  # the actor's own exception
            raise ConfigError(f"ray_search_shards: a search actor could not read the corpus vectors {path}: "
                              f"{detail}. Every node reads that file: set --cache-dir to a folder every node sees "
                              "(NFS, a shared volume)") from None
        if sum(held) != self.size:
            self.close()
            raise ConfigError(f"the search shards hold {sum(held)} of {self.size} corpus vectors")
        self.backend = f"ray-sharded-faiss-cpu ({len(self.actors)} shards)"

    def search(self, queries: np.ndarray, k: int = 100) -> tuple[np.ndarray, np.ndarray]:
        """The top ``k`` of each query in :func:`~robustir.index.dense.sort_hits` order."""
        import ray

        from ..index.dense import TIE_MARGIN, sort_hits

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(int(k), self.size)
        if len(queries) == 0 or k == 0:
            return np.empty((len(queries), 0), np.float32), np.empty((len(queries), 0), np.int64)
        shared = ray.put(queries)
        parts = ray.get([actor.search.remote(shared, k + TIE_MARGIN) for actor in self.actors])
        scores, rows = sort_hits(np.concatenate([p[0] for p in parts], axis=1),
                                 np.concatenate([p[1] for p in parts], axis=1), k)
        return np.ascontiguousarray(scores), np.ascontiguousarray(rows)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
