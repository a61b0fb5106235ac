"""The search index: open, read, search (the public API; see :mod:`robustir.index.store`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...errors import ConfigError, DataError
from ..fusion import FusionConfig
from .jobs import ATOMIC as _ATOMIC
from .jobs import Job as _Job
from .storage import IndexStore, WriterLock
from .stores import open_store
from .config import EncoderPoolFactory, SearchMode, Hit, MANIFEST
from .records import _fields, _check_search, _checked_digest
from .table import _open_table
from .manifest import served_version, verify, _read_manifest, _model_key
from .build import (Builder)
from .writer import (Writer)
from .runner import (JobRunner)

logger = logging.getLogger(__name__)


class SearchIndex(Builder, Writer, JobRunner):
    """A persistent LanceDB search index (see the module docstring): :meth:`build` / :meth:`open`, then
    :meth:`add`, :meth:`upsert`, :meth:`delete` and :meth:`search` (dense, lexical or hybrid, with filters)."""

    def __init__(self, store: IndexStore, table: Any, manifest: dict, *, writable: bool, encoder: Any = None,
                 manifest_name: str = MANIFEST, encoder_pool: EncoderPoolFactory | None = None) -> None:
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
        self.encoder_pool = encoder_pool  # what makes them (given by the caller: config.py)
        self._replaced_names: set[str] = set()  # top-level field names of the documents an upsert replaced
        self._refresh_s = 0.0  # a reader checks for a writer's commits at most this often (0: every query)
        self._checked_at = time.monotonic()
        self._written_job = dict(manifest["job"]) if manifest.get("job") else None  # what the manifest file records
        self._pinned: int | None = None  # a reader: the Lance version it serves (checked out)

    @classmethod
    def open(cls, path: str | os.PathLike | IndexStore, *, model: Any = None, writable: bool = False,
             device: str | None = None, storage_options: dict | None = None, refresh_s: float = 0.0,
             digests: bool = True, encoder_pool: EncoderPoolFactory | None = None) -> "SearchIndex":
        """Open the index at ``path`` (a folder, or ``s3://bucket/prefix`` with ``storage_options``; see the module
        docstring for what is checked). A reader follows the writer: each query sees the latest committed version --
        or, with ``refresh_s`` > 0, checks for new commits at most that often (on an object store each check costs
        requests). ``digests=False`` checks every data file's size but not its SHA-256: what an HTTP write opens
        with (:mod:`robustir.index.store.spool`; the server checked the digests when it started, and the job hashes
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
                _unfinished_without_writer(store, manifest, job)
            refresh_s = 0.0 if writable else float(refresh_s)
            index = cls(store, _open_table(store, manifest, writable=writable, refresh_s=refresh_s), manifest,
                        writable=writable)
            index._lock, index._manifest_stat, index._refresh_s = lock, seen, refresh_s
            if writable and job is not None and job.kind in _ATOMIC:  # killed after (or before) its commit: either
                logger.info("index %s: recording the state an interrupted %s left", path, job.kind)  # is whole
                index._finish_job()
            index._verify(digests=digests)
            index._pin()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        index.device, index.encoder_pool = device, encoder_pool
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
        from ...models.encoder import Encoder, resolve_model_path

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
                self._pinned = None
                logger.info("index %s: now serving the rebuilt index (%s)", self.path, manifest["data"])
            else:
                self.manifest = manifest
            self._pin()
            self._manifest_stat = stat

    def _pin(self) -> None:
        """A reader serves the index's last complete state: the Lance version its manifest recorded when its last job
        finished -- during a first build, the empty table the build started from (:func:`served_version`). So the
        commits of a job under way or killed (a build, an add, an upsert: one commit per chunk) are never served half
        done, as a rebuild beside the index (``--overwrite``) is not until its swap; Lance's versions do it
        (``checkout``), and the reader moves on when the manifest records the job's end (:meth:`_follow`)."""
        if self.writable:
            return
        wanted = served_version(self.manifest)
        if wanted is not None and wanted != self._pinned:
            self._table.checkout(wanted)
        elif wanted is None and self._pinned is not None:  # beside a delete or compact: the latest, as a writer
            self._table.checkout_latest()
        self._pinned = wanted

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

    @property
    def untyped_fields(self) -> dict[str, str]:
        """Top-level fields that lost their typed column (a document held a value of another kind): ``{field: the
        column's kind}``; filters on them read the JSON column, exact but slower. Follows the writer."""
        self._follow()
        return {name: entry["kind"] for name, entry in (self.manifest.get("columns") or {}).items()
                if not entry.get("usable", True)}

    def _where(self, filter: dict | None) -> str | None:
        """``filter`` compiled to a LanceDB predicate (:func:`~robustir.index.store.lance_sql.to_lance_sql`), after one
        look at the manifest (:meth:`_follow`: the typed columns in use are the manifest's, a writer may have stopped
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
        from .filters import parse_filter
        from .lance_sql import check_kinds, to_lance_sql

        parsed = parse_filter(filter, ["id", "title", *self.field_names])
        if "field_kinds" in self.manifest:  # recorded since issue 36; older indexes are not checked
            check_kinds(parsed, self.manifest["field_kinds"])
        return to_lance_sql(parsed, self.typed_columns)

    # ------------------------------------------------------------------ integrity
    def check(self) -> str:
        """Verify the manifest's digest, Lance's version, every data file of the recorded version (size and SHA-256)
        and the count, as :meth:`open` does; never repairs. Returns a one-line summary, raises :class:`DataError`
        naming what is damaged -- or an unfinished job no process is working on (readers serve the index without
        it, but it waits for someone to resume it)."""
        self._verify()
        job = self.manifest.get("job")
        if job is not None and job["kind"] not in _ATOMIC and not self.writable and not self.store.writer_running():
            _unfinished_without_writer(self.store, self.manifest, _Job.from_json(job, self.path / MANIFEST),
                                       refuse=True)
        return f"{self.path}: {self.count} documents, {len(self.manifest.get('files') or {})} data files verified"

    def _verify(self, *, digests: bool = True, follow: bool = True) -> None:
        """:func:`~robustir.index.store.manifest.verify`, after following the writer (``follow``)."""
        if follow:
            self._follow()
        verify(self, digests=digests)

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


def _unfinished_without_writer(store: IndexStore, manifest: dict, job: _Job, refuse: bool = False) -> None:
    """A reader opening an index whose job (``job``: a build, add or upsert) no process is working on (killed, its
    lease expired): served at its last complete state while the job waits to be resumed (logged, naming how). Refused
    (a :class:`DataError` naming the fix) when there is no such state (a first build), when the job can never be
    resumed (an HTTP upsert whose spooled file is gone), or with ``refuse`` (``robustir index --check``)."""
    path = store.path
    flag = "corpus" if job.kind == "build" else job.kind
    fix = f"re-run that command to finish it (robustir index --{flag} {job.input} --output {path})"
    lost = False
    if Path(job.input).parent.resolve() == store.incoming_dir().resolve():  # an HTTP upsert of a stopped server
        lost = not Path(job.input).exists()
        fix = (f"its input (an HTTP upsert's file) is gone, so it cannot be finished: drop it with robustir index "
               f"--discard-unfinished --output {path}" if lost else
               f"start robustir serve on it (it finishes an HTTP upsert before serving), or {fix}")
    problem = f"its {job.kind} of {job.input} did not finish (after {job.position} input records)"
    if refuse or lost or manifest.get("version") is None:  # a first build: no complete state yet
        raise DataError(path, f"{problem} and no process is working on it", fix=fix)
    logger.warning("index %s: %s and no process is working on it; serving its last complete state (%d documents) "
                   "until then: %s", path, problem, manifest.get("documents", 0), fix)
