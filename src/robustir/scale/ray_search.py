"""Dense search for Ray mining. Exact, with the corpus split among Ray actors (``robustir mine --method dense
--engine ray --ray-search-shards N``): for a corpus whose vectors do not fit one machine's memory; approximate, on a
Lance index lance-ray builds (``--ray-lance-index IVF_PQ``, :class:`LanceIvfIndex`).

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

Why FAISS in actors and not Lance's or lance-ray's exact search (measured with ``bench/lance_search.py``: 20k
random 384-dim unit vectors, top 105, 2 shared cores at load 5-11, pylance 14.0.2, lance-ray 0.5.0):

* Lance's exact ``to_table(nearest=..., metric="dot")`` takes one query vector a call: 14.6-17.3 ms a query against
  1.0-1.5 ms for ``faiss.knn`` over a batch of 100 (x10-15), and its scores differ from FAISS's by up to 3.6e-7, so
  near-tied candidates can swap and the negatives are no longer byte-identical to one process's;
* lance-ray's ``vector_search`` also takes one query a call, and starts a Ray pool, pickles the dataset and reads
  every vector through Python lists (``to_pylist``) for each: 6.4-7.7 s a query (x5000). Its flat fallback returns
  ``-ip`` as the dot distance where Lance's index returns ``1 - ip``, so a half-indexed dataset would merge two scales.

For the approximate search, :class:`LanceIvfIndex` does use them: lance-ray's distributed ``create_index`` builds an
IVF_PQ (or IVF_HNSW_PQ) index over the Ray encoding's Lance dataset, and Lance's ``nearest`` searches it (13.6 ms a
query on the same 20k, in the driver, which never holds the corpus's vectors).

Why actors and not ``map_batches``: a Ray Data batch goes to one actor, but with the corpus split every query batch
must meet every shard; the actors are plain Ray actors, restarted by Ray when killed (they read their shard again)
and their calls retried, as :class:`~robustir.scale.ray_encode.RayEncoderPool`'s are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["LanceIvfIndex", "RayShardedFlatIndex", "lance_dataset_of", "shard_bounds"]


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


#: Lance's IVF search reranks this many times ``k`` PQ candidates by their exact vectors (``refine_factor``)
REFINE_FACTOR = 10


class LanceIvfIndex:
    """Approximate inner-product search on a Lance vector index (``mine --engine ray --ray-lance-index IVF_PQ``):
    the index is built by lance-ray's distributed ``create_index`` (Ray tasks train and write one segment each)
    over the Lance dataset the Ray encoding wrote, and searched with Lance's own ``nearest`` (``nprobes`` cells,
    the ``k * REFINE_FACTOR`` best PQ candidates reranked by their exact vectors). The driver reads the index and
    the candidates' vectors, never the corpus's. The interface of :class:`~robustir.index.dense.ChunkedFlatIndex`.

    Why Lance's ``nearest`` in the driver and not lance-ray's ``vector_search``: ``vector_search`` takes one query
    per call and starts a Ray pool and pickles the dataset for each (measured 6.8 s a query on 20k vectors against
    13 ms for ``nearest``, 2 cores, load 3-7; ``bench/lance_search.py``), and mining asks thousands of queries.
    """

    def __init__(self, uri: str, kind: str, size: int, dim: int, *, nlist: int | None = None, nprobe: int = 32,
                 workers: int = 2, address: str | None = None) -> None:
        import lance
        import lance_ray

        from .ray_encode import _init_ray, require_scale_extra

        require_scale_extra("ray_lance_index")
        partitions = min(nlist or max(1, int(4 * np.sqrt(size))), size // 2)
        # Lance trains IVF on partitions * sample_rate rows and PQ's 256 centroids on 256 * sample_rate
        sample = min(256, size // 256, size // max(partitions, 1))
        if sample < 2:
            raise ConfigError(f"ray_lance_index {kind}: {size} corpus vectors are too few to train {partitions} "
                              "cells and product quantization (at least 512, and 2 per cell); lower nlist or leave "
                              "ray_lance_index unset for the exact search")
        name = f"robustir_{kind.lower()}_{partitions}"
        self.uri, self.size, self.nprobe = uri, size, nprobe
        from .job import OutputJob

        with OutputJob(uri).lock(wait=True):  # miners sharing the cache build it once
            if name not in {index.name for index in lance.dataset(uri).describe_indices()}:
                _init_ray(address)
                lance_ray.create_index(uri, "vector", kind, name=name, metric="dot", num_workers=workers,
                                       num_partitions=partitions, sample_rate=sample,
                                       num_sub_vectors=max(1, dim // 8) if dim % 8 == 0 else dim)
        self.dataset = lance.dataset(uri)
        self.backend = f"lance-{kind.lower()} (lance-ray create_index, {partitions} cells, nprobe {nprobe})"

    def search(self, queries: np.ndarray, k: int = 100) -> tuple[np.ndarray, np.ndarray]:
        """The top ``k`` of each query in :func:`~robustir.index.dense.sort_hits` order (rows -1 where the index
        found fewer than ``k``)."""
        from ..index.dense import TIE_MARGIN, sort_hits

        k = min(int(k), self.size)
        keep = min(k + TIE_MARGIN, self.size)
        scores = np.full((len(queries), keep), -np.inf, np.float32)
        rows = np.full((len(queries), keep), -1, np.int64)
        for i, query in enumerate(np.asarray(queries, dtype=np.float32)):
            found = self.dataset.to_table(columns=["id"], nearest={
                "column": "vector", "q": query, "k": keep, "metric": "dot", "nprobes": self.nprobe,
                "refine_factor": REFINE_FACTOR})
            n = found.num_rows
            rows[i, :n] = np.asarray([int(v) for v in found.column("id").to_pylist()], dtype=np.int64)
            scores[i, :n] = 1.0 - np.asarray(found.column("_distance"), dtype=np.float32)  # Lance's dot: 1 - ip
        scores, rows = sort_hits(scores, rows, k)
        return np.ascontiguousarray(scores), np.ascontiguousarray(rows)

    def close(self) -> None:
        pass


def lance_dataset_of(embeddings: Any, uri: str) -> str:
    """The Lance dataset of the corpus vectors at ``uri`` (ids = row numbers, ``%012d``), written from the
    :class:`~robustir.index.dense.EmbeddingFile` a chunk at a time when it is not there (the vectors came from the
    process engine's cache); the Ray encoding writes it itself."""
    import lance
    import pyarrow as pa

    if os.path.isdir(uri):
        return uri
    n, dim = embeddings.shape
    schema = pa.schema([("id", pa.string()), ("vector", pa.list_(pa.float32(), dim))])

    def chunks():
        for start in range(0, n, 65536):
            block = embeddings.rows(start, min(n, start + 65536))
            yield pa.record_batch([pa.array([f"{i:012d}" for i in range(start, start + len(block))]),
                                   pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), dim)],
                                  schema=schema)
    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, chunks()), uri + ".partial", schema=schema,
                        mode="overwrite")
    os.replace(uri + ".partial", uri)
    return uri
