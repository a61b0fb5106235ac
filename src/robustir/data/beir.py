"""BEIR-layout evaluation data: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Validation is strict where a mistake would silently change the numbers (duplicate ids, qrels that
point at unknown ids, a missing qrels header, non-integer scores) and lenient, with a logged count,
where BEIR data in the wild is merely untidy (integer ids become strings; documents whose title and
text are both empty are skipped, and their qrels rows with them).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import weakref
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import DataError
from ..io import open_binary, read_jsonl, read_jsonl_at, read_lines

logger = logging.getLogger(__name__)

QRELS_HEADER = ("query-id", "corpus-id", "score")


@dataclass
class Corpus:
    """Documents in file order. ``texts_for_encoding`` joins title and text the way BEIR/MTEB do."""

    ids: list[str] = field(default_factory=list)
    titles: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def texts_for_encoding(self) -> list[str]:
        return [encoding_text(t, x) for t, x in zip(self.titles, self.texts)]

    def index_of(self) -> dict[str, int]:
        return {doc_id: i for i, doc_id in enumerate(self.ids)}


def encoding_text(title: str, text: str) -> str:
    """The text a document is encoded (and BM25-indexed) as: title and text joined the way BEIR/MTEB do."""
    return f"{title} {text}".strip() if title else text


@dataclass
class BeirDataset:
    """Queries of one split, the corpus and graded relevance judgements ``qrels[qid][docid] = grade``."""

    corpus: "Corpus | CorpusFile"
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    path: Path | None = None
    split: str = "test"
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name if self.path else "dataset"


def _as_id(value: object, path: Path, line: int, field_name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(path, f"expected a string id, got {type(value).__name__} {value!r}", line=line,
                        field=field_name, fix='ids must be strings such as "doc-17"')
    text = str(value).strip()
    if not text:
        raise DataError(path, "empty id", line=line, field=field_name, fix="give every record a non-empty id")
    return text


def _as_text(obj: dict, key: str, path: Path, line: int, required: bool) -> str:
    if key not in obj or obj[key] is None:
        if required:
            raise DataError(path, f"missing field '{key}'", line=line, field=key,
                            fix=f'add "{key}": "..." to every line')
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(path, f"expected a string, got {type(value).__name__}", line=line, field=key,
                        fix=f'"{key}" must be a JSON string')
    return value


def _parse_document(obj: dict, path: Path, line: int) -> tuple[str, str, str]:
    """``(id, title, text)`` of one corpus line, checked."""
    doc_id = _as_id(obj.get("_id", obj.get("id")), path, line, "_id")
    return doc_id, _as_text(obj, "title", path, line, required=False), _as_text(obj, "text", path, line, required=True)


def _duplicate_id(path: Path, doc_id: str, first: int, second: int) -> DataError:
    return DataError(path, f"duplicate document id {doc_id!r} (first seen on line {first})", line=second,
                     field="_id", fix="make document ids unique")


def load_corpus(path: str | Path) -> tuple[Corpus, int]:
    """Read ``corpus.jsonl`` (``_id``, ``text``, optional ``title``). Returns the corpus and #skipped-empty."""
    path = Path(path)
    corpus = Corpus()
    seen: dict[str, int] = {}
    skipped = 0
    for line, obj in read_jsonl(path):
        doc_id = _as_id(obj.get("_id", obj.get("id")), path, line, "_id")
        if doc_id in seen:
            raise _duplicate_id(path, doc_id, seen[doc_id], line)
        seen[doc_id] = line
        title = _as_text(obj, "title", path, line, required=False)
        text = _as_text(obj, "text", path, line, required=True)
        if not text.strip() and not title.strip():
            skipped += 1
            continue
        corpus.ids.append(doc_id)
        corpus.titles.append(title)
        corpus.texts.append(text)
    if not corpus.ids:
        raise DataError(path, "no documents", fix="the corpus needs at least one line with non-empty text")
    if skipped:
        logger.warning("%s: skipped %d document(s) whose title and text are empty", path, skipped)
    return corpus, skipped


