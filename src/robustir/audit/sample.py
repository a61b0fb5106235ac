"""The audit's first job: one streaming pass over every record (a training JSONL file or folder, or a BEIR
folder's split) -- each validated, text-checked, and a seeded reservoir sample kept for the teacher
(:class:`Reading`, mixed into :class:`robustir.audit.run._Audit`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import DataError
from ..io import read_jsonl
from .checks import TextChecks, degenerate_reasons

__all__ = ["Record", "iter_records"]


@dataclass
class Record:
    """One validated training record (``file``: its path, ``line``: 1-based line; for a BEIR split the qrels file
    and the query id)."""

    index: int
    file: str
    line: int | str
    query: str
    pos: list[str]
    neg: list[str]


class _Where:
    """Record index -> (file, line), in arrays (a few bytes a record, not a tuple each)."""

    def __init__(self) -> None:
        from array import array

        self.files: list[str] = []
        self.file_of = array("i")
        self.lines = array("q")
        self.labels: list[str] = []  # BEIR records are named by query id, not by line

    def add(self, file: str, line: int | str) -> None:
        if not self.files or self.files[-1] != file:
            self.files.append(file)
        self.file_of.append(len(self.files) - 1)
        if isinstance(line, str):
            self.labels.append(line)
            self.lines.append(len(self.labels) - 1)
        else:
            self.lines.append(line)

    def __getitem__(self, index: int) -> tuple[str, int | str]:
        line = self.lines[index]
        return self.files[self.file_of[index]], (self.labels[line] if self.labels else line)



def _is_beir(path: Path) -> bool:
    from ..data.beir import is_beir_folder

    return is_beir_folder(path)


def iter_records(data: str | Path, split: str = "train") -> Iterator[Record]:
    """Stream the validated records of a training JSONL file or folder, or of a BEIR folder's split (one record per
    judged query, every relevant document a positive)."""
    from ..data.training_data import check_record, training_files

    path = Path(data)
    if _is_beir(path):
        from ..data.beir import load_beir

        dataset = load_beir(path, split)
        texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
        qrels = path / "qrels" / f"{split}.tsv"
        for index, (qid, judged) in enumerate(dataset.qrels.items()):
            yield Record(index, str(qrels), f"query {qid}", dataset.queries[qid],
                         [texts[d] for d, grade in judged.items() if grade > 0], [])
        return
    index = 0
    for file in training_files(path):
        for line, obj in read_jsonl(file):
            query, pos, neg = check_record(obj, file, line)
            if not pos:
                raise DataError(file, "empty positive list: there is no pair to audit", line=line, field="pos",
                                fix="add the query's positive(s) or remove the line")
            yield Record(index, str(file), line, query, pos, neg)
            index += 1


def _corpus_path(path: Path) -> Path:
    if path.is_dir():
        from ..data.beir import corpus_file

        return corpus_file(path)
    return path



class Reading:
    """Pass 1 of an audit: every record read once; memory bounded by the samples."""

    def flag_other(self, item: dict) -> None:
        """Flags found over the whole file go to disk as they are found (memory stays bounded)."""
        self.other.write(json.dumps(item, ensure_ascii=False) + "\n")
        self.counts.setdefault(item["kind"], {}).setdefault(item["reason"], 0)
        self.counts[item["kind"]][item["reason"]] += 1

    # -- pass 1: every record
    def read(self) -> None:
        config = self.config
        from tqdm.auto import tqdm

        self.checks = TextChecks()
        self.sample: list[Record] = []
        self.passage_sample: list[str] = []
        passages_wanted = config.random_passages + max(config.random_passages, min(config.max_records, 2000))
        self.records = self.pairs = self.negatives = 0
        self.where = _Where()  # record index -> (file, line), for the flags found at the end
        seen_passages = 0
        bar = tqdm(desc="audit: read", unit="record", disable=not config.progress)
        for record in iter_records(config.data, config.split):
            self.records += 1
            self.pairs += len(record.pos)
            self.negatives += len(record.neg)
            self.where.add(record.file, record.line)
            self.checks.add(record.index, record.query, record.pos)
            for reason, text in degenerate_reasons(record.query, record.pos, record.neg,
                                                   min_query_words=config.min_query_words,
                                                   min_passage_words=config.min_passage_words):
                self.flag_other({"kind": "degenerate", "reason": reason, "file": record.file, "line": record.line,
                                 "query": record.query, "text": text})
            # reservoir samples (Algorithm R): records for the teacher, passages for the random null
            if len(self.sample) < config.max_records:
                self.sample.append(record)
            else:
                j = self.rng.randrange(self.records)
                if j < config.max_records:
                    self.sample[j] = record
            for text in record.pos + record.neg:
                seen_passages += 1
                if len(self.passage_sample) < passages_wanted:
                    self.passage_sample.append(text)
                else:
                    j = self.rng.randrange(seen_passages)
                    if j < passages_wanted:
                        self.passage_sample[j] = text
            bar.update(1)
        bar.close()
        if not self.records:
            raise DataError(config.data, "no records", fix='give a training JSONL with one {"query", "pos"} object '
                                                            "per line")
        self.sample.sort(key=lambda r: r.index)

