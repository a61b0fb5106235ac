"""BEIR-layout evaluation data: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Validation is strict where a mistake would silently change the numbers (duplicate ids, qrels that
point at unknown ids, a missing qrels header, non-integer scores) and lenient, with a logged count,
where BEIR data in the wild is merely untidy (integer ids become strings; documents whose title and
text are both empty are skipped, and their qrels rows with them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from ..io import read_jsonl

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
        return [f"{t} {x}".strip() if t else x for t, x in zip(self.titles, self.texts)]

    def index_of(self) -> dict[str, int]:
        return {doc_id: i for i, doc_id in enumerate(self.ids)}


@dataclass
class BeirDataset:
    """Queries of one split, the corpus and graded relevance judgements ``qrels[qid][docid] = grade``."""

    corpus: Corpus
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


def load_corpus(path: str | Path) -> tuple[Corpus, int]:
    """Read ``corpus.jsonl`` (``_id``, ``text``, optional ``title``). Returns the corpus and #skipped-empty."""
    path = Path(path)
    corpus = Corpus()
    seen: dict[str, int] = {}
    skipped = 0
    for line, obj in read_jsonl(path):
        doc_id = _as_id(obj.get("_id", obj.get("id")), path, line, "_id")
        if doc_id in seen:
            raise DataError(path, f"duplicate document id {doc_id!r} (first seen on line {seen[doc_id]})",
                            line=line, field="_id", fix="make document ids unique")
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


def load_beir(path: str | Path, split: str = "test", *, unknown_ids: str = "error") -> BeirDataset:
    """Load a BEIR folder for one split, keeping only the queries judged in that split.

    ``unknown_ids``: ``"error"`` (default) raises when a qrels row names a query or document that is not
    in the files; ``"skip"`` drops such rows and logs how many.
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
    corpus, skipped_docs = load_corpus(corpus_path)
    all_queries, skipped_queries = load_queries(queries_path)
    raw_qrels = load_qrels_tsv(qrels_path)
    doc_ids = set(corpus.ids)
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


def _first_existing(root: Path, names: list[str]) -> Path:
    for name in names:
        if (root / name).exists():
            return root / name
    raise DataError(root / names[0], "file not found", fix=f"a BEIR folder needs {names[0]}")


def available_splits(path: str | Path) -> list[str]:
    qrels = Path(path) / "qrels"
    return sorted(p.stem for p in qrels.glob("*.tsv")) if qrels.is_dir() else []
