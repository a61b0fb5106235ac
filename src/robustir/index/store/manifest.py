"""The manifest: what the index is (:class:`Manifest`, a pydantic model), read (validated once, its digest verified)
and written atomically; the rebuild's
manifest beside it; the index as a :class:`~robustir.runs.Step`'s record."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from ...errors import ConfigError, DataError
from ...runs import Artifact, Fingerprint, fingerprint
from .jobs import ATOMIC
from .storage import IndexStore, ObjectPath
from .config import FORMAT, AnnConfig, MANIFEST, BUILDING, DATA

logger = logging.getLogger(__name__)


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


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


class _ModelRecord(_Part):
    path: StrictStr
    name: StrictStr


class _FileRecord(_Part):
    """A data file's size and checksum: its SHA-256 (a local folder) or the ETag the listing gave (an object store)."""

    size: StrictInt
    sha256: StrictStr | None = None
    etag: StrictStr | None = None

    @model_validator(mode="after")
    def _summed(self) -> "_FileRecord":
        if self.sha256 is None and self.etag is None:
            raise ValueError("no checksum")
        return self


class _Retired(BaseModel):
    data: StrictStr
    at: StrictInt | StrictFloat

    @field_validator("data")
    @classmethod
    def _ours(cls, data: str) -> str:
        if not data.startswith(DATA) or "/" in data:
            raise ValueError("not a data folder of the index")
        return data


class _JobRecord(BaseModel):
    """:class:`~robustir.index.store.jobs.Job` as the manifest records it."""

    model_config = ConfigDict(extra="forbid")
    id: StrictInt
    kind: Literal["build", "add", "upsert", "delete", "compact"]
    input: StrictStr
    position: StrictInt = 0
    skipped: StrictInt = 0
    base: StrictInt | None = None


class Manifest(_Part):
    """The index's manifest (``manifest.json``), validated once per read (:func:`_read_manifest`). Fields in the order
    they are checked; unknown ones are kept (a later robustir's, digested with the rest)."""

    format: StrictStr
    dim: StrictInt
    model: _ModelRecord
    encoder: dict[str, Any]
    fields: list[StrictStr]
    documents: StrictInt
    files: dict[str, _FileRecord]
    data: StrictStr
    digest: StrictStr
    retired: list[_Retired] | None = None
    jobs_done: StrictInt = Field(0, ge=0)
    version: StrictInt | None = None
    job: _JobRecord | None = None
    ann: dict[str, Any] | None = None
    build: dict[str, Any] | None = None

    @field_validator("data")
    @classmethod
    def _data_folder(cls, data: str) -> str:
        if not _is_data_name(data):
            raise PydanticCustomError("data_folder", "field 'data' is {data}, not a data folder of the index",
                                      {"data": repr(data[:60])})
        return data

    @model_validator(mode="after")
    def _settings(self) -> "Manifest":
        """The job's id follows the finished ones; the ANN and encoder settings are what their configs accept."""
        from ...models.encoder import EncoderConfig

        if self.job is not None and self.job.id != self.jobs_done + 1:  # rows of earlier jobs carry ids <= jobs_done
            raise PydanticCustomError("job_id", "its unfinished job has id {id}, but the next job's id is {next}",
                                      {"id": self.job.id, "next": self.jobs_done + 1})
        ann = self.ann or {}
        try:
            AnnConfig(**{k: v for k, v in ann.items() if k in ("kind", "threshold", "nprobes", "refine_factor")})
            EncoderConfig(**self.encoder)
        except (ConfigError, TypeError) as exc:
            raise PydanticCustomError("settings", "its settings are malformed ({exc})", {"exc": str(exc)}) from None
        if not isinstance(ann.get("indexed", False), bool):
            raise PydanticCustomError("ann_indexed", "field 'ann.indexed' is not true or false")
        return self


#: the fields whose kind is named before the digest is compared (the rest after it), with the kind's name
_KINDS = {"format": "str", "dim": "int", "model": "dict", "encoder": "dict", "fields": "list", "documents": "int",
          "files": "dict", "data": "str", "digest": "str"}
_PARTS = {"version": "int", "job": "dict", "ann": "dict", "build": "dict"}


def _kind_error(error: dict) -> bool:
    """Whether pydantic's ``error`` is a field of :data:`_KINDS` missing or of another kind (or no JSON object)."""
    loc, kind = error["loc"], error["type"]
    return (not loc and kind == "model_type") or (len(loc) == 1 and loc[0] in _KINDS
                                                  and (kind == "missing" or kind.endswith("_type")))


