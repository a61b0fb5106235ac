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
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..errors import ConfigError
from ..validation import Checked, PositiveInt

logger = logging.getLogger(__name__)

IndexKind = Literal["flat", "ivf", "hnsw"]


@dataclass
class DenseIndexConfig(Checked):
    kind: IndexKind = "flat"  # FAISS index: exact inner product (flat) or approximate for large corpora
    nlist: PositiveInt | None = None  # IVF cells; default 4*sqrt(n)
    nprobe: PositiveInt = 32  # IVF cells searched
    hnsw_m: PositiveInt = 32
    ef_search: PositiveInt = 256
    use_gpu: bool = False  # deprecated: the stage's --device decides; true = device cuda where none is given


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
        import faiss

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, d = vectors.shape
        kind = self.config.kind
        on_gpu = self.device.type == "cuda"
        if on_gpu and kind == "flat" and not faiss_has_gpu():
            self._torch = TorchFlatIndex(vectors, self.device)
            self._vectors, self.size, self.backend = vectors, n, "torch"
            logger.info("dense search: exact top-k in torch on %s (this FAISS has no GPU support)", self.device)
            return self
        if kind == "flat":
            index = faiss.IndexFlatIP(d)
        elif kind == "ivf":
            nlist = self.config.nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
            quantizer = faiss.IndexFlatIP(d)
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
            rng = np.random.default_rng(0)
            sample = vectors[rng.choice(n, size=min(n, nlist * 256), replace=False)]
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
        index.add(vectors)
        self._index = index
        self._vectors = vectors if self.backend == "faiss-gpu" and kind == "flat" else None
        self.size = n
        return self

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
