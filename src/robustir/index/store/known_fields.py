"""What an index remembers about its documents' fields -- the manifest's ``fields`` (top-level names a filter may
use) and ``field_kinds`` (path -> kinds) -- kept bounded and shrinking when documents go (issue 52).

Before, both only grew: one request of 2,000 documents x 100 fresh keys left a 7.3 MB manifest after its documents
were deleted, and every filtered search paid for it (24x). Now

* an index knows at most :data:`MAX_FIELDS` top-level field names: a job that would bring it past that is refused
  before anything changes (:func:`check_bound`); an HTTP request is held to the same number
  (:func:`robustir.serving.app` answers 413 ``too_many_fields``);
* a job that removes or replaces documents (``delete``, an ``upsert`` that replaces, ``--discard-unfinished``)
  collects the top-level names those documents held, then :func:`vanished` looks for each in what is left, and the
  names no document holds any more are dropped with their kinds (:func:`forget`).

Why a scan here and not a count per field in the manifest: a count must stay exact across a ``kill -9`` between a
Lance commit and the manifest write, which it cannot (the resumed chunk's replaced rows are already gone); the scan
is exact, reads only the ``fields`` column, stops as soon as every name is found (a common field is found in the
first batch) and runs only when a removed document held a name the job did not write again. Measured on the
2-core box (bench/field_names.py, docs/benchmarks.md): 34 ms for 5,000 documents when the name is gone (the whole
column read); its cost grows with the index, so a delete of documents with rare fields costs a read of ``fields``.
A job killed between its commit and the drop leaves those names known (a filter on one matches nothing instead of
being refused) until a later job that removes documents looks again; never the other way round.
The typed columns (at most 32, :data:`robustir.index.store.table.MAX_TYPED_COLUMNS`) stay: the Lance table keeps its
column, and a later document with that field fills it again.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

__all__ = ["MAX_FIELDS", "top_level_names", "check_bound", "vanished", "forget"]

#: top-level field names an index knows at most (and an HTTP request may bring): ample for metadata, far below what
#: makes the manifest the cost of a query
MAX_FIELDS = 1024


def top_level_names(rows: Iterable[Any]) -> set[str]:
    """The top-level keys of ``fields`` values as Lance returns them (JSON text or dicts)."""
    names: set[str] = set()
    for value in rows:
        if value is None:
            continue
        obj = json.loads(value) if isinstance(value, (str, bytes)) else value
        if isinstance(obj, dict):
            names.update(obj)
    return names


def check_bound(known: Iterable[str], incoming: Iterable[str], where: Any) -> None:
    """Refuse an input whose new top-level field names would make the index know more than :data:`MAX_FIELDS`."""
    from ...errors import DataError

    known = set(known)
    new = set(incoming) - known
    if len(known) + len(new) > MAX_FIELDS:
        raise DataError(where, f"its records hold {len(new)} field names the index does not know yet; with the "
                        f"{len(known)} it knows that is {len(known) + len(new)}, more than the {MAX_FIELDS} an index "
                        "keeps (each is remembered in its manifest and read by every filtered search)",
                        fix="keep open-ended data under one nested field (e.g. \"meta\": {...}: only \"meta\" is a "
                        "field name), or delete documents whose fields are no longer needed; nothing was changed")


def vanished(table: Any, candidates: Iterable[str], batch_rows: int = 8192) -> set[str]:
    """The names among ``candidates`` that no row of ``table`` (a LanceDB table) holds at the top level of its
    ``fields``: one pass over that column, stopped as soon as every candidate was seen."""
    missing = set(candidates)
    if not missing:
        return missing
    for batch in table.search().select(["fields"]).limit(None).to_batches(batch_rows):
        missing -= top_level_names(batch.column("fields").to_pylist())
        if not missing:
            break
    return missing


def forget(manifest: dict, gone: set[str]) -> bool:
    """Drop ``gone`` from the manifest's ``fields`` and their paths from ``field_kinds``; True when it changed."""
    if not gone:
        return False
    manifest["fields"] = [name for name in manifest.get("fields", []) if name not in gone]
    kinds = manifest.get("field_kinds")
    if kinds is not None:
        manifest["field_kinds"] = {path: held for path, held in kinds.items()
                                   if path.split(".", 1)[0] not in gone and path not in gone}
    return True
