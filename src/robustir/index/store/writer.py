"""Changing an open index: add, upsert, delete, discard an unfinished job, compact."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Sequence

from ...errors import ConfigError, DataError
from .jobs import ATOMIC as _ATOMIC
from .jobs import Job as _Job
from .jobs import storage_errors, unfinished
from .known_fields import forget, top_level_names, vanished
from .config import EncoderPool, IndexConfig, IndexReport, MANIFEST
from .table import _quote

logger = logging.getLogger(__name__)


class Writer:
    """The changes of :class:`~robustir.index.store.SearchIndex`."""

    # ------------------------------------------------------------------ changing
    def add(self, corpus: str | os.PathLike, *, config: IndexConfig | None = None, on_chunk: Any = None) -> IndexReport:
        """Add the documents of ``corpus``; an id already in the index is an error (use :meth:`upsert`)."""
        return self._timed("add", corpus, config, on_chunk)

    def upsert(self, corpus: str | os.PathLike, *, config: IndexConfig | None = None, on_chunk: Any = None,
               pool: EncoderPool | None = None) -> IndexReport:
        """Insert the documents of ``corpus``, replacing (title, text, fields and vector) those whose id exists.
        ``pool``: what encodes the chunks instead of the index's encoder, whatever ``config.engine`` (``robustir
        serve`` gives its batcher's, so an HTTP upsert's micro-batches take turns with the searches); not closed."""
        return self._timed("upsert", corpus, config, on_chunk, pool)

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

    def _names_of(self, ids: list[str]) -> set[str]:
        """The top-level field names the documents with these ids hold now."""
        return top_level_names(self._with_ids(ids, ["fields"]).column("fields").to_pylist())

    def _with_ids(self, ids: Sequence[str], columns: list[str], also: str | None = None, limit: int | None = None):
        """The rows whose id is one of ``ids`` (and match ``also``), as an Arrow table of ``columns``: one query, one
        predicate (one predicate of 50,000 ids deletes in 0.24 s on the 2-core box), a scan of the ``id`` column.

        Why no scalar index on ``id``: measured with LanceDB 0.40 on the 2-core box (issue 51, CPU ms, median of 6,
        100k rows): a BTREE on ``id`` makes ``merge_insert`` -- every upsert -- 389 ms instead of 18 (LanceDB
        takes its index path for the join), and this lookup no faster (17 ms against 11 for the scan; 4 at 1k).
        Tried again (same box, load 7-10): on a table kept open the BTREE does help (1-row merge_insert 6.5 CPU ms at
        100k against 17.2 scanning; a delete by id 2.9 against 10.7), but every HTTP write opens a fresh writer, which
        reads the index cold: a 1-document upsert at 100k took 398 CPU ms with it against 81 without (merge_insert
        336 ms of it, this lookup 33 ms against 11), so the scan stays."""
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

    def _need_writable(self, what: str) -> None:
        if not self.writable:
            raise ConfigError(f"index {self.path} is open for reading: open it with writable=True to {what}")

    def _timed(self, kind: str, corpus: str | os.PathLike, config: IndexConfig | None, on_chunk: Any,
               pool: EncoderPool | None = None) -> IndexReport:
        self._need_writable(kind)
        started = time.perf_counter()
        with storage_errors(self.path):
            report = self._run(kind, corpus, config or IndexConfig(), on_chunk, pool=pool)
        report.seconds = time.perf_counter() - started
        return report

    # ------------------------------------------------------------------ jobs
    def _spooled(self, corpus: str | os.PathLike) -> bool:
        """Whether ``corpus`` is an HTTP upsert's file in the index's ``incoming/`` folder."""
        return Path(corpus).absolute().parent == self.store.incoming_dir().absolute()

    def _same_precision(self, config: IndexConfig) -> IndexConfig:
        """``config`` with its precision resolved on this index's device, and the same as the documents already in
        the index were encoded in (recorded in the manifest): one index, one precision, so a query encoded in it
        finds the exact top-k. ``auto`` takes the recorded one; another, given explicitly, is refused."""
        from ...precision import resolve_precision

        recorded = self.manifest.get("precision")
        wanted = resolve_precision(config.precision, self.encoder.device)
        if recorded and self.count and wanted != recorded:
            if str(config.precision).lower() != "auto":
                raise ConfigError(f"index {self.path} holds documents encoded in {recorded}; adding others in "
                                  f"{wanted} would mix two precisions in one index: use --precision {recorded} (or "
                                  "rebuild it with --overwrite)")
            wanted = recorded
        return dataclasses.replace(config, precision=wanted)