def _problem(error: dict, manifest: Any) -> tuple[str, str | None]:
    """pydantic's error on the manifest as (what is wrong, the field), worded as the user meets it."""
    loc, kind = error["loc"], error["type"]
    key = str(loc[0]) if loc else "format"
    if _kind_error(error):
        return f"field {key!r} is missing or not a {_KINDS.get(key, 'dict')}", key
    if kind in ("data_folder", "job_id", "settings", "ann_indexed"):
        return error["msg"], {"settings": None, "job_id": "job", "ann_indexed": "ann"}.get(kind, key)
    if key in _PARTS and len(loc) == 1:
        return f"field {key!r} is not a {_PARTS[key]}", key
    if key == "job":
        return f"its unfinished job is malformed: {json.dumps(manifest.get('job'))[:120]}", key
    named = {"fields": "field 'fields' holds a non-string name", "model": "field 'model' lacks its path or name",
             "retired": "field 'retired' is malformed", "jobs_done": "field 'jobs_done' is not a count"}
    if key == "files" and len(loc) > 1:
        return f"the record of data file {loc[1]!r} is malformed", key
    return named.get(key, f"field {key!r} is malformed ({error['msg']})"), key


def _read_manifest(store: IndexStore, name: str = MANIFEST) -> dict:
    """The manifest ``name`` of the index, checked: JSON, this format, every part typed (:class:`Manifest`, once), its
    own digest (an edited manifest -- other encoder settings, no file records, a hand-written job -- is refused
    rather than trusted). A field of the wrong kind is named before the digest is compared, a damaged part after."""
    file = store.where(name)
    from ...io import parse_json_line

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
    damaged = "the manifest was damaged or edited: rebuild the index with --overwrite"
    try:
        Manifest.model_validate(manifest)
        problem = None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        kinds = [e for e in errors if _kind_error(e)]  # named first, as before the digest
        problem = _problem((kinds or errors)[0], manifest)
        if kinds:
            raise DataError(file, problem[0], field=problem[1], fix=damaged) from None
    if manifest["digest"] != _manifest_digest(manifest):
        raise DataError(file, "was edited after robustir wrote it (its digest does not match its content)",
                        field="digest", fix="restore the manifest robustir wrote, or rebuild the index with "
                        "--overwrite (an index's settings are fixed when it is built)")
    if problem is not None:
        raise DataError(file, problem[0], field=problem[1], fix=damaged)
    return manifest


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


def served_version(manifest: dict) -> int | None:
    """The Lance version readers serve: the one recorded when the last job finished, or during a first build the one
    it started from (its empty table). None -- readers read the latest -- beside a delete or compact (one commit
    each, whole before and after it) and for an index recorded before jobs kept their base version."""
    if (manifest.get("job") or {}).get("kind") in ATOMIC:
        return None
    if manifest.get("version") is not None:
        return int(manifest["version"])
    base = (manifest.get("job") or {}).get("base")
    return int(base) if base is not None else None


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


def _remove(store: IndexStore) -> None:
    store.delete(MANIFEST)
    store.delete(BUILDING)
    for folder in store.folders():
        if _is_data_name(folder):
            store.remove_tree(folder)


def verify(index: Any, *, digests: bool = True) -> None:
    """Every data file the manifest records has its size and SHA-256 (Lance never rewrites a file, so this holds
    while writers add files); Lance's newest version is not older than the recorded one (version files deleted
    or not copied: Lance would quietly serve an older state); with no job in the manifest and no writer at work,
    the table is at the recorded version and holds the recorded count (else it was changed outside robustir)."""
    recorded = index.manifest.get("files") or {}
    fix = "the index is damaged: rebuild it with --overwrite (robustir index --corpus CORPUS --output IDX)"
    if index.manifest.get("documents") and not recorded:
        raise DataError(index.path / index._manifest_name, f"records {index.manifest['documents']} documents but no "
                        "data file", field="files", fix=fix)
    present = index.store.listing(index.manifest["data"]) if recorded else {}
    for name, meta in sorted(recorded.items()):
        file, have = index.store.where(name), present.get(name)
        if have is None:
            raise DataError(file, "is missing", fix=fix)
        if have["size"] != meta["size"]:
            raise DataError(file, f"is {have['size']} bytes, the index recorded {meta['size']} (truncated or "
                            "overwritten)", fix=fix)
        if "etag" in meta:  # an object store: a rewritten object has another ETag (known from the listing)
            if have.get("etag") != meta["etag"]:
                raise DataError(file, "was rewritten after it was written (its ETag differs from the recorded "
                                "one)", fix=fix)
        elif digests and index.store.sha256(name) != meta["sha256"]:
            raise DataError(file, "was edited after it was written (its SHA-256 differs from the recorded one)",
                            fix=fix)
    version, recorded_version = int(index._table.version), index.manifest.get("version")
    if recorded_version is not None and version < recorded_version:
        raise DataError(index.path / index.manifest["data"], f"Lance's newest version is {version} but the index "
                        f"recorded version {recorded_version}: the newest version files (_versions/) are missing",
                        fix=fix)
    if index.manifest.get("job") is None and recorded_version is not None:
        if version != recorded_version and (index.writable or not index.store.writer_running()):
            raise DataError(index.path / index.manifest["data"], f"is at Lance version {version} but the index "
                            f"recorded {recorded_version} and no robustir job is at work: it was changed outside "
                            "robustir", fix=fix)
        count = int(index._table.count_rows())
        if version == recorded_version and count != index.manifest.get("documents"):
            raise DataError(index.path, f"holds {count} documents but its manifest says "
                            f"{index.manifest.get('documents')}", fix="the index was changed outside robustir: "
                            "rebuild it with --overwrite")
