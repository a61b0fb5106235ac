"""Dense search with FAISS: exact inner product by default, IVF or HNSW for corpora too big for it.

Vectors are L2-normalised by the encoder, so inner product = cosine similarity.
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
    use_gpu: bool = False  # only when faiss was built with GPU support


class DenseIndex:
    """A FAISS index over row vectors; ``search`` returns (scores, row indices), both ``(nq, k)``."""

    def __init__(self, config: DenseIndexConfig | None = None) -> None:
        self.config = config or DenseIndexConfig()
        self._index = None
        self.size = 0

    def index(self, vectors: np.ndarray) -> "DenseIndex":
        import faiss

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, d = vectors.shape
        kind = self.config.kind
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
        if self.config.use_gpu:
            if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
                logger.warning("use_gpu requested but this faiss build has no GPU; searching on CPU")
            else:
                self._gpu_resources = faiss.StandardGpuResources()
                index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)
        index.add(vectors)
        self._index = index
        self.size = n
        return self

    def search(self, queries: np.ndarray, k: int = 100, batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None:
            raise RuntimeError("DenseIndex.search called before index()")
        k = min(k, self.size)
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        scores = np.empty((len(queries), k), dtype=np.float32)
        indices = np.empty((len(queries), k), dtype=np.int64)
        for start in range(0, len(queries), batch_size):
            s, i = self._index.search(queries[start:start + batch_size], k)
            scores[start:start + batch_size] = s
            indices[start:start + batch_size] = i
        return scores, indices
