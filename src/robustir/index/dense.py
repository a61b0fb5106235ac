"""Dense search with FAISS: exact inner product by default, IVF or HNSW for corpora too big for it.

Vectors are L2-normalised by the encoder, so inner product = cosine similarity.

Where the search runs follows the stage's device (:mod:`robustir.device`; ``DenseIndex(config, device=...)``):

* ``cpu``: FAISS on the CPU;
* a GPU, with a FAISS build that has GPU support (``faiss.StandardGpuResources``): flat and IVF indexes on that
  GPU (HNSW has no GPU version: it stays on the CPU). FAISS-GPU returns at most 2048 neighbours; a flat search
  asked for more uses the torch search below;
* a GPU, with a CPU-only FAISS: a flat index becomes an exact top-k in torch on the GPU
  (:func:`exact_search_torch`: the query batch times one corpus chunk at a time, a running top-k merged per
  chunk, so memory stays bounded; the corpus is held on the GPU when it takes at most a quarter of the free
  memory, else streamed from the CPU chunk by chunk); IVF and HNSW stay on the CPU.

Corpora whose vectors should not sit in memory (:class:`EmbeddingFile`: a ``.npy`` file read a range of rows at a
time): :class:`ChunkedFlatIndex` is the flat search run one chunk of rows at a time with a running top-k (memory:
one chunk, whatever the corpus size; scores bit-identical to a flat FAISS index on the CPU), and
:meth:`DenseIndex.index_file` builds an IVF or HNSW index by adding one chunk at a time (the index itself holds every
vector: ``n x d x 4`` bytes, plus the HNSW graph).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np

from ..errors import ConfigError
from ..validation import cli, config_dataclass, PositiveInt

logger = logging.getLogger(__name__)

IndexKind = Literal["flat", "ivf", "hnsw"]


@config_dataclass
class DenseIndexConfig:
    kind: Annotated[IndexKind, cli("index")] = "flat"
    """FAISS index: exact inner product (flat) or approximate for large corpora."""
    nlist: PositiveInt | None = None
    """IVF cells; default 4*sqrt(n)"""
    nprobe: PositiveInt = 32
    """IVF cells searched."""
    hnsw_m: PositiveInt = 32
    """hnsw: graph neighbours per vector."""
    ef_search: PositiveInt = 256
    """hnsw: candidates searched per query."""
    use_gpu: bool = False
    """Deprecated: the stage's --device decides; true = device cuda where none is given."""


FAISS_GPU_MAX_K = 2048  # FAISS-GPU's limit on k (and nprobe)


def faiss_has_gpu() -> bool:
    """Whether the installed FAISS was built with GPU support and sees a GPU."""
    import faiss

    if not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        return faiss.get_num_gpus() > 0
    except Exception:  # a GPU build without a usable driver
        return False


