"""FlagEmbedding-style training JSONL: one ``{"query", "pos", "neg", ...}`` object per line.

Fields:
    query (str), pos (list[str], at least one), neg (list[str], may be empty or absent),
    pos_scores / neg_scores (optional list[float], same length as pos / neg; teacher scores),
    prompt (optional str, a per-example query instruction). Other fields are kept in ``extra``.

A folder of ``*.jsonl`` files is read as their concatenation (sorted by name). ``pos``/``neg`` given as
a bare string are rejected (a common mistake that silently becomes a list of characters elsewhere).
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import DataError
from ..io import read_jsonl

logger = logging.getLogger(__name__)

KNOWN_FIELDS = {"query", "pos", "neg", "pos_scores", "neg_scores", "prompt"}
#: fields robustir's own stages add (ids, removed negatives, planted noise): kept in ``extra`` without a warning
METADATA_FIELDS = {"id", "_id", "qid", "query_id", "pos_id", "pos_ids", "neg_ids", "doc_id", "title", "type",
                   "source", "kind", "lcs", "removed", "planted_pos", "planted_neg", "false_negatives", "metadata"}
_WARNED: dict[str, set[str]] = {}  # path -> unknown field names already warned about


@dataclass
class TrainingExample:
    query: str
    pos: list[str]
    neg: list[str] = field(default_factory=list)
    pos_scores: list[float] | None = None
    neg_scores: list[float] | None = None
    prompt: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict = {"query": self.query, "pos": self.pos, "neg": self.neg}
        if self.pos_scores is not None:
            out["pos_scores"] = self.pos_scores
        if self.neg_scores is not None:
            out["neg_scores"] = self.neg_scores
        if self.prompt is not None:
            out["prompt"] = self.prompt
        out.update(self.extra)
        return out


def _string_list(obj: dict, key: str, path: Path, line: int, required: bool) -> list[str]:
    if key not in obj or obj[key] is None:
        if required:
            raise DataError(path, f"missing field '{key}'", line=line, field=key,
                            fix=f'add "{key}": ["passage text", ...]')
        return []
    value = obj[key]
    if isinstance(value, str):
        raise DataError(path, "expected a list of strings, got a single string", line=line, field=key,
                        fix=f'wrap it in a list: "{key}": ["..."]')
    if not isinstance(value, list):
        raise DataError(path, f"expected a list of strings, got {type(value).__name__}", line=line, field=key)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise DataError(path, f"item {i} is {type(item).__name__}, not a string", line=line, field=key,
                            fix="passages are given as text, not ids (use `robustir mine` to build texts from ids)")
    return value


def _score_list(obj: dict, key: str, n: int, path: Path, line: int) -> list[float] | None:
    if key not in obj or obj[key] is None:
        return None
    value = obj[key]
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise DataError(path, "expected a list of numbers", line=line, field=key)
    bad = next((i for i, v in enumerate(value) if not math.isfinite(v)), None)
    if bad is not None:
        raise DataError(path, f"score {bad} is {value[bad]!r}, not a finite number", line=line, field=key,
                        fix="give every passage a real score, or drop the field")
    if len(value) != n:
        raise DataError(path, f"has {len(value)} scores for {n} passages", line=line, field=key,
                        fix="give exactly one score per passage, in the same order")
    return [float(v) for v in value]


def _warn_unknown_fields(obj: dict, path: Path, line: int) -> None:
    """Warn once per file and field name about a field that is neither a training field nor metadata robustir
    writes itself, so that a misspelt ``negs`` does not silently train without negatives."""
    unknown = [k for k in obj if k not in KNOWN_FIELDS and k not in METADATA_FIELDS]
    if not unknown:
        return
    seen = _WARNED.setdefault(str(path), set())
    new = [k for k in unknown if k not in seen]
    if not new:
        return
    seen.update(new)
    hints = []
    for key in new:
        close = difflib.get_close_matches(key, sorted(KNOWN_FIELDS), n=1, cutoff=0.6)
        hints.append(repr(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    logger.warning("%s, line %d: field(s) %s are not training fields (%s) and are only kept as metadata", path, line,
                   ", ".join(hints), ", ".join(sorted(KNOWN_FIELDS)))


def check_record(obj: dict, path: Path, line: int) -> tuple[str, list[str], list[str]]:
    """The one check of a training record's ``query`` (str), ``pos`` (list of str) and ``neg`` (list of str,
    may be absent); returns them. Every reader of the format goes through here (training, the filters, the LLM
    judge, pre-training pairs), so one file is accepted or refused the same way by every stage."""
    _warn_unknown_fields(obj, path, line)
    query = obj.get("query")
    if not isinstance(query, str):
        raise DataError(path, "missing field 'query'" if query is None else
                        f"expected a string, got {type(query).__name__}", line=line, field="query",
                        fix='every line needs "query": "question text"')
    pos = _string_list(obj, "pos", path, line, required=True)
    neg = _string_list(obj, "neg", path, line, required=False)
    _score_list(obj, "pos_scores", len(pos), path, line)  # checked here too: every stage passes them on
    _score_list(obj, "neg_scores", len(neg), path, line)
    return query, pos, neg


def positives_removed_by_filter(obj: dict) -> bool:
    """A record whose positives a robustir filter removed (``"pos": []``, each in ``removed`` with reason
    ``"positive": true`` and its reason, e.g. ``suspect_positive`` or ``random_like_positive``): kept as a line so
    the filter's output stays aligned with its input; training skips it, later filters pass it on."""
    removed = obj.get("removed")
    return isinstance(removed, list) and any(isinstance(r, dict) and r.get("positive") is True for r in removed)


