"""Full-corpus retrieval evaluation on a BEIR folder: dense (encode → FAISS), lexical (BM25) or hybrid (reciprocal
rank fusion of both) → trec_eval metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Sequence

import numpy as np

from ..data.beir import BeirDataset, load_beir
from ..data.trec import write_trec_run
from ..index.bm25 import BM25Config, BM25Index
from ..errors import ConfigError
from ..index.dense import DenseIndex, DenseIndexConfig
from ..index.fusion import FusionConfig
from ..io import write_json
from ..models.encoder import Encoder
from .metrics import compute_metrics
from ..precision import Precision
from ..runs import operational
from ..validation import cli, config_dataclass, PositiveInt

logger = logging.getLogger(__name__)


RetrievalMode = Literal["dense", "lexical", "hybrid"]


@config_dataclass
class EvalConfig:
    mode: RetrievalMode = "dense"
    """dense: the model; lexical: BM25 (no model); hybrid: reciprocal rank fusion of both lists, each read
    fusion.candidates deep as /search reads them (raise fusion.candidates for a deeper hybrid recall)."""
    top_k: PositiveInt = 1000
    """Documents retrieved per query."""
    batch_size: PositiveInt = operational(64)
    """Encoding batch size."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    ignore_identical_ids: bool = False
    """Drop a retrieved document whose id equals the query id (ArguAna)"""
    cache_dir: str | None = operational(None)
    """Reuse corpus embeddings across runs."""
    index: Annotated[DenseIndexConfig, cli(flatten=True)] = field(default_factory=DenseIndexConfig)
    bm25: BM25Config = field(default_factory=BM25Config)
    fusion: Annotated[FusionConfig, cli(flatten=True)] = field(default_factory=FusionConfig)
    search_index: str | None = None
    """Search through this persistent index (built by robustir index from the same corpus) with its own engines --
    LanceDB vectors and BM25 full text -- as robustir serve's /search does, instead of in-memory FAISS / bm25s; the
    model is the index's (another one is refused)."""
    show_progress: bool | None = operational(None)
    """Show progress bars."""
    device: str = operational("auto")
    """Where the model and search run: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""


@dataclass
class EvalResult:
    metrics: dict[str, float]
    run: dict[str, dict[str, float]]
    seconds: float
    system: str = ""


def _run_from_hits(query_ids: list[str], doc_ids: list[str], scores: np.ndarray, indices: np.ndarray,
                   drop_identical: bool, k: int) -> dict[str, dict[str, float]]:
    run: dict[str, dict[str, float]] = {}
    for row, qid in enumerate(query_ids):
        hits: dict[str, float] = {}
        for score, index in zip(scores[row], indices[row]):
            if index < 0:
                continue  # FAISS pads with -1 when fewer than k vectors are reachable
            doc_id = doc_ids[index]
            if drop_identical and doc_id == qid:
                continue
            hits[doc_id] = float(score)
            if len(hits) == k:
                break
        run[qid] = hits
    return run


def retrieve_dense(encoder: Encoder, dataset: BeirDataset, config: EvalConfig,
                   top_k: int | None = None) -> dict[str, dict[str, float]]:
    """Encode the corpus and the queries with ``encoder`` (on its device) and search on ``config.device``."""
    top_k = top_k or config.top_k
    query_ids = list(dataset.queries)
    corpus_emb = encoder.encode_corpus(dataset.corpus.texts_for_encoding(), cache_dir=config.cache_dir,
                                       batch_size=config.batch_size, precision=config.precision,
                                       show_progress=config.show_progress)
    query_emb = encoder.encode([dataset.queries[q] for q in query_ids], "query", batch_size=config.batch_size,
                               precision=config.precision, show_progress=config.show_progress)
    index = DenseIndex(config.index, device=config.device).index(corpus_emb)
    extra = 1 if config.ignore_identical_ids else 0
    scores, indices = index.search(query_emb, top_k + extra)
    return _run_from_hits(query_ids, dataset.corpus.ids, scores, indices, config.ignore_identical_ids, top_k)


def retrieve_bm25(dataset: BeirDataset, config: EvalConfig, top_k: int | None = None) -> dict[str, dict[str, float]]:
    top_k = top_k or config.top_k
    query_ids = list(dataset.queries)
    index = BM25Index(config.bm25).index(dataset.corpus.texts_for_encoding())
    extra = 1 if config.ignore_identical_ids else 0
    scores, indices = index.search([dataset.queries[q] for q in query_ids], top_k + extra)
    return _run_from_hits(query_ids, dataset.corpus.ids, scores, indices, config.ignore_identical_ids, top_k)


def fuse_runs(dense: dict[str, dict[str, float]], lexical: dict[str, dict[str, float]], config: EvalConfig
              ) -> dict[str, dict[str, float]]:
    """Per query, the reciprocal rank fusion (:func:`~robustir.index.fusion.reciprocal_rank_fusion`) of the dense
    and the lexical run (each ranked by its own score), cut to ``top_k``."""
    fusion, run = config.fusion, {}
    for qid in [*dense, *(q for q in lexical if q not in dense)]:
        lists = [sorted(part.get(qid, {}), key=lambda d, s=part.get(qid, {}): -s[d]) for part in (dense, lexical)]
        run[qid] = in_rank_order(fusion.fuse(*lists, top_k=config.top_k))
    return run


def in_rank_order(ranked: Sequence[tuple[str, float]]) -> dict[str, float]:
    """A ranking as a run whose scores keep its order: trec_eval breaks equal scores by document id, not by our
    rank, and fused (RRF) scores tie often -- 1/(k+r) from either list -- so equal scores are nudged down by 1e-12 per
    rank (far below the gap between two RRF ranks, ~1e-6 at rank 1000): eval scores exactly the order /search
    returns."""
    return {doc: float(score) - 1e-12 * position for position, (doc, score) in enumerate(ranked)}


def retrieve_from_index(model: "Encoder | str | None", dataset: BeirDataset, config: EvalConfig,
                        mode: str, storage_options: dict | None = None) -> tuple[dict[str, dict[str, float]], str]:
    """The run of ``config.search_index`` (:class:`robustir.index.store.SearchIndex`) in ``mode``: the same calls
    as ``POST /search`` makes, so its ranking is the served one. The index must hold the dataset's corpus (its count
    is checked; a document it holds that the qrels do not know simply counts as not relevant)."""
    from ..index.store import SearchIndex

    index = SearchIndex.open(config.search_index, device=config.device, storage_options=storage_options)
    with index:
        if index.count != len(dataset.corpus.ids):
            raise ConfigError(f"index {config.search_index} holds {index.count} documents, the corpus of the dataset "
                              f"{len(dataset.corpus.ids)}: evaluate an index built from that corpus")
        if mode != "lexical":
            index.use_model(model if model is not None else index.model_path, device=config.device)
        query_ids = list(dataset.queries)
        extra = 1 if config.ignore_identical_ids else 0
        run: dict[str, dict[str, float]] = {}
        batch = config.batch_size
        for start in range(0, len(query_ids), batch):
            ids = query_ids[start:start + batch]
            texts = [dataset.queries[q] for q in ids]
            vectors = None if mode == "lexical" else index.encoder.encode(
                texts, "query", batch_size=batch, precision=config.precision, show_progress=False)
            depth = min(config.top_k, config.fusion.candidates) if mode == "hybrid" else config.top_k  # as /search
            for qid, hits in zip(ids, index.search_encoded(texts, vectors, depth + extra, mode=mode,
                                                           fusion=config.fusion)):
                kept = [h for h in hits if not (config.ignore_identical_ids and h.id == qid)][:config.top_k]
                run[qid] = in_rank_order([(h.id, h.score) for h in kept])  # ties in the order served
        return run, f"{index.model_name if mode != 'lexical' else 'bm25'} via {config.search_index} ({mode})"


def evaluate(model: "Encoder | str | None", data: "BeirDataset | str | Path", split: str = "test",
             config: EvalConfig | None = None, output: str | Path | None = None,
             storage_options: dict | None = None, **encoder_options) -> EvalResult:
    """Evaluate ``model`` (an :class:`Encoder`, a model path / hub id, or ``"bm25"``, the same as ``mode:
    lexical``) on a BEIR folder, in ``config.mode``: dense, lexical (BM25) or hybrid (both, fused by rank). With
    ``config.search_index``, through that persistent index (``model`` None: the index's model; an ``s3://`` index
    with ``storage_options``, :mod:`robustir.index.store.storage`).

    ``output``: folder for ``metrics.json`` and ``run.trec``. A dense model runs on ``config.device`` (an
    :class:`Encoder` given is moved there); BM25 runs on the CPU whatever the device (which is still checked).
    """
    from ..device import resolve_device

    config = config or EvalConfig()
    mode = "lexical" if isinstance(model, str) and model.lower() == "bm25" else config.mode
    device = resolve_device(config.device)  # checked before anything loads
    dataset = data if isinstance(data, BeirDataset) else load_beir(data, split)
    start = time.perf_counter()
    if config.search_index is not None:
        if any(v is not None for v in encoder_options.values()):
            raise ConfigError("encoder options come from the index's manifest with search_index: leave them out")
        given = model.to(device) if isinstance(model, Encoder) else model
        run, system = retrieve_from_index(None if given == "bm25" else given, dataset, config, mode, storage_options)
    elif mode == "lexical":
        run = retrieve_bm25(dataset, config)
        system = "bm25"
    else:
        encoder = model.to(device) if isinstance(model, Encoder) else \
            Encoder.from_pretrained(model, device=device, **encoder_options)
        system = encoder.source or "model"
        if mode == "dense":
            run = retrieve_dense(encoder, dataset, config)
        else:
            # each list read fusion.candidates deep, as POST /search reads it: one fusion depth, so eval scores the
            # served ranking (a 1000-deep fusion ordered 33 of 300 SciFact queries' ties differently)
            depth = config.fusion.candidates
            run = fuse_runs(retrieve_dense(encoder, dataset, config, depth), retrieve_bm25(dataset, config, depth),
                            config)
            system = f"{system} + bm25 (rrf)"
    metrics = compute_metrics(dataset.qrels, run)
    result = EvalResult(metrics, run, time.perf_counter() - start, system)
    if output is not None:
        out = Path(output)
        write_json(out / "metrics.json", metrics)
        write_trec_run(out / "run.trec", run, tag=Path(system).name or "robustir")
    return result
