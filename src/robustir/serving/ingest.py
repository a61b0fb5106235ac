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
  index's lock makes them answer 409, naming it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ConfigError
from ..io import atomic_write

__all__ = ["INCOMING", "DocumentError", "finish_incoming", "upsert_documents", "delete_documents"]

logger = logging.getLogger(__name__)

INCOMING = "incoming"


class DocumentError(ConfigError):
    """A document of the request the index refuses; ``param`` names it (``documents[3]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _incoming(index: Any) -> Path:
    """The local folder of the index's HTTP upsert files (:meth:`~robustir.serving.storage.IndexStore.incoming_dir`:
    inside a local index, in this machine's cache for one on an object store)."""
    from .storage import open_store

    return open_store(index).incoming_dir()


def write_incoming(index: Any, documents: Iterable[dict]) -> Path:
    """``documents`` as one JSONL file in the index's ``incoming/`` folder (atomically: whole or not at all)."""
    folder = _incoming(index)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns()}-{os.getpid()}.jsonl"
    with atomic_write(path) as handle:
        for document in documents:
            handle.write(json.dumps(document, ensure_ascii=False) + "\n")
    return path


def finish_incoming(index: Any, encoder: Any = None, device: str | None = None) -> int:
    """Before serving: finish an upsert of an ``incoming/`` file that a killed server left (a resume of that job),
    and remove incoming files no job is working on (never acknowledged). Returns the number of jobs finished.
    ``index``: a folder or an :class:`~robustir.serving.storage.IndexStore`."""
    from .index import MANIFEST, SearchIndex, _read_manifest
    from .storage import open_store

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
    from .index import IndexConfig

    return IndexConfig(show_progress=False)


def upsert_documents(index: Any, encoder: Any, documents: Sequence[dict]) -> Any:
    """Insert ``documents`` (``robustir index`` corpus records: ``_id``, ``title``, ``text``, other fields), replacing
    those whose id exists, as one ``--upsert`` job; returns its :class:`~robustir.serving.index.IndexReport`. Raises
    :class:`ConfigError` when another process holds the index's writer lock, :class:`~robustir.errors.DataError`
    (naming ``documents[i]``) for a record the index refuses."""
    from ..errors import DataError
    from .index import SearchIndex

    writer = SearchIndex.open(index, writable=True, model=encoder)  # the lock: a CLI job running -> ConfigError
    path = None
    try:
        path = write_incoming(index, documents)
        try:
            return writer.upsert(path, config=_quiet())
        except DataError as exc:  # the file's line N is the request's documents[N-1]
            where = f"documents[{exc.line - 1}]" if isinstance(exc.line, int) else "documents"
            field = f".{exc.field}" if exc.field else ""
            fix = f" ({exc.fix})" if exc.fix else ""
            raise DocumentError(f"'{where}{field}' {exc.problem}{fix}", where) from None
    finally:
        writer.close()
        if path is not None and not _job_of(index, path):
            path.unlink(missing_ok=True)  # done, or refused before its job started


def _job_of(index: Any, path: Path) -> bool:
    """Whether the index's manifest still has an unfinished job reading ``path``."""
    from .index import _usable_manifest
    from .storage import open_store

    manifest = _usable_manifest(open_store(index)) or {}
    return (manifest.get("job") or {}).get("input") == str(path)


def delete_documents(index: Any, ids: Sequence[str] | None = None, filter: dict | None = None,
                     limit: int = 10_000) -> Any:
    """Delete the documents with ``ids``, or those ``filter`` matches (at most ``limit``; more is refused, nothing
    deleted), as one ``--delete`` commit. An id not in the index is an error naming it (nothing deleted)."""
    from .index import SearchIndex

    writer = SearchIndex.open(index, writable=True)
    try:
        if filter is not None:
            matched = writer.ids_matching(filter, limit)
            if len(matched) > limit:
                raise ConfigError(f"the filter matches more than {limit} documents; delete them in smaller groups "
                                  "(a narrower filter) or with robustir index --delete")
            if not matched:
                from .index import IndexReport

                return IndexReport("delete", documents=writer.count, deleted=0)
            ids = matched
        return writer.delete(ids or [])
    finally:
        writer.close()
