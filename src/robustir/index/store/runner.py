"""The job runner: a build, add or upsert read in chunks, each encoded and committed, the manifest recording how far
it got; the job's end (full-text, scalar and vector indexes, the manifest's version, count and files) and the
rebuild's swap."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from datetime import timedelta
from typing import Any, Iterable

import numpy as np

from ...errors import DataError
from .jobs import Job as _Job
from .jobs import job_input, same_input, unfinished
from .known_fields import check_bound, forget, vanished
from .config import need_pool, RETIRED_KEEP, AnnConfig, IndexConfig, IndexReport, MANIFEST, BUILDING
from .records import _Record, _check_vector, _read_records, _scan_corpus
from .table import _schema, BITMAP_MAX_DISTINCT
from .manifest import _data_files, _read_manifest, _write_manifest

logger = logging.getLogger(__name__)

#: a manifest write that failed: whether it happened is not known
_UNSURE: Any = object()


class JobRunner:
    """The jobs of :class:`~robustir.index.store.SearchIndex`."""

    def _run(self, kind: str, corpus: str | os.PathLike, config: IndexConfig, on_chunk: Any,
             scanned: tuple[int, dict[str, int], set[str]] | None = None, pool: Any = None) -> IndexReport:
        job = _Job.from_json(self.manifest["job"], self.path / MANIFEST) if self.manifest.get("job") else None
        if job is not None and (job.kind != kind or not same_input(job.input, corpus)):
            raise unfinished(self.path, job, f"{kind} of {corpus}")
        # an HTTP upsert's spooled file (bounded by the request's limits) is parsed once and kept; a CLI corpus is
        # read again below, so memory stays bounded whatever its size
        kept: list[_Record] | None = [] if scanned is None and self._spooled(corpus) else None
        # bad input fails here, a record's own vector checked against the index's dimension
        total, ids, names = scanned or _scan_corpus(corpus, config.format, keep=kept, dim=self.dim)
        check_bound(self.field_names, names, corpus)
        if kind == "add":
            self._refuse_present(ids, corpus, job.id if job is not None else None)
        del ids
        config = self._same_precision(config)
        job = self._start(job, kind, corpus, config)
        report = IndexReport(kind, resumed_from=job.position, skipped_empty=job.skipped)
        if pool is not None:  # the caller's (robustir serve's batcher): it closes it
            self._pool = pool
        elif config.engine != "process":  # the chunks split among the pool's workers (Ray actors: engine ray)
            self._pool = need_pool(config, self.encoder_pool)(self.encoder, config)
        # a pool that builds the ANN index on its cluster (Ray's: lance-ray) does so once its workers are gone
        builder = getattr(self._pool, "build_vector_index", None) if pool is None else None
        self._replaced_names = set()
        # an upsert whose input holds every field name the index knows cannot leave a name without a document: the
        # replaced documents' names are then not looked up (a filtered read of the fields column per chunk; issue 51,
        # bench/index_upsert.py on a quiet box: a 1-document upsert at 100k 62.0 -> 49.4 ms, 100k / 1k 1.58 -> 1.40)
        self._track_replaced = not set(self.manifest.get("fields") or ()) <= set(names)
        try:
            self._chunks(job, kept if kept is not None else _read_records(corpus, config.format), total, config,
                         report, corpus, on_chunk)
        finally:
            if pool is not None:
                self._pool = None
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
        self._finish_job(builder=builder)
        if self._manifest_name == BUILDING:
            self._swap()
        report.documents = self.count
        return report

    def _start(self, job: _Job | None, kind: str, corpus: str | os.PathLike, config: IndexConfig) -> _Job:
        """The job's record: a new one saved in the manifest, or the unfinished one, whose rows past its recorded
        position (a killed run committed them) are deleted, to be written again."""
        if job is None:
            job = _Job(int(self.manifest.get("jobs_done", 0)) + 1, kind, job_input(corpus),  # type: ignore[arg-type]
                       base=int(self._table.version))
            self.manifest["precision"] = config.precision  # what the documents are encoded in, for the readers
            self._save_job(job)
        else:
            self._table.delete(f"job = {job.id} AND line > {job.position}")
            logger.info("resuming the %s of %s after %d input records", kind, corpus, job.position)
        return job

    def _chunks(self, job: _Job, records: Iterable[_Record], total: int, config: IndexConfig, report: IndexReport,
                corpus: str | os.PathLike, on_chunk: Any) -> None:
        """Read ``records`` past the job's position, commit them ``config.chunk_size`` at a time (empty ones are
        skipped and counted), calling ``on_chunk(position)`` after each commit."""
        from tqdm.auto import tqdm

        from ...data.beir import Corpus

        show = config.show_progress if config.show_progress is not None else True
        fields = set(self.field_names)
        buffer: list[_Record] = []
        with tqdm(total=total, initial=job.position, desc=f"index {job.kind}", unit="doc", disable=not show) as bar:
            position = job.position
            for record in records:
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
            from .lance_sql import column_value, fits_column, record_kinds

            new = sorted({key for r in records for key in r.fields} - fields)
            kinds = self.manifest.get("field_kinds")  # only an index that recorded them from its build: complete
            changed = [record_kinds(kinds, r.fields) for r in records] if kinds is not None else []
            columns = self.manifest.get("columns") or {}
            unfit = [name for name, entry in columns.items() if entry.get("usable", True)
                     and not all(fits_column(entry["kind"], r.fields.get(name)) for r in records)]
            for name in unfit:  # from now on read from the JSON column (which holds every value): still exact
                columns[name]["usable"] = False
                kind = columns[name]["kind"]
                odd = next(r for r in records if not fits_column(kind, r.fields.get(name)))
                # a warning (and robustir serve's robustir_index_untyped_fields metric): every filter on the field is
                # slower from now on (issue 55: a year filter 74 instead of 45 ms p50), which nothing else would say
                logger.warning("index %s: field %r lost its typed %s column: document %r holds %r; filters on %r now "
                               "read the JSON column (exact, but slower). To get the column back, make every %r a %s "
                               "and rebuild the index (robustir index --overwrite)", self.path, name, kind, odd.id,
                               odd.fields.get(name), name, name, kind)
            if new or any(changed) or unfit:  # recorded before the rows are: a reader may filter on them at once
                fields.update(new)
                self.manifest["fields"] = sorted(fields)
                self._write()
            vectors = self._vectors(records, texts, config, bar, source)
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
            if job.kind == "upsert":
                if self._track_replaced:  # the names the replaced documents held: dropped at the end if none is left
                    self._replaced_names |= self._names_of([r.id for r in records])
                self._table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(rows)
            else:
                self._table.add(rows)
        job.position = position
        self._save_job(job)

    def _vectors(self, records: list[_Record], texts: list[str], config: IndexConfig, bar: Any,
                 source: str | os.PathLike) -> np.ndarray:
        """The chunk's vectors: a record's own (``"vector"``; a build scans before the model, so its dimension is
        checked here), else encoded."""
        todo = [i for i, r in enumerate(records) if r.vector is None]
        vectors = np.zeros((len(records), self.dim), dtype=np.float32)
        for i, r in enumerate(records):
            if r.vector is not None:
                _check_vector(r, self.dim, source)
                vectors[i] = r.vector
        bar.update(len(records) - len(todo))
        wanted, parts = [texts[i] for i in todo], []
        if self._pool is not None and wanted:  # engine ray: the chunk split among the actors (or the caller's pool)
            parts.append(self._pool.encode(wanted, "passage", batch_size=config.batch_size,
                                           precision=config.precision))
            bar.update(len(wanted))
        for start in range(0, len(wanted), config.batch_size) if self._pool is None else ():
            parts.append(self.encoder.encode(wanted[start:start + config.batch_size], "passage",  # the bar moves
                                             batch_size=config.batch_size, precision=config.precision,  # per batch
                                             show_progress=False))
            bar.update(len(parts[-1]))
        if todo:
            vectors[todo] = np.vstack(parts).astype(np.float32)
        return vectors

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

    def _vector_index(self, builder: Any = None) -> None:
        """Build (or rebuild, once a fifth of the rows are new) the ANN index the manifest's ``ann`` asks for;
        ``builder``: the job's pool's ``build_vector_index``, which builds it on its cluster (engine ray), if any."""
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

        # engine ray: built on the cluster (lance-ray: one Ray task a segment of the table's fragments) where the
        # pool takes it; else by LanceDB here
        on_cluster = builder is not None and builder(self._table.to_lance().uri, self.store.lance_options, kind,
                                                     partitions, count)
        if not on_cluster:
            config = (IvfHnswSq if kind == "ivf_hnsw_sq" else IvfPq)(distance_type="dot", num_partitions=partitions)
            self._table.create_index("vector", config=config, replace=True)
        ann.update(indexed=True, indexed_rows=count, kind_built=kind, partitions=partitions,
                   built_by="lance-ray" if on_cluster else "lancedb")

    def _save_job(self, job: _Job) -> None:
        self.manifest["job"] = dataclasses.asdict(job)
        self._write()

    def _write(self, name: str | None = None) -> None:
        """Write this writer's manifest (``name``: another one, for the swap) -- after checking its writer lock
        still holds (a lease on an object store can be lost: the job stops before it writes anything more)."""
        if self._lock is not None:
            self._lock.check()
        self._written_job = _UNSURE  # until the write is known to have happened
        _write_manifest(self.store, self.manifest, name or self._manifest_name)
        self._written_job = dict(self.manifest["job"]) if self.manifest.get("job") else None

    def job_reads(self, corpus: str | os.PathLike) -> bool:
        """Whether the manifest this writer last wrote records an unfinished job reading ``corpus`` -- or a write of
        it failed, so it may (an HTTP upsert keeps its spooled file then: :mod:`~robustir.index.store.spool`). What
        the writer knows, so the caller reads no manifest again (one GET less per HTTP write on S3)."""
        job = self._written_job
        return job is _UNSURE or (job is not None and same_input(job.get("input", ""), corpus))

    def _finish_job(self, keep: timedelta = RETIRED_KEEP, builder: Any = None) -> None:
        """Make the full-text index once (rows added later are searched beside it until :meth:`compact` folds them
        in, so no job rebuilds it), then record the version, the count and the data files; remove the folders
        retired by a swap more than ``keep`` ago."""
        if self.count:
            from lancedb.index import FTS

            if not any(i.index_type == "FTS" for i in self._table.list_indices()):
                self._table.create_index("content", config=FTS())  # the first argument names the column
            self._scalar_indexes()
            self._vector_index(builder)
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