def parse_example(obj: dict, path: Path, line: int, *, skip_empty_positives: bool = False) -> TrainingExample | None:
    """Validate one JSON object; returns ``None`` for a record to skip (empty query / no non-empty positive).

    An empty ``pos`` list is a :class:`DataError` naming the file and line (a query without a positive cannot be
    trained on, and dropping it silently hides a broken data set), unless a filter emptied it
    (:func:`positives_removed_by_filter`) or ``skip_empty_positives`` asks to skip such records."""
    query, pos, neg = check_record(obj, path, line)
    if not pos and not skip_empty_positives and not positives_removed_by_filter(obj):
        raise DataError(path, "empty positive list: a query needs at least one positive passage to train on",
                        line=line, field="pos", fix="add the query's positive(s) or remove the line; or set "
                        "skip_empty_positives=true to skip such records (they are counted in the log and model card)")
    pos_scores = _score_list(obj, "pos_scores", len(pos), path, line)
    neg_scores = _score_list(obj, "neg_scores", len(neg), path, line)
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(path, f"expected a string, got {type(prompt).__name__}", line=line, field="prompt")
    if not query.strip() or not any(p.strip() for p in pos):
        return None
    # empty negatives are dropped (with their scores) rather than trained on as blank passages
    if any(not n.strip() for n in neg):
        keep = [i for i, n in enumerate(neg) if n.strip()]
        neg = [neg[i] for i in keep]
        neg_scores = [neg_scores[i] for i in keep] if neg_scores is not None else None
    if any(not p.strip() for p in pos):
        keep = [i for i, p in enumerate(pos) if p.strip()]
        pos = [pos[i] for i in keep]
        pos_scores = [pos_scores[i] for i in keep] if pos_scores is not None else None
    extra = {k: v for k, v in obj.items() if k not in KNOWN_FIELDS}
    return TrainingExample(query, pos, neg, pos_scores, neg_scores, prompt, extra)


def training_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted([*path.glob("*.jsonl"), *path.glob("*.jsonl.gz")])
        if not files:
            raise DataError(path, "folder holds no *.jsonl files")
        return files
    if not path.exists():
        raise DataError(path, "file not found")
    return [path]


def iter_training_records(path: str | Path, stats: dict | None = None, files: list[Path] | None = None, *,
                          skip_empty_positives: bool = False) -> Iterator[tuple[int, int, TrainingExample]]:
    """Stream ``(file index, line, example)`` of the validated examples of a file or folder (``files``: its
    :func:`training_files`, when already listed). ``stats`` (if given) counts read / skipped records
    (``skipped_empty``: all skipped; ``skipped_empty_positives``, when any: those skipped for an empty ``pos``
    list under ``skip_empty_positives``). ``skip_empty_positives``: see :func:`parse_example`."""
    stats = stats if stats is not None else {}
    stats.setdefault("read", 0)
    stats.setdefault("skipped_empty", 0)
    for index, file in enumerate(files if files is not None else training_files(path)):
        for line, obj in read_jsonl(file):
            stats["read"] += 1
            example = parse_example(obj, file, line, skip_empty_positives=skip_empty_positives)
            if example is None:
                stats["skipped_empty"] += 1
                if skip_empty_positives and not obj["pos"] and not positives_removed_by_filter(obj):
                    stats["skipped_empty_positives"] = stats.get("skipped_empty_positives", 0) + 1
                continue
            yield index, line, example


def iter_training_examples(path: str | Path, stats: dict | None = None) -> Iterator[TrainingExample]:
    """Stream validated examples from a file or folder. ``stats`` (if given) counts read / skipped records."""
    for _, _, example in iter_training_records(path, stats):
        yield example


def load_training_data(path: str | Path, *, skip_empty_positives: bool = False) -> tuple[list[TrainingExample], dict]:
    stats: dict = {}
    examples = [e for _, _, e in iter_training_records(path, stats, skip_empty_positives=skip_empty_positives)]
    if not examples:
        raise DataError(path, "no usable training example", fix="each line needs a non-empty query and pos")
    return examples, stats


def examples_from_beir(path: str | Path, split: str = "train") -> list[TrainingExample]:
    """(query, positive) pairs from a BEIR folder's qrels split; one example per query, all positives listed.

    Graded qrels: every document with grade > 0 is a positive; the grade is kept in ``pos_scores``.
    """
    from .beir import load_beir

    data = load_beir(path, split)
    texts = dict(zip(data.corpus.ids, data.corpus.texts_for_encoding()))
    examples = []
    for qid, judged in data.qrels.items():
        positives = [(doc_id, grade) for doc_id, grade in judged.items() if grade > 0]
        examples.append(TrainingExample(
            query=data.queries[qid], pos=[texts[d] for d, _ in positives], neg=[],
            pos_scores=[float(g) for _, g in positives],
            extra={"query_id": qid, "pos_ids": [d for d, _ in positives]}))
    return examples


def write_training_data(path: str | Path, examples: Iterable[TrainingExample]) -> int:
    import json

    from ..io import atomic_write

    count = 0
    with atomic_write(path) as handle:
        for example in examples:
            handle.write(json.dumps(example.to_json(), ensure_ascii=False) + "\n")
            count += 1
    return count
