"""Text-only checks of a training set, streamed over every record: degenerate records, duplicates, a passage used
as the positive of very many queries, and leakage into an evaluation split.

Memory: each record leaves a few 8-byte hashes (its normalised query, the record and each positive) in arrays,
about 40 bytes a record (40 MB for a million) -- the only state that grows with the file. Texts are compared
*normalised* (:func:`normalize`: case, punctuation and spacing ignored), which is what "the same or near-same
query" means here; the teacher's cosine catches the paraphrases among the sampled records
(:mod:`robustir.audit.run`).
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field

import numpy as np

from ..io import text_digest

__all__ = ["normalize", "text_hash", "TextChecks", "degenerate_reasons"]

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalize(text: str) -> str:
    """Lower case, every run of non-word characters one space, stripped: ``"What is X?"`` -> ``"what is x"``."""
    return _NON_WORD.sub(" ", text.casefold()).strip()


def text_hash(text: str) -> int:
    """A 63-bit hash of the normalised text (collisions: about 1 in 10^19 per pair)."""
    return int.from_bytes(text_digest(normalize(text)), "little") >> 1


def degenerate_reasons(query: str, pos: list[str], neg: list[str], *, min_query_words: int,
                       min_passage_words: int) -> list[tuple[str, str]]:
    """``(reason, text)`` for what makes a record useless or harmful to train on."""
    out: list[tuple[str, str]] = []
    q = normalize(query)
    if not q:
        out.append(("empty_query", query))
    elif len(q.split()) < min_query_words:
        out.append(("short_query", query))
    for text in pos:
        p = normalize(text)
        if not p:
            out.append(("empty_positive", text))
        elif len(p.split()) < min_passage_words:
            out.append(("short_positive", text))
        if q and p == q:
            out.append(("query_equals_positive", text))
    positives = {normalize(p) for p in pos}
    for text in neg:
        n = normalize(text)
        if not n:
            out.append(("empty_negative", text))
        elif n in positives:
            out.append(("negative_equals_positive", text))
    return out


@dataclass
class TextChecks:
    """Hashes of every record, for the duplicate, reuse and leakage counts at the end."""

    query: array = field(default_factory=lambda: array("q"))
    record: array = field(default_factory=lambda: array("q"))
    positive: array = field(default_factory=lambda: array("q"))
    positive_record: array = field(default_factory=lambda: array("q"))

    def add(self, index: int, query: str, pos: list[str]) -> None:
        qh = text_hash(query)
        hashes = sorted(text_hash(p) for p in pos)
        self.query.append(qh)
        self.record.append(hash((qh, *hashes)) & ((1 << 62) - 1))
        for h in hashes:
            self.positive.append(h)
            self.positive_record.append(index)

    def duplicates(self) -> tuple[dict[int, int], dict[int, int]]:
        """``(duplicate records, duplicate queries)``: record index -> index of its first occurrence, for every
        later record with the same query and positives / the same query and other positives."""
        same_record = _later_copies(np.frombuffer(self.record, dtype=np.int64))
        same_query = _later_copies(np.frombuffer(self.query, dtype=np.int64))
        return same_record, {i: j for i, j in same_query.items() if i not in same_record}

    def reused_positives(self, limit: int) -> dict[int, int]:
        """Record index -> how many records share its most-reused positive, for positives of more than ``limit``."""
        hashes = np.frombuffer(self.positive, dtype=np.int64)
        if hashes.size == 0:
            return {}
        values, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
        per_pair = counts[inverse]
        heavy = per_pair > limit
        out: dict[int, int] = {}
        records = np.frombuffer(self.positive_record, dtype=np.int64)
        for record, count in zip(records[heavy].tolist(), per_pair[heavy].tolist()):
            out[record] = max(out.get(record, 0), count)
        return out

    def in_set(self, hashes: set[int], which: str) -> dict[int, int]:
        """Record index -> the matching hash, for records whose query (``which="query"``) or a positive is in
        ``hashes``."""
        if not hashes:
            return {}
        wanted = np.fromiter(hashes, dtype=np.int64, count=len(hashes))
        values = np.frombuffer(self.query if which == "query" else self.positive, dtype=np.int64)
        owners = np.arange(values.size) if which == "query" else np.frombuffer(self.positive_record, dtype=np.int64)
        rows = np.nonzero(np.isin(values, wanted))[0]
        return {int(owners[r]): int(values[r]) for r in rows}


def _later_copies(values: np.ndarray) -> dict[int, int]:
    """Index -> index of the first equal value, for every value seen before."""
    if values.size == 0:
        return {}
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]
    first = order[np.maximum.accumulate(np.where(starts, np.arange(order.size), 0))]
    later = ~starts
    return dict(zip(order[later].tolist(), first[later].tolist()))