class CorpusFile:
    """A ``corpus.jsonl`` read on demand: the documents :func:`load_corpus` gives (same rows, same checks, same
    skipped empty documents), but the file is indexed by byte offset and a document is read from it when asked
    for, so a corpus of millions of passages is never held in memory as text.

    Memory: 56 bytes a document (offset, length, line, a hash of its id and one of its stripped
    :func:`encoding_text`, and the sorted id-hash index behind :meth:`row`) -- 56 MB for a million passages. A
    ``.gz`` corpus is decompressed once into a temporary file (in ``spill_dir``, default the system's temporary
    folder), removed by :meth:`close` or when the object is collected. The file must not change while it is used.
    Hashes are Python's own ``hash`` (salted per process): equal hashes are always confirmed on the id or text.
    """

    def __init__(self, path: str | Path, *, spill_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        offsets, lengths, lines, id_hashes, text_hashes = array("q"), array("q"), array("q"), array("q"), array("q")
        skipped: dict[str, int] = {}
        for line, start, length, obj in read_jsonl_at(self.path):
            doc_id, title, text = _parse_document(obj, self.path, line)
            if not text.strip() and not title.strip():
                if doc_id in skipped:
                    raise _duplicate_id(self.path, doc_id, skipped[doc_id], line)
                skipped[doc_id] = line
                continue
            offsets.append(start)
            lengths.append(length)
            lines.append(line)
            id_hashes.append(hash(doc_id))
            text_hashes.append(hash(encoding_text(title, text).strip()))
        self._offsets = np.frombuffer(offsets, dtype=np.int64)
        self._lengths = np.frombuffer(lengths, dtype=np.int64)
        self._lines = np.frombuffer(lines, dtype=np.int64)
        self.id_hashes = np.frombuffer(id_hashes, dtype=np.int64)
        self.text_hashes = np.frombuffer(text_hashes, dtype=np.int64)
        """``hash(encoding_text(title, text).strip())`` of every row: a cheap first test for duplicate texts."""
        self._order = np.argsort(self.id_hashes, kind="stable")
        self._sorted = self.id_hashes[self._order]
        self.skipped = len(skipped)
        source = self.path
        if self.path.suffix == ".gz":  # offsets are into the decompressed bytes: keep those in a file to seek in
            fd, spill = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".jsonl", dir=spill_dir)
            with os.fdopen(fd, "wb") as sink, open_binary(self.path) as handle:
                for raw in read_lines(handle, self.path):
                    sink.write(raw)
            source = Path(spill)
            self._spill_finalizer = weakref.finalize(self, _remove_quietly, spill)
        self._fd = os.open(source, os.O_RDONLY)
        self._fd_finalizer = weakref.finalize(self, os.close, self._fd)
        self._check_unique_ids(skipped)
        if not len(self):
            raise DataError(self.path, "no documents", fix="the corpus needs at least one line with non-empty text")
        if skipped:
            logger.warning("%s: skipped %d document(s) whose title and text are empty", self.path, len(skipped))

    def _check_unique_ids(self, skipped: dict[str, int]) -> None:
        """:func:`load_corpus`'s duplicate-id error, for the first duplicate in file order."""
        pairs = []  # (second line, first line, id)
        same = np.flatnonzero(self._sorted[1:] == self._sorted[:-1])
        first_of: dict[str, int] = {}
        for i in np.unique(np.concatenate([same, same + 1])):
            row = int(self._order[i])
            doc_id = self.id(row)
            line = int(self._lines[row])
            if doc_id in first_of:
                pairs.append((max(line, first_of[doc_id]), min(line, first_of[doc_id]), doc_id))
                first_of[doc_id] = min(line, first_of[doc_id])
            else:
                first_of[doc_id] = line
        for doc_id, line in skipped.items():
            row = self.row(doc_id)
            if row is not None:
                kept = int(self._lines[row])
                pairs.append((max(line, kept), min(line, kept), doc_id))
        if pairs:
            second, first, doc_id = min(pairs)
            self.close()
            raise _duplicate_id(self.path, doc_id, first, second)

    def __len__(self) -> int:
        return len(self._offsets)

    def close(self) -> None:
        """Close the file (and remove a decompressed copy); the object cannot read afterwards."""
        for name in ("_fd_finalizer", "_spill_finalizer"):
            finalizer = getattr(self, name, None)
            if finalizer is not None:
                finalizer()

    def __enter__(self) -> "CorpusFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self, raw: bytes, row: int) -> tuple[str, str, str]:
        try:
            obj = json.loads(raw.decode("utf-8-sig"))
            return _parse_document(obj, self.path, int(self._lines[row]))
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise DataError(self.path, "changed while it was being read", line=int(self._lines[row]),
                            fix="leave the corpus file unchanged while a stage reads it, and run the stage again") \
                from None

    def document(self, row: int) -> tuple[str, str, str]:
        """``(id, title, text)`` of row ``row``."""
        return self._parse(os.pread(self._fd, int(self._lengths[row]), int(self._offsets[row])), row)

    def id(self, row: int) -> str:
        return self.document(row)[0]

    def text(self, row: int) -> str:
        """Row ``row``'s :func:`encoding_text`."""
        _, title, text = self.document(row)
        return encoding_text(title, text)

    def documents(self, start: int = 0, stop: int | None = None) -> list[tuple[str, str, str]]:
        """``(id, title, text)`` of rows ``start`` to ``stop``, read in one go."""
        stop = len(self) if stop is None else min(stop, len(self))
        if start >= stop:
            return []
        base = int(self._offsets[start])
        block = os.pread(self._fd, int(self._offsets[stop - 1] + self._lengths[stop - 1]) - base, base)
        return [self._parse(block[int(o) - base:int(o + n) - base], row)
                for row, o, n in zip(range(start, stop), self._offsets[start:stop], self._lengths[start:stop])]

    def texts(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The :func:`encoding_text` of rows ``start`` to ``stop``."""
        return [encoding_text(title, text) for _, title, text in self.documents(start, stop)]

    def iter_documents(self, chunk: int = 10_000) -> Iterator[tuple[str, str, str]]:
        """Every ``(id, title, text)`` in row order, ``chunk`` rows read at a time."""
        for start in range(0, len(self), chunk):
            yield from self.documents(start, start + chunk)

    def pieces(self, rows: int) -> dict[str, np.ndarray] | None:
        """The corpus cut into ranges of ``rows`` rows (the last shorter) for readers in other processes
        (:func:`read_corpus_range`): per range the bytes ``start``/``stop``, the ``first_row``, its ``rows`` and the
        ``first_line``, 40 bytes a range. None for a ``.gz`` corpus: its offsets are into a decompressed copy only this
        process has."""
        if self.path.suffix == ".gz":
            return None
        firsts = np.arange(0, len(self), max(1, int(rows)), dtype=np.int64)
        lasts = np.minimum(firsts + rows, len(self)) - 1
        return {"start": self._offsets[firsts], "stop": self._offsets[lasts] + self._lengths[lasts],
                "first_row": firsts, "rows": lasts - firsts + 1, "first_line": self._lines[firsts]}

    def row(self, doc_id: str) -> int | None:
        """The row of document ``doc_id`` (None when the corpus has no such document)."""
        h = hash(doc_id)
        i = int(np.searchsorted(self._sorted, h))
        while i < len(self._sorted) and self._sorted[i] == h:
            row = int(self._order[i])
            if self.id(row) == doc_id:
                return row
            i += 1
        return None

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and self.row(doc_id) is not None


def read_corpus_range(path: str | Path, start: int, stop: int, first_line: int, rows: int) -> list[str]:
    """The :func:`encoding_text` of the ``rows`` documents a :class:`CorpusFile` of the plain corpus ``path`` holds in
    its bytes ``[start, stop)`` (:meth:`CorpusFile.pieces`), read by another process: the same lines, checks and
    skipped empty documents, so the texts are those of the corpus's rows. A count other than ``rows`` means the file
    changed since it was indexed: a :class:`DataError`."""
    path = Path(path)
    texts = []
    fix = "leave the corpus file unchanged while a stage reads it, and run the stage again"
    try:
        for line, _, _, obj in read_jsonl_at(path, start, stop, first_line):
            _, title, text = _parse_document(obj, path, line)
            if text.strip() or title.strip():
                texts.append(encoding_text(title, text))
    except DataError as error:  # the file was read whole without one when it was indexed
        raise DataError(path, f"changed while it was being read ({error.problem})", line=error.line, fix=fix) \
            from None
    if len(texts) != rows:
        raise DataError(path, f"changed while it was being read (lines {first_line}.. hold {len(texts)} documents "
                              f"where {rows} were indexed)", fix=fix)
    return texts


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # its temporary folder went first
        pass


def load_queries(path: str | Path) -> tuple[dict[str, str], int]:
    """Read ``queries.jsonl`` (``_id``, ``text``). Returns queries and #skipped-empty."""
    path = Path(path)
    queries: dict[str, str] = {}
    lines: dict[str, int] = {}
    skipped = 0
    for line, obj in read_jsonl(path):
        qid = _as_id(obj.get("_id", obj.get("id")), path, line, "_id")
        if qid in lines:
            raise DataError(path, f"duplicate query id {qid!r} (first seen on line {lines[qid]})", line=line,
                            field="_id", fix="make query ids unique")
        lines[qid] = line
        text = _as_text(obj, "text", path, line, required=True)
        if not text.strip():
            skipped += 1
            continue
        queries[qid] = text
    if skipped:
        logger.warning("%s: skipped %d query(ies) with empty text", path, skipped)
    return queries, skipped


def load_qrels_tsv(path: str | Path) -> dict[str, dict[str, int]]:
    """Read a BEIR qrels TSV with its ``query-id<TAB>corpus-id<TAB>score`` header (graded scores allowed)."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, "file not found", fix="BEIR qrels live at <dataset>/qrels/<split>.tsv")
    qrels: dict[str, dict[str, int]] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=number,
                                fix="re-encode the file as UTF-8") from None
            if not text.strip():
                continue
            parts = text.split("\t")
            if number == 1:
                if tuple(p.strip().lower() for p in parts[:3]) != QRELS_HEADER:
                    raise DataError(path, f"missing header; first line is {text[:60]!r}", line=1,
                                    fix="add the line 'query-id<TAB>corpus-id<TAB>score' at the top "
                                        "(for TREC-format qrels 'qid 0 docid rel' use a .qrels/.txt file)")
                continue
            if len(parts) != 3:
                raise DataError(path, f"expected 3 tab-separated fields, got {len(parts)}", line=number,
                                fix="rows are query-id<TAB>corpus-id<TAB>score")
            qid, doc_id, score_text = (p.strip() for p in parts)
            try:
                value = float(score_text)
            except ValueError:
                raise DataError(path, f"score {score_text!r} is not a number", line=number, field="score",
                                fix="scores are integers (graded relevance, 0 = not relevant)") from None
            if not value.is_integer():  # 0.5 must not silently become 0 (not relevant); nan / inf are no grade
                raise DataError(path, f"score {score_text!r} is not an integer", line=number, field="score",
                                fix="scores are integers (graded relevance, 0 = not relevant)")
            score = int(value)
            qrels.setdefault(qid, {})[doc_id] = score
    return qrels


def load_beir(path: str | Path, split: str = "test", *, unknown_ids: str = "error",
              corpus_on_disk: bool = False) -> BeirDataset:
    """Load a BEIR folder for one split, keeping only the queries judged in that split.

    ``unknown_ids``: ``"error"`` (default) raises when a qrels row names a query or document that is not
    in the files; ``"skip"`` drops such rows and logs how many. ``corpus_on_disk``: the corpus is a
    :class:`CorpusFile` (documents read from the file on demand) instead of a :class:`Corpus` in memory.
    """
    root = Path(path)
    if not root.is_dir():
        raise DataError(root, "not a folder", fix="pass a BEIR folder holding corpus.jsonl, queries.jsonl, qrels/")
    corpus_path = _first_existing(root, ["corpus.jsonl", "corpus.jsonl.gz"])
    queries_path = _first_existing(root, ["queries.jsonl", "queries.jsonl.gz"])
    qrels_path = root / "qrels" / f"{split}.tsv"
    if not qrels_path.exists():
        available = sorted(p.stem for p in (root / "qrels").glob("*.tsv")) if (root / "qrels").is_dir() else []
        raise DataError(qrels_path, f"split {split!r} not found", fix=f"available splits: {available or 'none'}")
    if corpus_on_disk:
        corpus = CorpusFile(corpus_path)
        skipped_docs = corpus.skipped
    else:
        corpus, skipped_docs = load_corpus(corpus_path)
    all_queries, skipped_queries = load_queries(queries_path)
    raw_qrels = load_qrels_tsv(qrels_path)
    doc_ids = corpus if corpus_on_disk else set(corpus.ids)
    qrels: dict[str, dict[str, int]] = {}
    dropped_rows = 0
    for qid, judged in raw_qrels.items():
        if qid not in all_queries:
            if unknown_ids == "error" and not skipped_queries:
                raise DataError(qrels_path, f"query id {qid!r} is not in {queries_path.name}", field="query-id",
                                fix="remove the row or add the query (or pass unknown_ids='skip')")
            dropped_rows += len(judged)
            continue
        kept = {}
        for doc_id, grade in judged.items():
            if doc_id not in doc_ids:
                if unknown_ids == "error" and not skipped_docs:
                    raise DataError(qrels_path, f"corpus id {doc_id!r} (query {qid!r}) is not in "
                                    f"{corpus_path.name}", field="corpus-id",
                                    fix="remove the row or add the document (or pass unknown_ids='skip')")
                dropped_rows += 1
                continue
            kept[doc_id] = grade
        if any(g > 0 for g in kept.values()):
            qrels[qid] = kept
    if dropped_rows:
        logger.warning("%s: dropped %d qrels row(s) naming unknown or skipped ids", qrels_path, dropped_rows)
    queries = {qid: all_queries[qid] for qid in qrels}
    if not queries:
        raise DataError(qrels_path, "no judged query with a relevant document",
                        fix="check that qrels ids match queries.jsonl / corpus.jsonl")
    return BeirDataset(corpus, queries, qrels, path=root, split=split,
                       skipped={"documents": skipped_docs, "queries": skipped_queries, "qrels_rows": dropped_rows})


CORPUS_FILES = ("corpus.jsonl", "corpus.jsonl.gz")


def is_beir_folder(path: str | Path) -> bool:
    """Whether ``path`` is a BEIR folder: a folder holding ``corpus.jsonl`` (or ``.gz``) or a ``qrels/`` folder -- the
    one rule every stage uses to tell a BEIR folder from a folder of training JSONL files (a part missing is then
    named by :func:`load_beir`)."""
    path = Path(path)
    return path.is_dir() and (any((path / name).exists() for name in CORPUS_FILES) or (path / "qrels").is_dir())


def corpus_file(folder: str | Path) -> Path:
    """The corpus file of a BEIR folder (``corpus.jsonl``, else ``corpus.jsonl.gz``); a :class:`DataError` naming the
    folder when it has none."""
    folder = Path(folder)
    for name in CORPUS_FILES:
        if (folder / name).exists():
            return folder / name
    raise DataError(folder, "holds no corpus.jsonl(.gz)", fix="give a BEIR folder (corpus.jsonl, queries.jsonl, "
                    "qrels/) or a corpus JSONL file")


def _first_existing(root: Path, names: list[str]) -> Path:
    for name in names:
        if (root / name).exists():
            return root / name
    raise DataError(root / names[0], "file not found", fix=f"a BEIR folder needs {names[0]}")


def available_splits(path: str | Path) -> list[str]:
    qrels = Path(path) / "qrels"
    return sorted(p.stem for p in qrels.glob("*.tsv")) if qrels.is_dir() else []
