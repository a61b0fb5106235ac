"""Streaming readers for raw documents, and an output writer that resumes per document.

Readers yield :class:`Document` one at a time (a corpus is never loaded whole) from

* ``jsonl``: one object per line with ``"_id"`` or ``"id"``, optional ``"title"``, and ``"text"``;
* ``beir``: a BEIR folder (its ``corpus.jsonl`` or ``corpus.jsonl.gz``) or a BEIR corpus file (same fields as
  ``jsonl``);
* ``text``: plain UTF-8 text, one document per blank-line-separated block (``text_unit="block"``) or per
  line (``text_unit="line"``); ids are the 0-based block / line numbers.

Any of these files may be gzip-compressed (``.gz``). This is the one reader of raw text: chunking, query
generation, GUR pair mining and pre-training all read through it.

:class:`DocumentOutput` wraps :class:`~robustir.io.ResumableJsonlWriter` so a stage that emits *zero or more*
records per document can be resumed exactly: every finished document is also appended to a sidecar
``<output>.done`` file, and on restart the records of a document that was cut off mid-way (present in the
partial file but not in the done-file) are removed before work continues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from ..errors import ConfigError, DataError
from ..io import ResumableJsonlWriter, Shard, atomic_write, open_binary, read_jsonl, read_lines

__all__ = ["Document", "read_documents", "resolve_format", "DocumentOutput"]

InputFormat = Literal["auto", "jsonl", "text", "beir"]


@dataclass(frozen=True)
class Document:
    """One raw document: ``id`` is unique within its input, ``title`` may be empty."""

    id: str
    title: str
    text: str


def resolve_format(path: str | Path, fmt: str = "auto") -> tuple[Path, str]:
    """Return the file to read and its concrete format (``jsonl`` or ``text``) for ``path`` / ``fmt``."""
    path = Path(path)
    if fmt not in ("auto", "jsonl", "text", "beir"):
        raise ConfigError(f"--format {fmt!r}: expected one of auto, jsonl, text, beir")
    if path.is_dir():
        if fmt not in ("auto", "beir"):
            raise ConfigError(f"{path} is a folder; only --format beir (or auto) reads folders")
        from .beir import corpus_file

        return corpus_file(path), "jsonl"
    if not path.exists():
        raise DataError(path, "file not found", fix="check the path (relative paths are taken from the current folder)")
    if fmt == "beir":
        return path, "jsonl"
    if fmt == "auto":
        suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
        return path, "jsonl" if suffixes and suffixes[-1] in (".jsonl", ".json", ".ndjson") else "text"
    return path, fmt


def read_documents(path: str | Path, fmt: str = "auto", *, text_unit: Literal["block", "line"] = "block",
                   shard: Shard | None = None, need_ids: bool = True) -> Iterator[Document]:
    """Stream the documents of ``path`` (see the module docstring); with ``shard``, only that shard's share.

    Sharding is round-robin over document positions, so it is independent of which documents are done.
    Duplicate ids raise :class:`DataError` (outputs are keyed on them). ``need_ids=False`` (a consumer that
    keys nothing on ids, such as pre-training) accepts JSONL records without an id (id ``L<line>``) and
    duplicate ids.
    """
    file, concrete = resolve_format(path, fmt)
    docs = _read_jsonl_docs(file, need_ids) if concrete == "jsonl" else _read_text_docs(file, text_unit)
    seen: set[str] = set()
    for position, (line, doc) in enumerate(docs):
        if need_ids and doc.id in seen:
            raise DataError(file, f"duplicate document id {doc.id!r}", line=line,
                            fix="give every document a unique id")
        if need_ids:
            seen.add(doc.id)
        if shard is None or shard.owns(position):
            yield doc


def checked_fields(path: str | Path, line: int, obj: dict, what: str = "document",
                   need_id: bool = True) -> tuple[str, str, str]:
    """``(id, title, text)`` of one JSONL record (``_id`` or ``id``; title optional), or a DataError naming the line.

    ``need_id=False``: a record without an id gets ``L<line>``."""
    doc_id = obj.get("_id", obj.get("id"))
    if doc_id is None and not need_id:
        doc_id = f"L{line}"
    if doc_id is None or isinstance(doc_id, (dict, list, bool)) or str(doc_id) == "":
        raise DataError(path, f"missing {what} id", line=line, field="_id",
                        fix=f'give every {what} an id: {{"_id": "doc1", "title": "...", "text": "..."}} ("id" works too)')
    text = obj.get("text")
    if not isinstance(text, str):
        raise DataError(path, f"expected a string, got {type(text).__name__}", line=line, field="text",
                        fix=f'every {what} needs "text": "..."')
    title = obj.get("title") or ""
    if not isinstance(title, str):
        raise DataError(path, f"expected a string, got {type(title).__name__}", line=line, field="title",
                        fix='"title" must be a string (or be left out)')
    return str(doc_id), title, text


def _read_jsonl_docs(path: Path, need_ids: bool = True) -> Iterator[tuple[int, Document]]:
    for line, obj in read_jsonl(path):
        yield line, Document(*checked_fields(path, line, obj, need_id=need_ids))


def _read_text_docs(path: Path, unit: str) -> Iterator[tuple[int, Document]]:
    if unit not in ("block", "line"):
        raise ConfigError(f"text_unit {unit!r}: expected 'block' or 'line'")
    number = 0
    block: list[str] = []
    block_line = 0
    with open_binary(path) as handle:
        for line_no, raw in enumerate(read_lines(handle, path), start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=line_no,
                                fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if unit == "line":
                if line.strip():
                    yield line_no, Document(str(number), "", line.rstrip("\r\n"))
                    number += 1
                continue
            if line.strip():
                if not block:
                    block_line = line_no
                block.append(line)
            elif block:
                yield block_line, Document(str(number), "", "".join(block).rstrip("\r\n"))
                number += 1
                block = []
    if block:
        yield block_line, Document(str(number), "", "".join(block).rstrip("\r\n"))


class DocumentOutput:
    """JSONL output resumable per *document*, including documents that produced no record.

    Usage::

        with DocumentOutput(path) as out:
            for doc in docs:
                if doc.id in out.done: continue
                for record in work(doc): out.write(record)
                out.mark_done(doc.id)
            out.finish()

    Records are appended to ``<path>.partial``; ``mark_done`` appends the id to ``<path>.done`` (flushed).
    A crash between the two leaves records of an unfinished document at the tail of the partial file;
    they carry ``doc_field`` and are dropped on restart, so no record is ever written twice.
    """

    def __init__(self, path: str | Path, doc_field: str = "doc_id") -> None:
        self.path = Path(path)
        self.doc_field = doc_field
        from ..outputs import StageOutput

        self.done_path = StageOutput(self.path).done
        partial = StageOutput(self.path).partial
        self.done: set[str] = set()
        if self.done_path.exists() and partial.exists():
            with open(self.done_path, encoding="utf-8") as handle:
                for line in handle:
                    if not line.endswith("\n"):  # a torn last id means that document was not finished
                        break
                    try:
                        self.done.add(json.loads(line))
                    except json.JSONDecodeError:  # damaged progress: the documents from here on are redone
                        break
            _drop_unfinished(partial, doc_field, self.done)
        else:
            # No usable progress: start clean (a stale done-file must not skip documents).
            self.done_path.unlink(missing_ok=True)
            partial.unlink(missing_ok=True)
        self.writer = ResumableJsonlWriter(self.path)
        self.resumed_docs = len(self.done)
        self.resumed_records = self.writer.count
        self._done_handle = open(self.done_path, "a", encoding="utf-8")
        self._finished = False

    @property
    def count(self) -> int:
        """Records in the output so far (including those from an earlier, interrupted run)."""
        return self.writer.count

    def write(self, record: dict) -> None:
        self.writer.write(record)

    def mark_done(self, doc_id: str) -> None:
        """Record that every record of ``doc_id`` has been written."""
        self._done_handle.write(json.dumps(doc_id, ensure_ascii=False) + "\n")
        self._done_handle.flush()
        self.done.add(doc_id)

    def finish(self) -> Path:
        """Move the complete output into place and remove the done-file."""
        self._done_handle.close()
        final = self.writer.finish()
        self.done_path.unlink(missing_ok=True)
        self._finished = True
        return final

    def close(self) -> None:
        if not self._finished:
            self.writer.close()
            if not self._done_handle.closed:
                self._done_handle.close()

    def __enter__(self) -> "DocumentOutput":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_unfinished(partial: Path, doc_field: str, done: set[str]) -> None:
    """Rewrite ``partial`` keeping complete lines of finished documents only."""
    keep: list[str] = []
    dropped = False
    with open(partial, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.endswith("\n"):
                dropped = True
                break
            try:
                key = json.loads(line).get(doc_field)
            except (json.JSONDecodeError, AttributeError):
                dropped = True
                break
            if key in done:
                keep.append(line)
            else:
                dropped = True
    if dropped:
        with atomic_write(partial) as handle:
            handle.writelines(keep)


def document_step(name: str, config: type, produce: Any) -> Any:
    """The :class:`~robustir.runs.Step` of a stage over raw documents (``chunk``, ``pairs``): ``produce(input,
    output, config, fmt=, text_unit=, shard=, progress=)`` writes the shard's file of ``job.output`` from the
    documents of ``job.inputs["input"]`` (job settings ``format``, ``text_unit``), with a progress bar."""
    from ..outputs import StageOutput, stage_step

    def run(options: Any, job: Any) -> Any:
        import sys

        from tqdm.auto import tqdm

        stage = StageOutput(job.output, job.shard)
        return produce(job.inputs["input"], stage.path, options, fmt=job.settings.get("format", "auto"),
                       text_unit=job.settings.get("text_unit", "block"), shard=stage.shard,
                       progress=lambda docs: tqdm(docs, desc=name, unit="doc", file=sys.stderr, disable=None))

    return stage_step(name, config, run)
