"""The index's settings and answers: :class:`IndexConfig`, :class:`AnnConfig`, :class:`Hit`, :class:`IndexReport`,
and the names of its files."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, Callable, Literal, Protocol

import numpy as np

from ...errors import ConfigError
from ...precision import Precision
from ...validation import PositiveInt, Range, cli, config_dataclass

logger = logging.getLogger(__name__)


FORMAT = "robustir-lance-2"


MANIFEST, BUILDING, DATA, TABLE, LOCK = "manifest.json", "building.json", "lance", "docs", "writer.lock"


#: how long the data folder an ``--overwrite`` replaced stays on disk: a reader that started a query before the swap
#: finishes it on the old folder (each new query re-reads the manifest and moves to the new one)
RETIRED_KEEP = timedelta(minutes=10)


SearchMode = Literal["dense", "lexical", "hybrid"]


InputFormat = Literal["auto", "jsonl", "text", "beir"]


@config_dataclass
class AnnConfig:
    """The vector index: exact search below ``threshold`` documents, an ANN index from there on."""

    kind: Annotated[Literal["auto", "exact", "ivf_hnsw_sq", "ivf_pq"], cli("ann")] = "exact"
    """exact (default): never an ANN index; auto: ivf_hnsw_sq from ``threshold`` documents, exact below. Measured
    (docs/benchmarks.md): at 100k real MiniLM passages, 20 of 316 partitions keep recall@10 0.977 at 10.7 ms against
    exact's 33 ms; exact stays the default, fast enough on one box at that size."""
    threshold: Annotated[PositiveInt, cli("ann-threshold")] = 100_000
    """Documents from which ``auto`` builds the ANN index (exact search is fast enough below)."""
    nprobes: PositiveInt = 20
    """IVF partitions searched per query (more: higher recall, slower)."""
    refine_factor: PositiveInt | None = 10
    """Re-score this many times top_k candidates with the full vectors (None: no re-scoring)."""


@config_dataclass
class IndexConfig:
    """How ``robustir index`` builds: the vector index, the encoding and the commit granularity."""

    chunk_size: PositiveInt = 1024
    """Documents encoded and committed together (a killed build loses at most one)"""
    batch_size: PositiveInt = 64
    """Encoding batch size."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    device: str = "auto"
    """Where the model runs: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""
    format: InputFormat = "auto"
    """Corpus format: auto (by suffix: .jsonl = records, else text), jsonl, text, beir."""
    show_progress: bool | None = None
    """Show progress bars."""
    engine: Literal["process", "ray"] = "process"
    """Where the documents are encoded: this process, or Ray actors (robustir[scale]; docs/scale.md); the chunks are
    committed and resumed by the index either way."""
    ray_address: str | None = None
    """engine ray: the cluster to join (ray://head:10001, auto); None: a local Ray session."""
    ray_actors: PositiveInt = 1
    """engine ray: encoder actors (one model load each); each chunk is split among them."""
    ray_gpus: Annotated[float, Range(ge=0.0)] = 0.0
    """engine ray: GPUs per actor (0: CPU actors)."""
    ann: Annotated[AnnConfig, cli(flatten=True)] = field(default_factory=AnnConfig)
    """The vector index (exact or ANN); set when the index is built, kept in its manifest."""


@dataclass
class Hit:
    """One search result: the document's id, its score (inner product; cosine for normalised models), title, text
    and extra fields."""

    id: str
    score: float
    title: str
    text: str
    fields: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class IndexReport:
    """What a build / add / delete did."""

    action: str
    documents: int = 0  # documents in the index afterwards
    added: int = 0
    resumed_from: int = 0  # input records an earlier, interrupted run had already committed
    skipped_empty: int = 0
    deleted: int = 0
    seconds: float = 0.0
    nothing_to_do: bool = False
    summary: str = ""  # the index afterwards (SearchIndex.summary), set by the index step

    def format(self) -> str:
        if self.nothing_to_do:
            return f"{self.action}: nothing to do; the index holds {self.documents} documents"
        parts = [f"{self.action}: {self.documents} documents in the index"]
        if self.added:
            parts.append(f"{self.added} {'inserted or replaced' if self.action == 'upsert' else 'added'}")
        if self.resumed_from:
            parts.append(f"resumed after {self.resumed_from} input records")
        if self.skipped_empty:
            parts.append(f"{self.skipped_empty} empty records skipped")
        if self.deleted:
            parts.append(f"{self.deleted} deleted")
        return ", ".join(parts) + f" ({self.seconds:.1f} s)"


class EncoderPool(Protocol):
    """Encoders beside this process that a job's chunks are split among (``engine`` other than ``process``), e.g.
    :class:`robustir.scale.ray_encode.RayEncoderPool`; the index commits and resumes the chunks either way."""

    def encode(self, texts: list[str], kind: str, *, batch_size: int, precision: str) -> np.ndarray: ...

    def close(self) -> None: ...

    # optional: ``build_vector_index(uri, storage_options, kind, partitions, rows) -> bool`` builds the job's ANN
    # index (``kind`` ivf_hnsw_sq or ivf_pq, on the Lance dataset ``uri`` of ``rows`` rows) where the pool's workers
    # run, after :meth:`close`; False: it did not, the index builds it itself


#: makes the pool of one job from the index's encoder and the job's config: what the caller gives the index for
#: ``engine: ray`` (the CLI gives Ray's, :func:`robustir.cli.index.ray_pool`), so the index imports no engine
EncoderPoolFactory = Callable[[Any, IndexConfig], EncoderPool]


def need_pool(config: IndexConfig, factory: EncoderPoolFactory | None) -> EncoderPoolFactory:
    """``factory``, when ``config.engine`` needs one and it was given; else a clear error, before anything changes."""
    if factory is None:
        raise ConfigError(f"engine {config.engine!r} encodes with a pool the caller gives: robustir index --engine "
                          f"{config.engine} does; from Python pass encoder_pool=robustir.cli.index.ray_pool")
    return factory
