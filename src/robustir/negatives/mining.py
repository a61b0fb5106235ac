"""Hard-negative mining with BM25 (bm25s) or a dense model (FAISS).

For every query, candidates are retrieved to depth ``range_max``; then

1. every positive is excluded — by id *and* by identical text — and so is the query itself;
2. the rank window ``[range_min, range_max)`` and score limits apply: ``max_score`` / ``min_score``,
   ``absolute_margin`` (keep if score <= positive − margin) and ``relative_margin`` (keep if
   score <= positive − |positive| × margin, NV-Retriever's "TopK-PercPos"; the one rule of
   :mod:`robustir.negatives.margins`, shared with the teacher filter); the positive score used is the
   *lowest* of the query's positives, the conservative choice when a query has several;
3. ``num_negatives`` are taken from the survivors, from the top or sampled at random (seeded).

Queries are processed in chunks (never a full query × corpus matrix), results stream to a resumable
JSONL file, corpus embeddings can be cached, and ``shard`` splits the queries across workers.

At scale (``docs/scale.md``), nothing grows with the corpus but small per-document arrays and the index itself:

* queries are read and mined ``query_batch_size`` at a time, from the input file (read twice: once to build the
  candidate pool and check the records, once to mine), and written as they are done;
* documents are never held as text: a corpus file is a :class:`~robustir.data.beir.CorpusFile` (an offset index;
  a hit's text is read when it is needed) and a training file's own pool is spilled to a temporary file the same
  way (:class:`FileDocuments`); the BM25 index is built a chunk of texts at a time
  (:meth:`~robustir.index.bm25.BM25Index.index_chunks`);
* dense: the corpus is encoded a block at a time (the encoder's own block of 100,000 passages, whose texts, token
  ids and vectors are what encoding holds) into a ``.npy`` file (the ``cache_dir`` entry, resumable after a crash,
  or a temporary file), and with ``corpus_chunk`` it is searched from that file ``corpus_chunk`` rows at a time
  (:class:`~robustir.index.dense.ChunkedFlatIndex`; IVF/HNSW are built a chunk at a time and hold the vectors
  themselves). Without ``corpus_chunk`` the embeddings are loaded whole, as before.

The output is the same either way, byte for byte: same candidates, scores and choices (dense hits with exactly equal
scores are ordered by corpus row, so a tie falls the same way in a chunked and a whole search).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import tempfile
import weakref
from array import array
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, Literal

import numpy as np
from tqdm.auto import tqdm

from ..data.beir import BeirDataset, CorpusFile, encoding_text, load_beir
from ..runs import added, fingerprint, operational
from ..errors import ConfigError
from ..index.bm25 import BM25Config, BM25Index
from ..index.dense import TIE_MARGIN, ChunkedFlatIndex, DenseIndex, DenseIndexConfig, EmbeddingFile, sort_hits
from ..io import ResumableJsonlWriter, Shard
from ..outputs import StageOutput, refuse_overwriting_inputs, stage_step
from .margins import margin_reason
from .score_stats import ScoreStats
from ..precision import Precision
from ..validation import cli, config_dataclass, NonNegativeFloat, NonNegativeInt, OpenFraction, PositiveInt, Range, Seed

logger = logging.getLogger(__name__)


@config_dataclass
class MiningConfig:
    method: Literal["bm25", "dense"] = "bm25"
    """Retriever that ranks the candidates."""
    num_negatives: PositiveInt = 15
    """Negatives per query."""
    range_min: NonNegativeInt = 0
    """Skip this many top-ranked non-positives (likely false negatives)"""
    range_max: PositiveInt = 100
    """Retrieve to this rank."""
    max_score: float | None = None
    """Drop candidates scoring above this."""
    min_score: float | None = None
    """Drop candidates scoring below this."""
    absolute_margin: NonNegativeFloat | None = None
    """Keep if score <= positive score - margin."""
    relative_margin: OpenFraction | None = None
    """Keep if score <= positive score * (1 - margin) (NV-Retriever; e.g. 0.05)"""
    sampling: Literal["top", "random"] = "top"
    """Take the top survivors, or sample them at random (seeded)"""
    seed: Seed = 42
    """Seed of the sampling of negatives."""
    query_batch_size: PositiveInt = operational(1024)
    """Queries retrieved per chunk."""
    encode_batch_size: Annotated[PositiveInt, cli("batch-size")] = operational(64)
    """Encoding batch size (dense)."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    cache_dir: str | None = operational(None)
    """Reuse corpus embeddings saved here (dense)"""
    corpus_chunk: PositiveInt | None = operational(None)
    """Dense: search the corpus embeddings from disk this many rows at a time, memory bounded by one chunk (unset: all in memory); bm25: texts tokenized at a time."""
    device: str = operational("auto")
    """Dense: where model and search run: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""
    engine: Literal["process", "ray"] = operational("process")
    """Dense: where the corpus is encoded: this process, or Ray Data actors writing a resumable Lance dataset
    (robustir[scale]; docs/scale.md). The same vectors and negatives; the search runs here unless
    ray_search_shards is set."""
    ray_address: str | None = operational(None)
    """engine ray: the cluster to join (ray://head:10001, auto); None: a local Ray session."""
    ray_actors: PositiveInt = operational(1)
    """engine ray: encoder actors (one model load each); with ray_max_actors, the fewest."""
    ray_max_actors: PositiveInt | None = operational(None)
    """engine ray: autoscaling: Ray Data adds encoder actors up to this many while batches wait, and lets idle
    ones go down to ray_actors; unset: exactly ray_actors."""
    ray_gpus: Annotated[float, Range(ge=0.0)] = operational(0.0)
    """engine ray: GPUs per actor (0: CPU actors)."""
    ray_search_shards: PositiveInt | None = operational(None)
    """engine ray: split the corpus vectors among this many Ray actors and search every shard (exact, the same hits
    as one process): for a corpus too large for one machine's memory. Unset: the search runs here."""
    ray_lance_index: Literal["IVF_PQ", "IVF_HNSW_PQ"] | None = added(None)
    """engine ray: approximate search on a Lance vector index of the corpus vectors, built by lance-ray's
    distributed create_index (nlist cells, nprobe searched) and searched with Lance; the driver never holds the
    corpus's vectors. Not seeded: Lance trains the index with its own random sample, so a fresh build (a new
    cache) can give other negatives; a build is reused by every run on its cache. Unset: the exact search (here, or
    ray_search_shards), which is the same on every run."""
    index: Annotated[DenseIndexConfig, cli(flatten=True)] = field(default_factory=DenseIndexConfig)
    bm25: BM25Config = field(default_factory=BM25Config)

    def validate(self) -> None:
        if self.method not in ("bm25", "dense"):
            raise ConfigError(f"mining method must be bm25 or dense, got {self.method!r}")
        if not 0 <= self.range_min < self.range_max:
            raise ConfigError(f"need 0 <= range_min < range_max, got {self.range_min}, {self.range_max}")
        if self.num_negatives < 1:
            raise ConfigError("num_negatives must be >= 1")
        if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
            raise ConfigError(f"min_score ({self.min_score}) is above max_score ({self.max_score}): no candidate could "
                              "pass; swap them or drop one")
        if self.sampling not in ("top", "random"):
            raise ConfigError(f"sampling must be top or random, got {self.sampling!r}")
        if self.engine == "ray" and self.method != "dense":
            raise ConfigError("engine: ray encodes the corpus for dense mining; BM25 mining runs in this process "
                              "(set method dense, or engine process)")
        if self.ray_max_actors is not None:
            if self.engine != "ray":
                raise ConfigError("ray_max_actors goes with engine: ray (--engine ray)")
            if self.ray_max_actors < self.ray_actors:
                raise ConfigError(f"ray_max_actors ({self.ray_max_actors}) is below ray_actors ({self.ray_actors}): "
                                  "the pool scales between the two; raise ray_max_actors or lower ray_actors")
        if self.ray_lance_index is not None:
            if self.engine != "ray" or self.method != "dense":
                raise ConfigError("ray_lance_index goes with method: dense and engine: ray (--engine ray)")
            if self.ray_search_shards is not None:
                raise ConfigError("ray_lance_index (approximate, on a Lance index) and ray_search_shards (exact, "
                                  "in search actors) are two searches: set one")
        if self.ray_search_shards is not None:
            if self.engine != "ray":
                raise ConfigError("ray_search_shards goes with engine: ray (--engine ray)")
            if self.index.kind != "flat" or self.corpus_chunk is not None:
                raise ConfigError("ray_search_shards is an exact search split among Ray actors: it takes the flat "
                                  "index (the default) and no corpus_chunk (each shard is held in its actor's memory)")


@dataclass
class MiningQuery:
    query_id: str
    text: str
    positive_ids: list[str]
    extra: dict = field(default_factory=dict)
    """Other fields of an input training record, copied to the output (mined fields take precedence)."""


@dataclass
class MiningReport:
    queries: int = 0
    negatives: int = 0
    unfilled: int = 0  # queries that got fewer than num_negatives
    empty: int = 0  # queries that got none
    excluded_positive: int = 0
    excluded_by_score: int = 0
    positive_scores: ScoreStats = field(default_factory=ScoreStats)
    negative_scores: ScoreStats = field(default_factory=ScoreStats)

    def as_dict(self) -> dict:
        """The report as written to ``OUT.report.json``."""
        return {"queries": self.queries, "negatives": self.negatives, "unfilled_queries": self.unfilled,
                "queries_without_negatives": self.empty, "excluded_positive_or_duplicate": self.excluded_positive,
                "excluded_by_score_limits": self.excluded_by_score,
                "positive_scores": self.positive_scores.summary(count=False),
                "negative_scores": self.negative_scores.summary(count=False)}

    def summary(self) -> str:
        """One line, like every stage's report."""
        return (f"{self.queries} queries, {self.negatives} negatives ({self.unfilled} queries unfilled, {self.empty} "
                f"with none), {self.excluded_positive} positives/duplicates and {self.excluded_by_score} by score "
                "limits excluded")

    def format(self) -> str:
        s = self.as_dict()
        lines = [f"queries {s['queries']}, negatives {s['negatives']}, unfilled {s['unfilled_queries']} "
                 f"(none at all: {s['queries_without_negatives']})",
                 f"excluded: positives/duplicates {s['excluded_positive_or_duplicate']}, "
                 f"score limits {s['excluded_by_score_limits']}"]
        for name in ("positive_scores", "negative_scores"):
            st = s[name]
            if st:
                lines.append(f"{name.replace('_', ' '):16s} mean {st['mean']:.3f}  min {st['min']:.3f}  "
                             f"p25 {st['p25']:.3f}  median {st['median']:.3f}  p75 {st['p75']:.3f}  max {st['max']:.3f}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- documents

TEXT_CHUNK = 100_000  # texts read at a time to BM25-index documents from a file (when corpus_chunk is not set)
RAY_TEXT_CHUNK = 8192  # texts the Ray engine's driver reads at a time (the cache key; texts only it can read)


def text_digest(text: str) -> bytes:
    """128-bit BLAKE2 digest of a stripped text: how the passages of a training file are matched and de-duplicated
    without holding them (two different passages share one with probability 2^-128)."""
    from ..io import text_digest as digest

    return digest(text.strip(), 16)


class Documents:
    """Candidate documents by row: ``len``, :meth:`document` (id and text of a row), :meth:`row` (the row of an
    id), :meth:`texts` of a range of rows, and per row ``text_hashes`` (``hash(text.strip())``) and ``id_hashes``
    (``hash(id)``): a cheap first test for the duplicate-of-a-positive and self-match checks, confirmed on the
    text itself when it passes."""

    text_hashes: np.ndarray
    id_hashes: np.ndarray

    def __len__(self) -> int:
        raise NotImplementedError

    def document(self, row: int) -> tuple[str, str]:
        raise NotImplementedError

    def row(self, doc_id: str) -> int | None:
        raise NotImplementedError

    def texts(self, start: int, stop: int) -> list[str]:
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[list[str]]:
        """Every text in row order, ``size`` at a time."""
        for start in range(0, len(self), size):
            yield self.texts(start, start + size)

    def close(self) -> None:
        """Release files (nothing to do for documents in memory)."""

    def file_pieces(self, rows: int) -> tuple[str, dict[str, np.ndarray]] | None:
        """Where other processes can read the first documents themselves: a plain corpus file (absolute) and its
        ranges of ``rows`` rows (:meth:`~robustir.data.beir.CorpusFile.pieces`), covering rows ``0`` to the sum of
        the ranges' rows; None when only this process can read them (texts in memory, a ``.gz`` corpus)."""
        return None


class ListDocuments(Documents):
    """Documents held in memory as two lists (the Python API's :func:`mine_negatives`)."""

    def __init__(self, ids: list[str], texts: list[str]) -> None:
        if len(ids) != len(texts):
            raise ConfigError(f"{len(ids)} document ids for {len(texts)} document texts: give one id per text")
        self._ids, self._texts = ids, texts
        self._rows = {doc_id: i for i, doc_id in enumerate(ids)}
        self.text_hashes = np.fromiter((hash(t.strip()) for t in texts), dtype=np.int64, count=len(texts))
        self.id_hashes = np.fromiter((hash(i) for i in ids), dtype=np.int64, count=len(ids))

    def __len__(self) -> int:
        return len(self._ids)

    def document(self, row: int) -> tuple[str, str]:
        return self._ids[row], self._texts[row]

    def row(self, doc_id: str) -> int | None:
        return self._rows.get(doc_id)

    def texts(self, start: int, stop: int) -> list[str]:
        return self._texts[start:stop]


class FileDocuments(Documents):
    """Documents read from files when needed: a corpus (:class:`~robustir.data.beir.CorpusFile`, its rows first,
    as their :func:`~robustir.data.beir.encoding_text`) and texts added with :meth:`add` (row ``n`` gets the id
    ``<prefix><n>``), which go to a temporary file in ``spill_dir`` (removed by :meth:`close`). Memory: the corpus
    file's index and 32 bytes per added text. Call :meth:`finish` after the last :meth:`add`."""

    def __init__(self, corpus: CorpusFile | None = None, *, prefix: str = "pos:",
                 spill_dir: str | Path | None = None) -> None:
        self.corpus = corpus
        self.prefix = prefix
        self._base = len(corpus) if corpus is not None else 0
        self._spill_dir = spill_dir
        self._spill = None
        self._offsets, self._lengths, self._hashes = array("q"), array("q"), array("q")
        self._written = 0
        self.finish()

    def add(self, text: str) -> tuple[int, str]:
        """Append a document; returns its row and id."""
        if self._spill is None:
            fd, path = tempfile.mkstemp(prefix=".mining-pool.", suffix=".jsonl", dir=self._spill_dir)
            self._spill = os.fdopen(fd, "w+b")
            self._spill_finalizer = weakref.finalize(self, _close_and_remove, self._spill, path)
        raw = (json.dumps(text) + "\n").encode("ascii")  # ASCII escapes: any string, lone surrogates too
        self._spill.write(raw)
        self._offsets.append(self._written)
        self._lengths.append(len(raw))
        self._hashes.append(hash(text.strip()))
        self._written += len(raw)
        row = len(self) - 1
        return row, f"{self.prefix}{row}"

    def finish(self) -> "FileDocuments":
        """Make the added documents readable and searchable (after the last :meth:`add`)."""
        if self._spill is not None:
            self._spill.flush()
        added = len(self._offsets)
        extra_text = np.frombuffer(self._hashes, dtype=np.int64) if added else np.empty(0, dtype=np.int64)
        extra_ids = np.fromiter((hash(f"{self.prefix}{self._base + i}") for i in range(added)), dtype=np.int64,
                                count=added)
        if self.corpus is not None:  # no copy of the corpus's hashes (16 bytes a passage)
            self.text_hashes = _Joined(self.corpus.text_hashes, extra_text)
            self.id_hashes = _Joined(self.corpus.id_hashes, extra_ids)
        else:
            self.text_hashes, self.id_hashes = extra_text.copy(), extra_ids
        return self

    def __len__(self) -> int:
        return self._base + len(self._offsets)

    def file_pieces(self, rows: int) -> tuple[str, dict[str, np.ndarray]] | None:
        pieces = self.corpus.pieces(rows) if self.corpus is not None else None
        return None if pieces is None else (str(self.corpus.path.resolve()), pieces)

    def close(self) -> None:
        if self._spill is not None:
            self._spill_finalizer()
        if self.corpus is not None:
            self.corpus.close()

    def _added(self, start: int, stop: int) -> list[str]:
        """Added texts ``start`` to ``stop`` (counted among the added ones), read in one go."""
        if start >= stop:
            return []
        base = self._offsets[start]
        block = os.pread(self._spill.fileno(), self._offsets[stop - 1] + self._lengths[stop - 1] - base, base)
        return [json.loads(block[self._offsets[i] - base:self._offsets[i] + self._lengths[i] - base])
                for i in range(start, stop)]

    def document(self, row: int) -> tuple[str, str]:
        if row < self._base:
            doc_id, title, text = self.corpus.document(row)
            return doc_id, encoding_text(title, text)
        return f"{self.prefix}{row}", self._added(row - self._base, row - self._base + 1)[0]

    def row(self, doc_id: str) -> int | None:
        if doc_id.startswith(self.prefix):  # an added document (these come last, so they win, as in a dict)
            tail = doc_id[len(self.prefix):]
            if tail.isdigit() and str(int(tail)) == tail and self._base <= int(tail) < len(self):
                return int(tail)
        return self.corpus.row(doc_id) if self.corpus is not None else None

    def texts(self, start: int, stop: int) -> list[str]:
        stop = min(stop, len(self))
        out = self.corpus.texts(start, min(stop, self._base)) if self.corpus is not None and start < self._base else []
        return out + self._added(max(start, self._base) - self._base, stop - self._base) if stop > self._base else out


class _Joined:
    """Two arrays read as one by row arrays (``joined[rows]``), without copying the first (a corpus's hashes)."""

    def __init__(self, first: np.ndarray, second: np.ndarray) -> None:
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row {int(rows.max() if rows.max() >= len(self) else rows.min())} is out of range "
                             f"for {len(self)} rows")
        base = len(self.first)
        inside = rows < base
        out = np.empty(rows.shape, dtype=self.first.dtype)
        out[inside] = self.first[rows[inside]]
        out[~inside] = self.second[rows[~inside] - base]
        return out


def _close_and_remove(handle, path: str) -> None:
    handle.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------------------------------------- retrieval

class _Retriever:
    """Scores for top-k retrieval and for specific (query, document) pairs, BM25 or dense."""

    def __init__(self, config: MiningConfig, documents: Documents, encoder=None, work_dir: Path | None = None) -> None:
        self.config = config
        self.doc_emb: np.ndarray | None = None
        if config.method == "bm25":
            self.bm25 = BM25Index(config.bm25).index_chunks(documents.chunks(config.corpus_chunk or TEXT_CHUNK),
                                                            show_progress=len(documents) > 50_000)
        else:
            if encoder is None:
                raise ConfigError("dense mining needs a model (--model)")
            from ..device import resolve_device

            device = resolve_device(config.device)
            self.encoder = encoder.to(device) if hasattr(encoder, "to") else encoder
            self.embeddings = corpus_embeddings(self.encoder, documents, config, work_dir)
            if config.ray_lance_index is not None:  # approximate, on a Lance index lance-ray builds
                from ..scale.ray_search import LanceIvfIndex, lance_dataset_of

                uri = lance_dataset_of(self.embeddings, str(self.embeddings.path.with_suffix(".lance")))
                self.dense = LanceIvfIndex(uri, config.ray_lance_index, *self.embeddings.shape,
                                           nlist=config.index.nlist, nprobe=config.index.nprobe,
                                           workers=config.ray_actors, address=config.ray_address)
            elif config.ray_search_shards is not None:  # the corpus vectors split among Ray actors, searched there
                from ..scale.ray_search import RayShardedFlatIndex

                self.dense = RayShardedFlatIndex(self.embeddings, config.ray_search_shards,
                                                 address=config.ray_address)
            elif config.corpus_chunk is None:
                self.doc_emb = self.embeddings.load()
                self.dense = DenseIndex(config.index, device=device).index(self.doc_emb)
            elif config.index.kind == "flat":
                self.dense = ChunkedFlatIndex(self.embeddings, config.corpus_chunk, device)
            else:
                self.dense = DenseIndex(config.index, device=device).index_file(self.embeddings, config.corpus_chunk)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if self.config.method == "bm25":
            scores, indices = self.bm25.search(queries, k)
            return scores, indices, None
        q = self.encoder.encode(queries, "query", batch_size=self.config.encode_batch_size,
                                precision=self.config.precision)
        if not isinstance(self.dense, DenseIndex):  # chunked or sharded: already in sort_hits order, ties by row
            scores, indices = self.dense.search(q, k)
        else:  # a few more hits, so that rows tied at the k-th place are chosen by row here too
            scores, indices = sort_hits(*self.dense.search(q, min(k + TIE_MARGIN, self.dense.size)), k)
        return scores, indices, q

    def pair_scores(self, query: str, query_emb: np.ndarray | None, doc_rows: list[int]) -> list[float]:
        if self.config.method == "bm25":
            ids = self.bm25._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)[0]
            if not ids:
                return [0.0] * len(doc_rows)
            all_scores = self.bm25._retriever.get_scores(ids)
            return [float(all_scores[r]) for r in doc_rows]
        vectors = self.doc_emb[doc_rows] if self.doc_emb is not None else \
            self.embeddings.take(np.asarray(doc_rows), chunk_rows=self.config.corpus_chunk or 65536)
        return [float(v @ query_emb) for v in vectors]

    def close(self) -> None:
        """Stop the search actors, if any (``ray_search_shards``)."""
        if hasattr(getattr(self, "dense", None), "close"):
            self.dense.close()