class DenseIndex:
    """A FAISS index over row vectors; ``search`` returns (scores, row indices), both ``(nq, k)``.

    ``device`` (a :class:`torch.device` or a spec such as ``"cuda:1"``; see the module docstring) says where the
    search runs; None = the CPU (or ``cuda`` with the deprecated ``config.use_gpu``).
    """

    def __init__(self, config: DenseIndexConfig | None = None, device=None) -> None:
        from ..device import resolve_device

        self.config = config or DenseIndexConfig()
        if device is None:
            device = "cuda" if self.config.use_gpu else "cpu"
        elif self.config.use_gpu and str(device) == "cpu":
            logger.warning("index.use_gpu is ignored: the device is cpu (set --device to choose where search runs)")
        self.device = resolve_device(device)
        self._index = None
        self._vectors: np.ndarray | None = None
        self._torch: "TorchFlatIndex | None" = None
        self.backend = ""  # faiss-cpu, faiss-gpu or torch (after index())
        self.size = 0

    def index(self, vectors: np.ndarray) -> "DenseIndex":
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, d = vectors.shape
        kind = self.config.kind
        on_gpu = self.device.type == "cuda"
        if on_gpu and kind == "flat" and not faiss_has_gpu():
            self._torch = TorchFlatIndex(vectors, self.device)
            self._vectors, self.size, self.backend = vectors, n, "torch"
            logger.info("dense search: exact top-k in torch on %s (this FAISS has no GPU support)", self.device)
            return self
        index = self._faiss_index(n, d, lambda rows: vectors[rows])
        index.add(vectors)
        self._index = index
        self._vectors = vectors if self.backend == "faiss-gpu" and kind == "flat" else None
        self.size = n
        return self

    def index_file(self, vectors: "EmbeddingFile", chunk_rows: int = 65536) -> "DenseIndex":
        """:meth:`index` over the vectors of a file, added ``chunk_rows`` at a time, so only the index holds them
        (IVF is trained on the same sample :meth:`index` draws). A flat index is :meth:`index` of the whole file."""
        if self.config.kind == "flat":
            return self.index(vectors.load())
        n, d = vectors.shape
        index = self._faiss_index(n, d, lambda rows: vectors.take(rows, chunk_rows))
        for start in range(0, n, chunk_rows):
            index.add(vectors.rows(start, start + chunk_rows))
        self._index, self._vectors, self.size = index, None, n
        return self

    def _faiss_index(self, n: int, d: int, sample_rows: Callable[[np.ndarray], np.ndarray]):
        """An empty (IVF: trained) FAISS index of this config's kind, on the GPU where it goes there; sets
        :attr:`backend`. ``sample_rows(rows)`` returns those rows of the vectors (IVF training)."""
        import faiss

        kind = self.config.kind
        on_gpu = self.device.type == "cuda"
        if kind == "flat":
            index = faiss.IndexFlatIP(d)
        elif kind == "ivf":
            nlist = self.config.nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
            quantizer = faiss.IndexFlatIP(d)
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
            rng = np.random.default_rng(0)
            sample = sample_rows(rng.choice(n, size=min(n, nlist * 256), replace=False))
            index.train(sample)
            index.nprobe = min(self.config.nprobe, nlist)
        elif kind == "hnsw":
            index = faiss.IndexHNSWFlat(d, self.config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efSearch = self.config.ef_search
        else:
            raise ConfigError(f"index kind must be flat, ivf or hnsw; got {kind!r}")
        self.backend = "faiss-cpu"
        if on_gpu and kind != "hnsw" and faiss_has_gpu():
            self._gpu_resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_resources, self.device.index or 0, index)
            self.backend = "faiss-gpu"
        elif on_gpu:
            logger.info("dense search: %s index on the CPU (%s)", kind,
                        "FAISS has no GPU HNSW" if kind == "hnsw" else "this FAISS has no GPU support")
        return index

    def search(self, queries: np.ndarray, k: int = 100, batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None and self._torch is None:
            raise RuntimeError("DenseIndex.search called before index()")
        k = min(k, self.size)
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if self._torch is None and self.backend == "faiss-gpu" and k > FAISS_GPU_MAX_K and self._vectors is not None:
            logger.info("dense search: k = %d is above FAISS-GPU's %d: exact top-k in torch on %s", k,
                        FAISS_GPU_MAX_K, self.device)
            self._torch = TorchFlatIndex(self._vectors, self.device)
        if self._torch is not None and (self.backend == "torch" or k > FAISS_GPU_MAX_K):
            return self._torch.search(queries, k)
        scores = np.empty((len(queries), k), dtype=np.float32)
        indices = np.empty((len(queries), k), dtype=np.int64)
        for start in range(0, len(queries), batch_size):
            s, i = self._index.search(queries[start:start + batch_size], k)
            scores[start:start + batch_size] = s
            indices[start:start + batch_size] = i
        return scores, indices


# ------------------------------------------------------------------------------------- exact search in torch

def exact_search_torch(corpus, queries, k: int, device=None, *, query_batch: int = 1024,
                       corpus_chunk: int | None = None, budget_bytes: int = 256 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-``k`` of each query over ``corpus`` rows, with torch on ``device``: (scores, rows).

    ``corpus`` (``(n, d)``, a numpy array or a tensor, on any device) is scored one chunk of ``corpus_chunk`` rows
    at a time against ``query_batch`` queries; each chunk's top-k is merged into a running top-k, so the score
    matrix never exceeds ``query_batch x corpus_chunk`` floats (``corpus_chunk`` default: ``budget_bytes`` worth).
    Chunks not on ``device`` are copied there one at a time. Results are sorted by descending score; ``k`` is capped
    at ``n``. Equal to FAISS's flat inner-product search up to the order of exact ties and float rounding.
    """
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    corpus_t = corpus if isinstance(corpus, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(corpus,
                                                                                                    dtype=np.float32))
    queries_np = np.ascontiguousarray(queries, dtype=np.float32)
    n = int(corpus_t.shape[0])
    nq = len(queries_np)
    k = min(int(k), n)
    scores_out = np.empty((nq, k), dtype=np.float32)
    rows_out = np.empty((nq, k), dtype=np.int64)
    if nq == 0 or k == 0:
        return scores_out, rows_out
    chunk = corpus_chunk or max(k, budget_bytes // (4 * max(1, min(query_batch, nq))))
    chunk = max(1, int(chunk))
    with torch.inference_mode():
        for start in range(0, nq, query_batch):
            q = torch.from_numpy(queries_np[start:start + query_batch]).to(device, non_blocking=True)
            best_scores = best_rows = None
            for c0 in range(0, n, chunk):
                block = corpus_t[c0:c0 + chunk].to(device, dtype=torch.float32, non_blocking=True)
                scores = q @ block.T
                top = min(k, scores.shape[1])
                s, r = torch.topk(scores, top, dim=1)
                r = r + c0
                if best_scores is not None:
                    s = torch.cat([best_scores, s], dim=1)
                    r = torch.cat([best_rows, r], dim=1)
                    s, pick = torch.topk(s, min(k, s.shape[1]), dim=1)
                    r = torch.gather(r, 1, pick)
                best_scores, best_rows = s, r
            scores_out[start:start + len(q)] = best_scores.float().cpu().numpy()
            rows_out[start:start + len(q)] = best_rows.cpu().numpy()
    return scores_out, rows_out


class TorchFlatIndex:
    """Exact inner-product search in torch on ``device`` (:func:`exact_search_torch`). On a GPU the corpus is
    copied there once when it takes at most a quarter of the free memory; otherwise it stays on the CPU (pinned)
    and is streamed chunk by chunk at every search."""

    def __init__(self, vectors: np.ndarray, device) -> None:
        import torch

        self.device = torch.device(device)
        corpus = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if corpus.numel() * 4 <= free // 4:
                corpus = corpus.to(self.device)
            else:
                logger.info("dense search: the corpus (%.1f GiB) is streamed to %s chunk by chunk",
                            corpus.numel() * 4 / 2**30, self.device)
                corpus = corpus.pin_memory()
        self.corpus = corpus

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return exact_search_torch(self.corpus, queries, k, self.device)


# ------------------------------------------------------------------------------ vectors in a file, searched by chunk

#: extra hits fetched past the k-th so that exact ties at the k-th place are settled by row (:func:`sort_hits`), not
#: by how a search happened to meet them (FAISS keeps whichever tied row its heap or reservoir leaves)
TIE_MARGIN = 16


def sort_hits(scores: np.ndarray, rows: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's hits by descending score, equal scores by ascending row, cut to the first ``k``: one order for
    exact ties, whichever search found them. Searched with ``k + TIE_MARGIN`` hits, the top ``k`` are then "the
    ``k`` best, ties to the lowest rows" unless more than ``TIE_MARGIN`` rows tie at the k-th place."""
    order = np.lexsort((rows, -scores), axis=-1)[..., :k]
    return np.take_along_axis(scores, order, -1), np.take_along_axis(rows, order, -1)


class EmbeddingFile:
    """Row vectors in a ``.npy`` file (2-D float32, C order), read a range of rows at a time.

    Reads are plain file reads into fresh arrays, not a memory map: the pages of a map stay in the process's
    resident memory once touched, so scanning a mapped 1.5 GB file would count 1.5 GB; a read costs only the rows
    asked for. :meth:`create` makes an empty file of a given shape to fill with :meth:`write`.
    """

    def __init__(self, path: str | Path, *, writable: bool = False) -> None:
        self.path = Path(path)
        mapped = np.load(self.path, mmap_mode="r")  # the header only: shape, dtype, where the data starts
        if mapped.ndim != 2 or mapped.dtype != np.float32 or not mapped.flags.c_contiguous:
            raise ConfigError(f"{self.path}: expected a 2-D float32 array in C order, got {mapped.dtype} "
                              f"{mapped.shape}; delete the file so it is made again")
        self.shape: tuple[int, int] = (int(mapped.shape[0]), int(mapped.shape[1]))
        self._offset = int(mapped.offset)
        del mapped
        self._fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    @classmethod
    def create(cls, path: str | Path, rows: int, dim: int) -> "EmbeddingFile":
        """A new file of ``rows x dim`` zeros (sparse on disk until written), open for :meth:`write`."""
        np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim)).flush()  # header + size
        return cls(path, writable=True)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def dim(self) -> int:
        return self.shape[1]

    def close(self) -> None:
        self._finalizer()

    def _row_bytes(self) -> int:
        return self.shape[1] * 4

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start`` to ``stop`` (clipped to the file) as a new ``(m, d)`` array."""
        start, stop = max(0, start), min(stop, self.shape[0])
        out = np.empty((max(0, stop - start), self.shape[1]), dtype=np.float32)
        view = memoryview(out).cast("B")
        done, position = 0, self._offset + start * self._row_bytes()
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], position + done)
            if got <= 0:
                raise ConfigError(f"{self.path} is shorter than its header says (cut short?); delete it so it is "
                                  "made again")
            done += got
        return out

    def take(self, rows: np.ndarray, chunk_rows: int = 65536, max_gap: int = 64) -> np.ndarray:
        """The given rows, in the given order. Rows are read in runs of nearby rows (no more than ``max_gap``
        apart, and at most ``chunk_rows`` long), so a few scattered rows cost a few small reads."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.shape[1]), dtype=np.float32)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        position = 0
        while position < len(ordered):
            start = end = position
            while end + 1 < len(ordered) and ordered[end + 1] - ordered[end] <= max_gap \
                    and ordered[end + 1] - ordered[start] < chunk_rows:
                end += 1
            first = int(ordered[start])
            block = self.rows(first, int(ordered[end]) + 1)
            out[order[start:end + 1]] = block[ordered[start:end + 1] - first]
            position = end + 1
        return out

    def load(self) -> np.ndarray:
        """Every row, in memory."""
        return self.rows(0, self.shape[0])

    def write(self, start: int, vectors: np.ndarray) -> None:
        """Write ``vectors`` as rows ``start`` onwards (a file from :meth:`create`)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.shape[1] or start + len(vectors) > self.shape[0]:
            raise ValueError(f"rows {start}..{start + len(vectors)} of width {vectors.shape[-1]} do not fit "
                             f"{self.shape}")
        data = memoryview(vectors).cast("B")
        done, position = 0, self._offset + start * self._row_bytes()
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], position + done)

    def flush(self) -> None:
        os.fsync(self._fd)


class ChunkedFlatIndex:
    """Exact inner-product search over an :class:`EmbeddingFile`, ``chunk_rows`` rows at a time, each chunk's
    top-k merged into a running top-k (:func:`sort_hits` order): memory is one chunk of vectors and its scores,
    whatever the corpus size. On the CPU each chunk is searched with ``faiss.knn`` -- the kernel of a flat
    FAISS index -- and ``chunk_rows`` is rounded up to a multiple of FAISS's database block (1024 rows): FAISS
    scores a corpus in blocks of that many rows, and its BLAS kernels round a block's scores differently when the
    block starts elsewhere, so aligned chunks make the very same calls as a whole-corpus search and the scores are
    bit-identical to :class:`DenseIndex` flat. On a GPU chunks go through :func:`exact_search_torch`. The file is
    read once per :meth:`search` call: pass queries in large batches."""

    def __init__(self, vectors: EmbeddingFile, chunk_rows: int, device=None) -> None:
        import faiss
        import torch

        if chunk_rows < 1:
            raise ConfigError(f"corpus chunk = {chunk_rows!r} is out of range: it must be >= 1 (rows per chunk)")
        self.vectors = vectors
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        block = int(getattr(faiss.cvar, "distance_compute_blas_database_bs", 1024)) if self.device.type == "cpu" else 1
        self.chunk_rows = -(-int(chunk_rows) // block) * block
        self.size = len(vectors)
        self.backend = "chunked-faiss-cpu" if self.device.type == "cpu" else "chunked-torch"

    def search(self, queries: np.ndarray, k: int = 100) -> tuple[np.ndarray, np.ndarray]:
        """The top ``k`` of each query in :func:`sort_hits` order (each chunk searched to ``k + TIE_MARGIN``)."""
        import faiss

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(int(k), self.size)
        best_scores = np.empty((len(queries), 0), dtype=np.float32)
        best_rows = np.empty((len(queries), 0), dtype=np.int64)
        if len(queries) == 0 or k == 0:
            return best_scores, best_rows
        keep = k + TIE_MARGIN
        for start in range(0, self.size, self.chunk_rows):
            block = self.vectors.rows(start, start + self.chunk_rows)
            top = min(keep, len(block))
            if self.device.type == "cpu":
                scores, rows = faiss.knn(queries, block, top, metric=faiss.METRIC_INNER_PRODUCT)
            else:
                scores, rows = exact_search_torch(block, queries, top, self.device)
            best_scores, best_rows = sort_hits(np.concatenate([best_scores, scores], axis=1),
                                               np.concatenate([best_rows, rows.astype(np.int64) + start], axis=1),
                                               keep)
        return np.ascontiguousarray(best_scores[:, :k]), np.ascontiguousarray(best_rows[:, :k])
