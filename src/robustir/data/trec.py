"""Plain TREC files: qrels (``qid 0 docid rel``) and runs (``qid Q0 docid rank score tag``)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..errors import DataError
from ..io import atomic_write

Run = dict[str, dict[str, float]]
Qrels = dict[str, dict[str, int]]


def _rows(path: Path, expected: int, what: str):
    if not path.exists():
        raise DataError(path, "file not found")
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=number,
                                fix="re-encode the file as UTF-8") from None
            if not text:
                continue
            parts = text.split()
            if len(parts) != expected:
                raise DataError(path, f"expected {expected} whitespace-separated fields, got {len(parts)}",
                                line=number, fix=f"TREC {what} rows look like: {_EXAMPLES[what]}")
            yield number, parts


_EXAMPLES = {"qrels": "q1 0 doc7 1", "run": "q1 Q0 doc7 1 12.5 mysystem"}


def read_trec_qrels(path: str | Path) -> Qrels:
    path = Path(path)
    qrels: Qrels = {}
    for number, (qid, _, doc_id, rel) in _rows(path, 4, "qrels"):
        try:
            value = float(rel)
        except ValueError:
            raise DataError(path, f"relevance {rel!r} is not a number", line=number, field="rel") from None
        if not value.is_integer():  # 0.5 must not silently become 0 (not relevant); nan / inf are no grade
            raise DataError(path, f"relevance {rel!r} is not an integer", line=number, field="rel",
                            fix="relevance grades are integers (0 = not relevant)")
        qrels.setdefault(qid, {})[doc_id] = int(value)
    return qrels


def read_trec_run(path: str | Path) -> Run:
    path = Path(path)
    run: Run = {}
    for number, (qid, _, doc_id, _rank, score, _tag) in _rows(path, 6, "run"):
        try:
            run.setdefault(qid, {})[doc_id] = float(score)
        except ValueError:
            raise DataError(path, f"score {score!r} is not a number", line=number, field="score") from None
    return run


def write_trec_run(path: str | Path, run: Mapping[str, Mapping[str, float]], tag: str = "robustir") -> None:
    """Write a run sorted by score (descending) per query, ranks from 1, atomically."""
    with atomic_write(path) as handle:
        for qid in run:
            ranked = sorted(run[qid].items(), key=lambda kv: (-kv[1], kv[0]))
            for rank, (doc_id, score) in enumerate(ranked, start=1):
                handle.write(f"{qid} Q0 {doc_id} {rank} {score:.6f} {tag}\n")
