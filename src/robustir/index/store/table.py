"""The Lance table: its schema, typed columns, creation and opening."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from ...errors import ConfigError, DataError
from .storage import IndexStore
from .config import TABLE

logger = logging.getLogger(__name__)


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
    (:func:`~robustir.index.store.lance_sql.column_kind`): ``{field: {"column": "t0", "kind": "string", "usable":
true}}``. 
    Measured (docs/benchmarks.md, issue 36): at 100k rows a filter that reads the JSON column costs 5-6x an
    unfiltered dense search, because LanceDB parses each row's JSON per condition; with a typed column and its scalar
    index it costs 0.6-1.0x (the prefilter selects fewer rows), and about 1.1-1.2x without the index (a one-off
    script while choosing this)."""
    from .lance_sql import column_kind

    chosen = {}
    for name in sorted(kinds):
        kind = column_kind(kinds[name])
        if kind is not None and len(chosen) < MAX_TYPED_COLUMNS:
            chosen[name] = {"column": f"t{len(chosen)}", "kind": kind, "usable": True}
    return chosen


def _quote(text: str) -> str:
    """``text`` as an SQL string literal (LanceDB takes no bound parameters): quotes doubled, NUL refused."""
    from .lance_sql import _sql_string

    if "\x00" in text:
        raise DataError(None, f"id {text[:40]!r} holds a NUL character", fix="remove it from the id")
    return _sql_string(text)


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