def corpus_embeddings(encoder, documents: Documents, config: MiningConfig, work_dir: str | Path) -> EmbeddingFile:
    """The documents' passage embeddings in a ``.npy`` file, encoded :data:`~robustir.models.encoder.ENCODE_BLOCK`
    documents at a time -- the blocks :meth:`~robustir.models.encoder.Encoder.encode` batches within, so the
    vectors are exactly those of encoding every document in one call.

    With ``config.cache_dir`` the file is :meth:`~robustir.models.encoder.Encoder.encode_corpus`'s cache entry (the
    same key: either reuses the other's), an interrupted encoding resumes at its last finished block, and processes
    that share the cache folder (the shards of a job array) encode the corpus once: the first takes a lock, the
    others wait for it and then read its file. Without, it is a temporary file in ``work_dir``.
    """
    from ..models import encoder as encoder_module

    if not len(documents):
        raise ConfigError("no documents to mine negatives from")
    block = encoder_module.ENCODE_BLOCK
    kwargs = {"batch_size": config.encode_batch_size, "precision": config.precision}
    if config.engine == "ray":
        return _encode_on_ray(encoder, documents, config, Path(work_dir))
    if config.cache_dir is None:
        return _encode_to_file(encoder, documents, Path(work_dir) / "corpus-embeddings.npy", block, kwargs)
    path = encoder.corpus_cache_file((text for chunk in documents.chunks(block) for text in chunk), config.cache_dir,
                                     **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if encoder_module.reusable_corpus_cache(path):
            return EmbeddingFile(path)
        return _encode_to_file(encoder, documents, path, block, kwargs, resumable=True)


def _encode_to_file(encoder, documents: Documents, path: Path, block: int, kwargs: dict,
                    resumable: bool = False) -> EmbeddingFile:
    """Encode the documents into ``path`` (through ``path.partial``, renamed when complete, then recorded complete
    in ``path.run.json``); ``resumable``: continue a ``.partial`` whose record says how many rows are done (same
    block size and document count)."""
    from ..models.encoder import corpus_cache_entry

    partial = path.with_name(path.name + ".partial")
    entry = corpus_cache_entry(path)
    n = len(documents)
    start, file = 0, None
    made = fingerprint("corpus-embeddings", {"key": path.stem, "block": block, "documents": n})
    if resumable and partial.exists():
        saved = entry.fingerprint
        rows = entry.progress.get("rows")
        try:
            if saved is not None and saved.digest == made.digest and isinstance(rows, int) and 0 < rows <= n:
                candidate = EmbeddingFile(partial, writable=True)
                if len(candidate) == n:
                    file, start = candidate, rows
                    logger.info("resuming the corpus encoding at document %d of %d (%s)", start, n, partial)
                else:
                    candidate.close()
        except (OSError, ValueError, ConfigError):
            file, start = None, 0  # a damaged partial file: encode from the start
    if start == 0:
        entry.start(made)  # encoded from the first block: the record says so before the first block is written
    bar = tqdm(total=n, initial=start, desc="encode corpus", unit="doc", disable=n < 2000)
    try:
        for first in range(start, n, block):
            emb = encoder.encode(documents.texts(first, first + block), "passage", show_progress=False, **kwargs)
            if file is None:
                file = EmbeddingFile.create(partial, n, emb.shape[1])
            file.write(first, emb)
            if resumable:
                file.flush()
                entry.note(rows=first + len(emb))
            bar.update(len(emb))
            del emb  # before the next block is encoded: one block of vectors at a time
    finally:
        bar.close()
    file.flush()
    file.close()
    os.replace(partial, path)
    entry.finish({"rows": n}, checksums=True)
    return EmbeddingFile(path)


def _encode_on_ray(encoder, documents: Documents, config: MiningConfig, work_dir: Path) -> EmbeddingFile:
    """The corpus embeddings encoded by Ray Data actors (:func:`robustir.scale.ray_encode.encode_documents_with_ray`)
    through a resumable Lance dataset, then written in document order to the ``.npy`` the search reads. Kept in
    ``cache_dir`` when it is set (keyed like :meth:`~robustir.models.encoder.Encoder.corpus_cache_file`), so a
    killed job resumes with the rows not committed; else in the run's work folder. Miners sharing ``cache_dir``
    take the dataset's lock in turn: the first encodes and writes the ``.npy``, the next finds it done."""
    from ..scale.ray_encode import (RayEncodeConfig, encode_documents_with_ray, require_scale_extra,
                                    write_in_row_order)

    require_scale_extra("engine: ray")
    from ..models import encoder as encoder_module

    kwargs = {"batch_size": config.encode_batch_size, "precision": config.precision}
    # the process path's cache key (model, texts, settings): either engine reuses the other's file. Read in small
    # chunks: the driver's memory does not grow with the corpus (chunks of TEXT_CHUNK measured +36 MiB at 100k)
    texts = (text for chunk in documents.chunks(RAY_TEXT_CHUNK) for text in chunk)
    target = encoder.corpus_cache_file(texts, config.cache_dir or work_dir, **kwargs)
    target.parent.mkdir(parents=True, exist_ok=True)
    if encoder_module.reusable_corpus_cache(target):
        return EmbeddingFile(target)
    ray_config = RayEncodeConfig(precision=config.precision, batch_size=config.encode_batch_size,
                                 concurrency=config.ray_actors, max_concurrency=config.ray_max_actors,
                                 num_gpus=config.ray_gpus, address=config.ray_address,
                                 show_progress=len(documents) >= 2000)

    def write_npy(uri: str) -> EmbeddingFile:  # under the Lance dataset's lock: one miner writes it
        import lance

        if encoder_module.reusable_corpus_cache(target):  # another miner sharing the cache wrote it meanwhile
            return EmbeddingFile(target)
        dataset = lance.dataset(uri)
        rows, dim = dataset.count_rows(), dataset.schema.field("vector").type.list_size
        entry = encoder_module.corpus_cache_entry(target)
        entry.start(fingerprint("corpus-embeddings", {"key": target.stem, "engine": "ray", "documents": rows}))
        partial = target.with_name(target.name + ".partial")
        file = EmbeddingFile.create(partial, rows, dim)
        written = write_in_row_order(uri, file)  # a Lance batch at a time: the vectors never all in this process
        file.flush()
        file.close()
        if written != rows or rows != len(documents):
            raise ConfigError(f"{uri} holds {rows} vectors ({written} read) for {len(documents)} documents; delete "
                              "it and run again")
        os.replace(partial, target)
        entry.finish({"rows": rows}, checksums=True)
        return EmbeddingFile(target)

    return encode_documents_with_ray(encoder, documents, target.stem, target.with_suffix(".lance"),
                                     ray_config, then=write_npy)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) -- ``flock``, which Linux NFS clients honour."""
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish encoding the same corpus (%s)", path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

def select_negatives(candidates: list[tuple[int, float]], positive_score: float | None, config: MiningConfig,
                     rng: random.Random, report: MiningReport) -> list[tuple[int, float]]:
    """Apply score limits and sampling to ``(row, score)`` candidates already stripped of positives."""
    kept = []
    for row, score in candidates:
        if config.max_score is not None and score > config.max_score:
            report.excluded_by_score += 1
            continue
        if config.min_score is not None and score < config.min_score:
            report.excluded_by_score += 1
            continue
        if positive_score is not None:
            if margin_reason(score, positive_score, config.absolute_margin, config.relative_margin):
                report.excluded_by_score += 1
                continue
        kept.append((row, score))
    if config.sampling == "random" and len(kept) > config.num_negatives:
        chosen = sorted(rng.sample(range(len(kept)), config.num_negatives))
        kept = [kept[i] for i in chosen]
    return kept[: config.num_negatives]


def mine_negatives(queries: list[MiningQuery], doc_ids: list[str], doc_texts: list[str], output: str | Path,
                   config: MiningConfig | None = None, encoder=None, shard: Shard | None = None,
                   show_progress: bool = True) -> MiningReport:
    """Mine hard negatives for ``queries`` from the documents (two lists in memory); write training JSONL to
    ``output``.

    Each output line: ``{"query", "pos", "neg", "pos_scores", "neg_scores", "query_id", "pos_ids", "neg_ids"}``.
    A re-run continues after the last query written (resume); the report goes to ``<output>.report.json``.
    :func:`mine_documents` is the same for documents read from files and queries read as a stream.
    """
    config = config or MiningConfig()
    config.validate()
    shard = shard or Shard()
    documents = ListDocuments(doc_ids, doc_texts)
    owned = list(shard.select(queries))
    for q in owned:
        missing = [p for p in q.positive_ids if documents.row(p) is None]
        if missing:
            raise ConfigError(f"query {q.query_id!r}: positive id(s) {missing[:3]} not in the corpus")
    return mine_documents(owned, documents, output, config, encoder, None, show_progress, total=len(owned))


def _batches(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    return iter(lambda: list(islice(iterator, size)), [])


def mine_documents(queries: Iterable[MiningQuery], documents: Documents, output: str | Path,
                   config: MiningConfig | None = None, encoder=None, shard: Shard | None = None,
                   show_progress: bool = True, *, total: int | None = None,
                   work_dir: str | Path | None = None) -> MiningReport:
    """:func:`mine_negatives` over any :class:`Documents` and a stream of queries, read ``query_batch_size`` at a
    time (the ones ``shard`` owns). ``total``: how many queries that is, for the progress bar (None: unknown).
    ``work_dir``: where temporary files go (the corpus embeddings without a ``cache_dir``); default a temporary
    folder next to ``output``, removed at the end."""
    config = config or MiningConfig()
    config.validate()
    shard = shard or Shard()
    output = Path(output)
    report = MiningReport()
    writer = ResumableJsonlWriter(output, key_field="query_id")
    done = set(writer.done_keys)  # as the run starts (a query id given twice is mined twice, as it always was)
    skipped = 0

    def todo() -> Iterator[MiningQuery]:
        nonlocal skipped
        for query in shard.select(queries):
            if query.query_id in done:
                skipped += 1
                continue
            yield query

    bar = tqdm(total=None if total is None else max(0, total - len(done)), desc=f"mine ({config.method})",
               disable=not show_progress, unit="query")
    retriever = None
    with ExitStack() as stack:
        if work_dir is None:
            output.parent.mkdir(parents=True, exist_ok=True)
            work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f".{output.name}.work-",
                                                                       dir=output.parent))
        try:
            for chunk in _batches(todo(), config.query_batch_size):
                positive_rows = []
                for query in chunk:
                    rows = [documents.row(p) for p in query.positive_ids]
                    if None in rows:
                        missing = [p for p, r in zip(query.positive_ids, rows) if r is None]
                        raise ConfigError(f"query {query.query_id!r}: positive id(s) {missing[:3]} not in the corpus")
                    positive_rows.append(sorted(set(rows)))
                if retriever is None:  # built when there is something to mine (not for a complete resume)
                    if skipped:
                        logger.info("resuming: %d queries already mined", skipped)
                    retriever = _Retriever(config, documents, encoder, Path(work_dir))
                depth = min(config.range_max + max(len(q.positive_ids) for q in chunk) + 1, len(documents))
                scores, indices, q_emb = retriever.search([q.text for q in chunk], depth)
                for j, (query, pos_rows) in enumerate(zip(chunk, positive_rows)):
                    _mine_query(query, pos_rows, scores[j], indices[j], None if q_emb is None else q_emb[j],
                                documents, retriever, config, report, writer)
                    bar.update(1)
            writer.finish()
        finally:
            writer.close()
            bar.close()
            if retriever is not None:
                retriever.close()
    StageOutput(output).write_report({"config": _plain(config), **report.as_dict()})
    return report


def _mine_query(query: MiningQuery, pos_rows: list[int], scores: np.ndarray, rows: np.ndarray,
                query_emb: np.ndarray | None, documents: Documents, retriever: _Retriever, config: MiningConfig,
                report: MiningReport, writer: ResumableJsonlWriter) -> None:
    """Exclusions, rank window, score limits and sampling for one query's hits; writes its record."""
    report.queries += 1
    rng = random.Random(f"{config.seed}:{query.query_id}")
    positive_rows = set(pos_rows)
    positives = {r: documents.document(r) for r in pos_rows}
    positive_texts = {text.strip() for _, text in positives.values()}
    query_text = query.text.strip()
    suspects = {hash(text) for text in positive_texts} | {hash(query_text)}  # texts to look at more closely
    query_id_hash = hash(query.query_id)
    row_list, score_list = rows.tolist(), scores.tolist()
    hit_score = {r: s for r, s in zip(row_list, score_list) if r >= 0}
    missing = [r for r in pos_rows if r not in hit_score]
    if missing:
        hit_score.update(zip(missing, retriever.pair_scores(query.text, query_emb, missing)))
    pos_scores = [hit_score[r] for r in pos_rows]
    valid = np.clip(rows, 0, None)
    text_hashes, id_hashes = documents.text_hashes[valid].tolist(), documents.id_hashes[valid].tolist()
    candidates = []
    rank = 0
    for r, s, text_hash, id_hash in zip(row_list, score_list, text_hashes, id_hashes):
        if r < 0:
            continue
        excluded = r in positive_rows
        if not excluded and (text_hash in suspects or id_hash == query_id_hash):
            doc_id, text = documents.document(r)
            text = text.strip()
            excluded = text in positive_texts or text == query_text or doc_id == query.query_id
        if excluded:
            report.excluded_positive += 1
            continue  # positives and their duplicates never become negatives, nor the query
        if config.range_min <= rank < config.range_max:
            candidates.append((r, s))
        rank += 1
    chosen = select_negatives(candidates, min(pos_scores) if pos_scores else None, config, rng, report)
    negatives = [documents.document(r) for r, _ in chosen]
    report.negatives += len(chosen)
    report.unfilled += len(chosen) < config.num_negatives
    report.empty += not chosen
    report.positive_scores.extend(pos_scores)
    report.negative_scores.extend(s for _, s in chosen)
    writer.write({
        **query.extra,
        "query": query.text, "pos": [positives[r][1] for r in pos_rows],
        "neg": [text for _, text in negatives],
        "pos_scores": pos_scores, "neg_scores": [s for _, s in chosen],
        "query_id": query.query_id, "pos_ids": [positives[r][0] for r in pos_rows],
        "neg_ids": [doc_id for doc_id, _ in negatives],
    })

