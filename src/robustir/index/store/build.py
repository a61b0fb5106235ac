"""Building an index (``robustir index --corpus``): afresh, resumed, or aside a live one and swapped in
(``--overwrite``); the build as a :class:`~robustir.runs.Step`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

from ...errors import DataError
from .jobs import ATOMIC as _ATOMIC
from .jobs import storage_errors
from .storage import IndexStore
from .stores import open_store
from .config import need_pool, EncoderPoolFactory, FORMAT, IndexConfig, IndexReport, MANIFEST, BUILDING, DATA
from .records import _scan_corpus, _corpus_digest, _model_digest, _model_label, _load_encoder
from .table import _typed_columns, _create_table, _open_table
from .manifest import (_read_manifest, _write_manifest, _finished, _index_fingerprint, _IndexRecord, _usable_manifest,
                       _pending_rebuild, _discard_rebuild, _free_data_name, _remove)

logger = logging.getLogger(__name__)


class Builder:
    """The builds of :class:`~robustir.index.store.SearchIndex`."""

    # ------------------------------------------------------------------ making and opening
    @classmethod
    def build(cls, path: str | os.PathLike | IndexStore, model: Any, corpus: str | os.PathLike, *,
              config: IndexConfig | None = None, encoder_options: dict | None = None, overwrite: bool = False,
              on_chunk: Any = None, on_change: Literal["refuse", "redo"] = "refuse",
              storage_options: dict | None = None,
              encoder_pool: EncoderPoolFactory | None = None) -> tuple["SearchIndex", IndexReport]:
        """Encode ``corpus`` with ``model`` into a new index at ``path`` (a folder, or ``s3://bucket/prefix`` with
        ``storage_options``: :mod:`robustir.index.store.storage`); a killed build of the same corpus is resumed,
        a finished one left as it is (``overwrite`` starts afresh). An index of another corpus, model or encoding is
        refused naming the difference, or (``on_change="redo"``) rebuilt as with ``overwrite``. ``config.ann``, the
        vector index, is kept in the manifest and applied after every job. ``on_chunk(position)`` runs after each
        commit."""
        config = config or IndexConfig()
        if config.engine != "process":
            need_pool(config, encoder_pool)
        store = open_store(path, storage_options)
        started = time.perf_counter()
        kinds: dict[str, set] = {}
        scanned = _scan_corpus(corpus, config.format, kinds)  # a missing corpus or bad input fails before the model
        if not scanned[1]:
            raise DataError(corpus, "no documents", fix="the corpus needs at least one record with non-empty text")
        lock = store.lock()  # one writer at a time; held by the index returned, released by close()
        try:
            with storage_errors(store.path):
                made = functools.partial(cls, encoder_pool=encoder_pool)  # type: ignore[call-arg]
                index, report = cls._build(store, model, corpus, config, encoder_options, overwrite, on_chunk,
                                           scanned, kinds, on_change, made)
            index._lock, index.encoder_pool = lock, encoder_pool
        except BaseException:
            lock.release()
            raise
        report.seconds = time.perf_counter() - started
        return index, report

    @classmethod
    def _build(cls, store: IndexStore, model: Any, corpus: str | os.PathLike, config: IndexConfig,
               encoder_options: dict | None, overwrite: bool, on_chunk: Any,
               scanned: tuple[int, dict[str, int], set[str]],
               kinds: dict[str, set] | None = None, on_change: str = "refuse",
               make: Any = None) -> tuple["SearchIndex", IndexReport]:
        make = make or cls  # the index class with what the caller gave it (the encoder pool)
        encoder, label = _load_encoder(model, config, encoder_options or {})
        identity = _identity(encoder, label)
        build = {"input": str(corpus), "digest": _corpus_digest(corpus, config.format)}
        path = store.path
        made = _index_fingerprint({**identity, "build": build})
        fresh = functools.partial(_fresh, identity, build, kinds or {}, config)

        def changes(manifest: dict) -> list[str]:
            return made.differences(_index_fingerprint(manifest))

        # a rebuild beside a live index (--overwrite) killed earlier: resumed when it is of this corpus and model
        pending = _pending_rebuild(store)
        if pending is not None and changes(pending):
            if overwrite or on_change == "redo":
                _discard_rebuild(store, pending)
            pending = None
        if pending is not None:
            index = make(store, _open_table(store, pending, writable=True), pending, writable=True, encoder=encoder,
                        manifest_name=BUILDING)
            return index, index._run("build", corpus, config, on_chunk, scanned)
        live = store.exists(MANIFEST)
        current = _usable_manifest(store) if live else None
        if current is not None and (current.get("job") or {}).get("kind") in _ATOMIC:  # a killed delete / compact
            make(store, _open_table(store, current, writable=True), current, writable=True)._finish_job()
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
            index = make(store, _open_table(store, manifest, writable=True), manifest, writable=True, encoder=encoder,
                        manifest_name=BUILDING)
            return index, index._run("build", corpus, config, on_chunk, scanned)
        if overwrite:  # nothing finished to keep serving (none, damaged, or an unfinished build): start afresh here
            _remove(store)
            live = False
        if live:
            manifest = _read_manifest(store)
            reused = cls._reuse(store, manifest, made, encoder)
            if reused is not None:
                return reused
        else:
            store.prepare()
            manifest = fresh(DATA, 0)
            _create_table(store, manifest, int(encoder.dim))
            _write_manifest(store, manifest)
        index = make(store, _open_table(store, manifest, writable=True), manifest, writable=True, encoder=encoder)
        return index, index._run("build", corpus, config, on_chunk, scanned)

    @classmethod
    def _reuse(cls, store: IndexStore, manifest: dict, made: Any, encoder: Any) -> tuple[Any, IndexReport] | None:
        """The one "done?" rule on the manifest (:meth:`robustir.runs.Artifact.decide`): a finished index of this
        corpus and model is left as it is (checked); an unfinished one of them is resumed (None); an index of
        another corpus or model is refused, naming the difference."""
        fix = ("Fix: add documents with --add / --upsert, or rebuild with --overwrite (the index is served as it "
               "is until the new one is complete)" if _finished(manifest) else
               "Fix: re-run the first command to finish it, or add --overwrite to start afresh")
        if _IndexRecord(store, manifest).decide(made, on_change="refuse", fix=fix).state != "reuse":
            return None
        index = cls(store, _open_table(store, manifest, writable=True), manifest, writable=True, encoder=encoder)
        index._verify()
        return index, IndexReport("build", documents=index.count, nothing_to_do=True)


def _identity(encoder: Any, label: str) -> dict:
    """What the manifest records of the model: a local model by its absolute path (the index opens from any working
    folder), its name, its files' digest; the vectors' size and the encoder settings."""
    source = Path(encoder.source) if encoder.source else None
    local = source is not None and source.exists()
    return {"format": FORMAT, "dim": int(encoder.dim),
            "model": {"path": str(source.resolve()) if local else (encoder.source or label),  # type: ignore
                      "name": _model_label(encoder.source or label),
                      "digest": _model_digest(source) if local and source.is_dir() else None},  # type: ignore
            "encoder": dataclasses.asdict(encoder.config)}


def _fresh(identity: dict, build: dict, kinds: dict[str, set], config: IndexConfig, data: str,
           generation: int) -> dict:
    """The manifest of a new, empty index in the data folder ``data``."""
    return {**identity, "build": build, "data": data, "generation": generation, "fields": [], "field_kinds": {},
            "columns": _typed_columns(kinds), "job": None,
            "version": None, "documents": 0, "files": {}, "jobs_done": 0, "retired": [],
            "ann": {**dataclasses.asdict(config.ann), "indexed": False}}

