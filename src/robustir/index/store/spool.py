"""Documents in and out of a served index over HTTP (``POST /documents``, ``DELETE /documents``,
``GET /documents/{id}``), through the same writer, lock and jobs as ``robustir index --upsert / --delete``.

An upsert is written first as a JSONL file inside the index (``incoming/<n>.jsonl``, atomically), then run as an
ordinary ``--upsert`` job of that file on a writable handle that shares the server's model; the answer is sent
after the job finished (its commit recorded in the manifest). So:

* what was acknowledged is in the index: a ``kill -9`` after the answer loses nothing;
* a ``kill -9`` during the job leaves an unfinished upsert of a file that is still there; the next server start (or
  ``robustir index --upsert INDEX/incoming/N.jsonl --output INDEX``) finishes it before serving, as the CLI's resume
  does; a file whose job never started (killed while writing it; never acknowledged) is removed;
* readers -- this server's ``/search`` included -- see the new documents on their next query (they follow the
  manifest);
* one writer at a time: HTTP writes of this server wait for each other (an asyncio lock); a CLI job holding the
  index's lock makes them answer 409, naming it;
* a write the storage refuses (a full disk, a file-size limit) answers with the cause (:class:`StorageFailure`: 507
  for a full disk, naming "No space left" / "File too large"); an upsert it stopped half-way keeps its job and its
  file, and the next HTTP write (upsert or delete) finishes it first (:func:`finish_pending`), so nothing is left
  half-applied with no record and no write is blocked until a restart; an unfinished job of another command (a
  killed ``robustir index --add``) is never erased: writes answer 409 ``unfinished_job`` naming it and its fix.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ...errors import ConfigError
from ...io import atomic_write

__all__ = ["INCOMING", "DocumentError", "StorageFailure", "finish_incoming", "finish_pending", "upsert_documents",
           "delete_documents"]

logger = logging.getLogger(__name__)

INCOMING = "incoming"


class DocumentError(ConfigError):
    """A document of the request the index refuses; ``param`` names it (``documents[3]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StorageFailure(RuntimeError):
    """A write the index's storage refused: ``status`` 507 for a full disk or a file-size limit, else 500; the message
    names the cause as the system gave it."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


#: what a write that ran out of room fails with (ENOSPC, EFBIG, EDQUOT)
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def storage_failure(exc: BaseException, what: str) -> StorageFailure | None:
    """``exc`` as a :class:`StorageFailure` when the storage refused a write (an :class:`OSError`: the index raises
    Lance's IO errors as the ones they are, :func:`~robustir.index.store.jobs.storage_errors`); None for anything
    else."""
    if not isinstance(exc, OSError):
        return None
    cause = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    full = exc.errno in _FULL
    return StorageFailure(f"{what} failed: the index's storage refused a write: {cause}"
                          + (" -- free space (or raise the file-size limit) on the index's disk" if full else "")
                          + "; the index is served as it was, and the next write can go ahead", 507 if full else 500)


@contextmanager
def storage_failures(writer: Any, what: str) -> Iterator[None]:
    """Re-raise a write the storage refused as its :class:`StorageFailure` (logged, naming the index); anything
    else passes through unchanged."""
    try:
        yield
    except OSError as exc:
        failure = storage_failure(exc, what)
        if failure is None:
            raise
        logger.error("index %s: %s", writer.path, failure)
        raise failure from exc


def _incoming(index: Any) -> Path:
    """The local folder of the index's HTTP upsert files (:meth:`~robustir.index.store.storage.IndexStore.incoming_dir`:
    inside a local index, in this machine's cache for one on an object store)."""
    from .stores import open_store

    return open_store(index).incoming_dir()


def write_incoming(index: Any, documents: Iterable[dict]) -> Path:
    """``documents`` as one JSONL file in the index's ``incoming/`` folder (atomically: whole or not at all)."""
    folder = _incoming(index)
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / f"{time.time_ns()}-{os.getpid()}.jsonl").absolute()  # the job records it: any working folder
    with atomic_write(path) as handle:
        for document in documents:
            handle.write(json.dumps(document, ensure_ascii=False) + "\n")
    return path


def finish_incoming(index: Any, encoder: Any = None, device: str | None = None) -> int:
    """Before serving: finish an upsert of an ``incoming/`` file that a killed server left (a resume of that job),
    and remove incoming files no job is working on (never acknowledged). Returns the number of jobs finished.
    ``index``: a folder or an :class:`~robustir.index.store.storage.IndexStore`."""
    from .config import MANIFEST
    from .index import SearchIndex
    from .manifest import _read_manifest
    from .stores import open_store

    store = open_store(index)
    index = store
    folder = store.incoming_dir()
    if not folder.is_dir():
        return 0
    manifest = _read_manifest(store) if store.exists(MANIFEST) else {}
    job = manifest.get("job") or {}
    pending = Path(job["input"]) if job.get("kind") == "upsert" and job.get("input") else None
    finished = 0
    if pending is not None and pending.parent.resolve() == folder.resolve() and pending.exists():
        logger.info("index %s: finishing the HTTP upsert of %s that a stopped server left", index, pending.name)
        writer = SearchIndex.open(index, writable=True, model=encoder, device=device)
        try:
            if encoder is None:
                writer.use_model(writer.model_path, device=device)
            writer.upsert(pending, config=_quiet())
        finally:
            writer.close()
        finished = 1
    for stray in folder.glob("*.jsonl"):  # finished, or never started: nobody was told it is in the index
        stray.unlink(missing_ok=True)
    return finished


def _quiet() -> Any:
    from .config import IndexConfig

    return IndexConfig(show_progress=False)


def pending_upsert(index: Any, manifest: dict | None = None) -> Path | None:
    """The file of an unfinished HTTP upsert of this index (a request the storage stopped half-way, or a killed
    server's), when it is still there: what :func:`finish_pending` finishes. ``manifest``: the index's, when the
    caller holds it (else it is read)."""
    from .manifest import _usable_manifest
    from .stores import open_store

    store = open_store(index)
    job = ((manifest if manifest is not None else _usable_manifest(store)) or {}).get("job") or {}
    if job.get("kind") != "upsert" or not job.get("input"):
        return None
    path = Path(job["input"])
    return path if path.parent.resolve() == store.incoming_dir().resolve() and path.exists() else None


def finish_pending(writer: Any, encoder: Any = None) -> None:
    """Before an HTTP write on ``writer`` (a writable index): finish the unfinished HTTP upsert it holds, if any (its
    file is in ``incoming/``: a resume, as at start-up); an unfinished job of another command is refused
    (:class:`~robustir.index.store.jobs.UnfinishedJob`, naming it and its fix) by the write itself, never erased."""
    pending = pending_upsert(writer.store, writer.manifest)  # the writer read it when it opened
    if pending is None:
        return
    logger.info("index %s: finishing the HTTP upsert of %s that stopped before the next write", writer.path,
                pending.name)
    if encoder is not None and writer._encoder is None:
        writer.use_model(encoder)
    writer.upsert(pending, config=_quiet())
    pending.unlink(missing_ok=True)


def upsert_documents(index: Any, encoder: Any, documents: Sequence[dict], pool: Any = None) -> Any:
    """Insert ``documents`` (``robustir index`` corpus records: ``_id``, ``title``, ``text``, other fields), replacing
    those whose id exists, as one ``--upsert`` job; returns its :class:`~robustir.index.store.IndexReport`. ``pool``
    (an :class:`~robustir.index.store.config.EncoderPool`, e.g. ``robustir serve``'s batcher): what encodes the
    documents, else ``encoder``. Raises
    :class:`ConfigError` when another process holds the index's writer lock or an unfinished job of another command
    is in the way, :class:`~robustir.errors.DataError` (naming ``documents[i]``) for a record the index refuses,
    :class:`StorageFailure` when the storage refused a write (an unfinished upsert this leaves is finished by the
    next write)."""
    from ...errors import DataError
    from .index import SearchIndex

    # the lock (a CLI job running -> ConfigError); every data file's size is checked, not re-hashed: the server
    # hashed them at start-up and this job hashes what it writes (SearchIndex.open)
    writer = SearchIndex.open(index, writable=True, model=encoder, digests=False)
    path = None
    try:
        with storage_failures(writer, "the upsert"):
            finish_pending(writer)
            path = write_incoming(index, documents)
            try:
                return writer.upsert(path, config=_quiet(), pool=pool)
            except DataError as exc:  # the file's line N is the request's documents[N-1]
                where = f"documents[{exc.line - 1}]" if isinstance(exc.line, int) else "documents"
                field = f".{exc.field.removeprefix('fields.')}" if exc.field else ""  # the request's own key
                fix = f" ({exc.fix})" if exc.fix else ""
                raise DocumentError(f"'{where}{field}' {exc.problem}{fix}", where + field) from None
    finally:
        keep = path is not None and writer.job_reads(path)  # the writer knows: no manifest read again
        writer.close()
        if path is not None and not keep:
            path.unlink(missing_ok=True)  # done, or refused before its job started


def delete_documents(index: Any, ids: Sequence[str] | None = None, filter: dict | None = None,
                     limit: int = 10_000, encoder: Any = None) -> Any:
    """Delete the documents with ``ids``, or those ``filter`` matches (at most ``limit``; more is refused, nothing
    deleted), as one ``--delete`` commit, after finishing an unfinished HTTP upsert with ``encoder`` (never erasing
    it). An id not in the index is an error naming it (nothing deleted)."""
    from .index import SearchIndex

    writer = SearchIndex.open(index, writable=True, digests=False)
    try:
        with storage_failures(writer, "the delete"):
            finish_pending(writer, encoder)  # rare: the model loads only then
            return _delete(writer, ids, filter, limit)
    finally:
        writer.close()


def _delete(writer: Any, ids: Sequence[str] | None, filter: dict | None, limit: int) -> Any:
    """The delete itself, on an open writer: by ``ids``, or by ``filter`` (at most ``limit`` matches)."""
    if filter is not None:
        matched = writer.ids_matching(filter, limit)
        if len(matched) > limit:
            raise ConfigError(f"the filter matches more than {limit} documents; delete them in smaller groups "
                              "(a narrower filter) or with robustir index --delete")
        if not matched:
            from .config import IndexReport

            return IndexReport("delete", documents=writer.count, deleted=0)
        ids = matched
    return writer.delete(ids or [])