def _plain(config: MiningConfig) -> dict:
    from dataclasses import asdict

    return asdict(config)


def queries_from_beir(dataset: BeirDataset) -> list[MiningQuery]:
    return [MiningQuery(qid, dataset.queries[qid], [d for d, g in dataset.qrels[qid].items() if g > 0])
            for qid in dataset.qrels]


class JsonlMiningSource:
    """The queries and candidate documents of a training JSONL (the rules: :func:`load_jsonl_for_mining`), read
    without holding the file: construction reads it once -- checks every record, decides the query ids, builds the
    candidate pool (:attr:`documents`) -- and :meth:`queries` reads it again, one query at a time. Passages are
    matched by a 128-bit digest of their stripped text (:func:`text_digest`), so only the positives matched by text
    are remembered (as digests), never the texts. ``spill_dir``: where temporary files go."""

    def __init__(self, path: str | Path, corpus: str | Path | None = None, *,
                 spill_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.records = 0
        self.unique_ids = True  # every record has a query_id / qid of its own
        given: set[str] = set()
        self._corpus = CorpusFile(corpus, spill_dir=spill_dir) if corpus is not None else None
        self.documents = FileDocuments(self._corpus, prefix="pos:" if corpus is not None else "p",
                                       spill_dir=spill_dir)
        # digest of a stripped text -> doc id (with a corpus) or pool row (without)
        self._by_text: dict[bytes, str | int] = {}
        wanted: dict[bytes, tuple[int, int]] = {}  # positives to match by text -> where their text waits
        with tempfile.TemporaryFile(dir=spill_dir) as waiting:
            for _, example in self._examples(warn=True):
                self.records += 1
                if self.unique_ids:
                    qid = str(example.extra.get("query_id", example.extra.get("qid", "")))
                    if qid and qid not in given:
                        given.add(qid)
                    else:
                        self.unique_ids, given = False, set()
                if self._corpus is None:  # the pool: every distinct pos and neg text, in order
                    for text in (*example.pos, *example.neg):
                        digest = text_digest(text)
                        if digest not in self._by_text:
                            self._by_text[digest] = self.documents.add(text)[0]
                    continue
                for i, text in enumerate(example.pos):
                    if self._declared_id(example, i) is None:
                        digest = text_digest(text)
                        if digest not in wanted:
                            raw = (json.dumps(text) + "\n").encode("ascii")
                            wanted[digest] = (waiting.tell(), len(raw))
                            waiting.write(raw)
            if not self.records:
                from ..errors import DataError

                self.documents.close()
                raise DataError(self.path, "no usable record", fix='each line needs "query" and a non-empty "pos" list')
            if wanted:
                self._match_corpus(wanted, waiting)
        self.documents.finish()

    def _match_corpus(self, wanted: dict[bytes, tuple[int, int]], waiting) -> None:
        """Positives matched by text: the first corpus document whose text (with or without its title) is theirs;
        the others join the pool as ``pos:<row>``, in the order they first appear."""
        remaining = len(wanted)
        for doc_id, title, text in self._corpus.iter_documents():
            for candidate in (encoding_text(title, text), text):
                digest = text_digest(candidate)
                if digest in wanted and digest not in self._by_text:
                    self._by_text[digest] = doc_id
                    remaining -= 1
            if not remaining:
                break
        waiting.flush()
        for digest, (offset, length) in wanted.items():
            if digest not in self._by_text:
                waiting.seek(offset)
                self._by_text[digest] = self.documents.add(json.loads(waiting.read(length)))[1]

    def _examples(self, warn: bool):
        from ..data.training_data import parse_example
        from ..io import read_jsonl

        for line, obj in read_jsonl(self.path):
            example = parse_example(obj, self.path, line)  # DataError names file, line and field
            if example is None:
                if warn:
                    logger.warning("%s, line %d: empty query or positive, skipped", self.path, line)
                continue
            yield line, example

    def _declared_id(self, example, i: int) -> str | None:
        """The corpus id the record gives for its ``i``-th positive (``pos_ids`` / ``pos_id``), if the corpus has it."""
        if self._corpus is None:
            return None
        declared = example.extra.get("pos_ids", example.extra.get("pos_id"))
        declared = [declared] if isinstance(declared, str) else declared
        if isinstance(declared, list) and i < len(declared) and str(declared[i]) in self._corpus:
            return str(declared[i])
        return None

    def owned(self, shard: Shard) -> int:
        """How many queries ``shard`` owns."""
        return len(range(shard.index, self.records, shard.count))

    def queries(self) -> Iterator[MiningQuery]:
        """The records as queries, in file order (the file is read again)."""
        for line, example in self._examples(warn=False):
            positives: list[str] = []
            for i, text in enumerate(example.pos):
                doc_id = self._declared_id(example, i)
                if doc_id is None:
                    found = self._by_text.get(text_digest(text))
                    if found is None:
                        from ..errors import DataError

                        raise DataError(self.path, "changed while it was being read", line=line,
                                        fix="leave the input unchanged while robustir mine runs, then run it again")
                    doc_id = found if isinstance(found, str) else f"p{found}"
                positives.append(doc_id)
            extra = {k: v for k, v in example.extra.items() if k not in ("pos_ids", "neg_ids", "query_id")}
            if example.prompt is not None:
                extra["prompt"] = example.prompt
            qid = str(example.extra.get("query_id", example.extra.get("qid", "")))
            yield MiningQuery(qid if self.unique_ids else f"L{line}", example.query, list(dict.fromkeys(positives)),
                              extra)


def load_jsonl_for_mining(path: str | Path, corpus: str | Path | None = None
                          ) -> tuple[list[MiningQuery], list[str], list[str]]:
    """Queries and candidate documents for mining negatives for a training JSONL (``query``/``pos``[/``neg``]).

    * With ``corpus`` (a BEIR ``corpus.jsonl``: ``_id``, ``title``, ``text``): candidates are its documents. A
      record's positives are matched by ``pos_ids`` / ``pos_id`` when those are corpus ids, else by identical
      text; a positive found in neither way is added to the pool under a synthetic id (``pos:<n>``), so it is
      scored and excluded like any positive.
    * Without: the FlagEmbedding convention -- the candidate pool is every distinct ``pos`` and ``neg`` text
      in the file (ids ``p0``, ``p1``, ...).

    Existing ``neg`` lists are replaced by the mined ones (without a corpus they are still candidates).
    Query ids: the record's ``query_id`` / ``qid`` when every record has a distinct one, else ``L<line>``.
    Other record fields are carried to the output unchanged.

    Everything in memory, as lists; :func:`mine_jsonl` reads the same through :class:`JsonlMiningSource` without
    holding the file or the corpus.
    """
    with tempfile.TemporaryDirectory() as spill:
        source = JsonlMiningSource(path, corpus, spill_dir=spill)
        try:
            queries = list(source.queries())
            documents = source.documents
            ids = [documents.document(r)[0] for r in range(len(documents))]
            texts = [text for chunk in documents.chunks(TEXT_CHUNK) for text in chunk]
        finally:
            source.documents.close()
    return queries, ids, texts


def mine_jsonl(path: str | Path, output: str | Path, config: MiningConfig | None = None, encoder=None,
               shard: Shard | None = None, corpus: str | Path | None = None) -> MiningReport:
    """Mine negatives for the records of a training JSONL (see :func:`load_jsonl_for_mining`), reading the file,
    the corpus and the candidate pool from disk as needed (:class:`JsonlMiningSource`)."""
    refuse_overwriting_inputs(output, path, corpus, stage="mine")
    config = config or MiningConfig()
    config.validate()
    shard = shard or Shard()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.work-", dir=output.parent) as work:
        source = JsonlMiningSource(path, corpus, spill_dir=work)
        try:
            return mine_documents(source.queries(), source.documents, output, config, encoder, shard,
                                  total=source.owned(shard), work_dir=work)
        finally:
            source.documents.close()


def mine_beir(path: str | Path, split: str, output: str | Path, config: MiningConfig | None = None,
              encoder=None, shard: Shard | None = None) -> MiningReport:
    """Mine negatives for the queries of a BEIR split against its corpus (read from its file as needed)."""
    refuse_overwriting_inputs(output, path, stage="mine")
    dataset = load_beir(path, split, corpus_on_disk=True)
    documents = FileDocuments(dataset.corpus)
    shard = shard or Shard()
    try:
        return mine_documents(queries_from_beir(dataset), documents, output, config, encoder, shard,
                              total=len(range(shard.index, len(dataset.qrels), shard.count)))
    finally:
        documents.close()


def _mine_step(config: MiningConfig, job: Any) -> MiningReport:
    """Mine for the queries of a BEIR split (input ``data``, job setting ``split``) or of a training JSONL (input
    ``input``, optional ``corpus``); dense mining encodes with the input ``model`` and the job's other settings
    (encoder overrides such as ``query_instruction``)."""
    stage = StageOutput(job.output, job.shard, reports=True)
    encoder = None
    if config.method == "dense":
        from ..device import resolve_device
        from ..models.encoder import Encoder

        options = {key: value for key, value in job.settings.items() if key != "split"}
        encoder = Encoder.from_pretrained(job.inputs["model"], device=resolve_device(config.device), **options)
    if job.inputs.get("data"):
        return mine_beir(job.inputs["data"], job.settings.get("split") or "train", stage.path, config, encoder,
                         stage.shard)
    return mine_jsonl(job.inputs["input"], stage.path, config, encoder, stage.shard, corpus=job.inputs.get("corpus"))


def _check_mine(config: MiningConfig, job: Any) -> None:
    config.validate()
    if bool(job.inputs.get("data")) == bool(job.inputs.get("input")):
        raise ConfigError("give exactly one of --data BEIR_DIR (with --split) or --input train.jsonl")
    if job.inputs.get("corpus") and not job.inputs.get("input"):
        raise ConfigError("--corpus goes with --input (a BEIR folder brings its own corpus)")
    if config.method == "dense":
        from ..device import resolve_device

        resolve_device(config.device)  # checked before anything runs


MINE = stage_step("mine", MiningConfig, _mine_step, reports=True, check=_check_mine)
"""Hard-negative mining as a :class:`~robustir.runs.Step` (inputs ``data`` | ``input`` [+ ``corpus``], ``model``
for dense mining, read by content: a model retrained in place is a changed input)."""


def mine_training_examples(examples: "Iterable", output: str | Path, config: MiningConfig, *, encoder=None,
                           model: str | None = None, beir_root: str | Path | None = None, split: str = "train",
                           source: dict | None = None) -> Path:
    """Mine hard negatives for training examples that came without any (``robustir train --mine``) into
    ``output``, reused while the source's content (``source``: its :func:`~robustir.io.input_digest`), these
    settings and -- dense -- the ``model`` are the same (:meth:`robustir.runs.Artifact.begin`; a file from another
    run or an interrupted one is mined again).

    A BEIR source (``beir_root``) is mined against its corpus by the examples' query and positive ids; a JSONL
    source against every positive passage in it (the FlagEmbedding convention), ids made up in file order."""
    from ..data.beir import corpus_file, load_corpus
    from ..runs import Artifact, fingerprint

    output = Path(output)
    step = Artifact(output, what="mined hard negatives")
    made = fingerprint("train-mine", {"method": config.method, "negatives": config.num_negatives,
                                      "range_min": config.range_min, "split": split, "precision": config.precision,
                                      "source": source},
                       {"model": model if config.method == "dense" else None})
    if step.begin(made, resume=False):
        return output
    examples = list(examples)
    if beir_root is not None:
        corpus, _ = load_corpus(corpus_file(Path(beir_root)))
        doc_ids, doc_texts = corpus.ids, corpus.texts_for_encoding()
        queries = [MiningQuery(e.extra["query_id"], e.query, list(e.extra["pos_ids"])) for e in examples]
    else:  # FlagEmbedding convention: the candidate pool is every passage in the file
        pool = list(dict.fromkeys(p for e in examples for p in e.pos))
        row = {text: f"p{i}" for i, text in enumerate(pool)}
        doc_ids, doc_texts = [row[t] for t in pool], pool
        queries = [MiningQuery(f"q{i}", e.query, [row[p] for p in e.pos]) for i, e in enumerate(examples)]
    logger.info("mining %d hard negatives per query with %s", config.num_negatives, config.method)
    report = mine_negatives(queries, doc_ids, doc_texts, output, config,
                            encoder=encoder if config.method == "dense" else None)
    logger.info("mining done:\n%s", report.format())
    step.finish()
    return output
