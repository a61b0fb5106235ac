"""False-negative removal by teacher margin (NV-Retriever's positive-aware rule).

A teacher scores every (query, positive) and (query, negative) pair of a training record; a negative that
scores too close to the positive is likely relevant too (a false negative) and is removed:

    absolute margin a:  remove if  s(q, n) > s(q, p) - a
    relative margin r:  remove if  s(q, n) > s(q, p) - |s(q, p)| * r      (NV-Retriever "TopK-PercPos", r = 0.05)

(the one rule, shared with ``robustir mine``: :mod:`robustir.negatives.margins`)

``s(q, p)`` is the *lowest* score among the record's positives -- the conservative choice, and the same one
``robustir mine`` makes. (The ``|s|`` form only matters for teachers with negative scores such as raw
cross-encoder logits: it keeps the threshold below the positive.) A negative whose text equals a positive is
removed without scoring (reason ``equals_positive``).

Teachers: an embedding model (:class:`~robustir.models.encoder.Encoder`, cosine) or a cross-encoder
(:class:`~robustir.models.cross_encoder.CrossEncoder`: sentence-transformers' on a local folder of any of its
layouts; scores after its default activation, a sigmoid for one-label models). ``kind="auto"`` picks the
cross-encoder when :func:`~robustir.models.cross_encoder.is_cross_encoder` recognises the folder.

This module also holds the streaming engine shared with the passage sieve (:mod:`robustir.filtering.sieve`):
records are read in input order, decided in batches, and appended to a resumable output (a re-run with the same
input and shard skips what the partial output already holds). The input is never overwritten; aligned
per-negative fields (``neg_scores``, ``neg_ids``, any list field ``neg_*`` as long as ``neg``) are filtered
along with ``neg``; with ``keep_removed`` each record gets a ``removed`` list
``[{"text", "reason", "score"}]`` appended to any list an earlier filter left.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Literal, Protocol, Sequence

import numpy as np

from ..data.training_data import check_record, positives_removed_by_filter
from ..runs import operational
from ..errors import ConfigError, DataError
from ..io import ResumableJsonlWriter, Shard, read_jsonl
from ..outputs import StageOutput, refuse_overwriting_inputs, stage_step
from ..negatives.margins import margin_reason
from ..negatives.score_stats import ScoreStats
from ..precision import Precision
from ..validation import cli, config_dataclass, ModelName, NonNegativeFloat, OpenFraction, PositiveInt, Seed

logger = logging.getLogger(__name__)

__all__ = ["TeacherFilterConfig", "FilterReport", "Decision", "FilterRecord", "EmbeddingTeacher",
           "load_teacher", "margin_reason", "teacher_filter", "run_filter", "random_like_positives",
           "random_p_value", "suspect_positives", "sample_passages", "ROBUST_FILTER"]

REASON_EQUALS_POSITIVE = "equals_positive"
REASON_SUSPECT_POSITIVE = "suspect_positive"
REASON_RANDOM_LIKE_POSITIVE = "random_like_positive"

#: the teacher filter of robustir's recipe for noisy data (``robustir train --filter-positives``, the noise
#: benchmark's ``robust`` method): a positive that at least 10 % of 200 random passages of the file score as high
#: as goes (the audit's random_like rule: 1.5 % of clean SciFact positives); negatives are kept (the 5 % false-negative
#: margin cost 0.48 NDCG@10 on clean data at the GPU preset; docs/robustness.md).
ROBUST_FILTER = {"relative_margin": None, "random_like_share": 0.1}


# ----------------------------------------------------------------------------------------------- engine

@dataclass
class FilterRecord:
    """One validated input record."""

    line: int
    data: dict
    query: str
    pos: list[str]
    neg: list[str]


@dataclass
class Decision:
    """Verdict on each negative of one record: ``reasons[j]`` is None to keep negative j, else why it goes."""

    reasons: list[str | None]
    scores: list[float | None]
    positive_score: float | None = None
    positive_reasons: list[str | None] | None = None
    """Optional verdict on each positive (None = keep); a record left without positives is written with
    ``"pos": []`` and the removed positives in ``removed`` -- training skips it, later filters pass it on."""


@dataclass
class FilterReport:
    """What a filter run removed and why (``resumed`` records came from an earlier run and are not counted)."""

    method: str
    input: str
    output: str
    records: int = 0
    resumed: int = 0
    negatives: int = 0
    kept: int = 0
    removed: int = 0
    removed_by_reason: dict = field(default_factory=dict)
    queries_with_removals: int = 0
    queries_left_without_negatives: int = 0
    positives_removed: int = 0
    records_without_positives: int = 0
    """Records whose every positive was removed (kept as ``"pos": []``; training skips them)."""
    removed_per_query: dict = field(default_factory=dict)
    """Histogram: number of negatives removed from a record -> number of records."""
    scores: dict = field(default_factory=dict)
    """Score statistics of positives, kept negatives and removed negatives (per reason)."""
    config: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    """Method-specific additions (the sieve's model, training run and similarity lists)."""
    elapsed_s: float = 0.0

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.removed_by_reason.items())) or "none"
        return (f"{self.method}: {self.records} records ({self.resumed} from an earlier run), {self.negatives} "
                f"negatives, {self.removed} removed ({reasons}), {self.kept} kept; {self.queries_with_removals} "
                f"records lost at least one, {self.queries_left_without_negatives} have none left -> {self.output}")


def parse_record(path: Path, line: int, obj: dict) -> FilterRecord:
    """Validate ``query`` (str), ``pos`` (non-empty list of str) and ``neg`` (list of str, may be absent)."""
    query, pos, neg = check_record(obj, path, line)
    if not pos and not positives_removed_by_filter(obj):
        raise DataError(path, "empty positive list", line=line, field="pos",
                        fix="every record needs at least one positive to compare its negatives with")
    return FilterRecord(line, obj, query, pos, neg)


def check_paths(input_path: str | Path, output_path: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """Refuse a missing input, an output that is the input, and (unless ``overwrite``) a complete output."""
    input_path, output = Path(input_path), Path(output_path)
    if not input_path.exists():
        raise DataError(input_path, "file not found", fix="give a training JSONL with query/pos/neg")
    if input_path.is_dir():
        raise DataError(input_path, "is a folder; a filter reads one training JSONL file",
                        fix="give the file (e.g. the output of robustir mine), or `cat` a folder's files into one")
    refuse_overwriting_inputs(output, input_path, stage="filter")
    target = StageOutput(output, reports=True)
    if overwrite:
        target.clear()
    elif target.complete():
        raise ConfigError(f"{output} already exists (complete); pass overwrite=True / --overwrite to redo it")
    elif output.exists():  # renamed into place but its report was never written: the run did not finish
        output.unlink()
    return input_path, output


def run_filter(input_path: str | Path, output_path: str | Path, decide: Callable[[list[FilterRecord]], list[Decision]],
               *, method: str, config: dict, batch_records: int = 256, keep_removed: bool = True,
               shard: Shard | None = None, overwrite: bool = False, progress: bool = True,
               on_finish: Callable[[FilterReport, dict], None] | None = None) -> FilterReport:
    """Stream ``input_path`` through ``decide`` (a batch of records -> one :class:`Decision` each) into a new file.

    ``on_finish(report, collected)`` may add to the report before it is written; ``collected`` holds the raw
    scores ``positive``, ``kept`` and ``removed:<reason>`` (:class:`~robustir.negatives.score_stats.ScoreStats`:
    every score up to a million, then a uniform sample -- memory stays bounded however long the input).
    """
    from tqdm.auto import tqdm

    shard = shard or Shard()
    input_path, output = check_paths(input_path, output_path, overwrite)
    started = time.monotonic()
    report = FilterReport(method=method, input=str(input_path), output=str(output), config=config)
    reasons: Counter[str] = Counter()
    histogram: Counter[int] = Counter()
    collected: dict[str, ScoreStats] = {"positive": ScoreStats(), "kept": ScoreStats()}
    writer = ResumableJsonlWriter(output, key_field=None)
    already = writer.count  # records are written in input order: skip that many owned records
    bar = tqdm(desc=method, unit="record", disable=not progress)

    def flush(batch: list[FilterRecord]) -> None:
        live = [record for record in batch if record.pos]
        decisions = iter(decide(live) if live else [])
        for record in batch:
            if not record.pos:  # dropped by an earlier filter: passed on unchanged
                report.records += 1
                writer.write(dict(record.data))
                continue
            writer.write(_apply(record, next(decisions), keep_removed, report, reasons, histogram, collected))
        bar.update(len(batch))

    finished = False
    try:
        batch: list[FilterRecord] = []
        owned = 0
        for line, obj in shard.select(read_jsonl(input_path)):
            owned += 1
            if owned <= already:
                report.resumed += 1
                continue
            batch.append(parse_record(input_path, line, obj))
            if len(batch) >= batch_records:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        if owned == 0 and shard.count == 1:  # an empty file is no training data (a shard may well get nothing)
            raise DataError(input_path, "no records", fix='give a training JSONL with one {"query", "pos", "neg"} '
                                                          "object per line")
        writer.finish()
        finished = True
    finally:
        writer.close()
        bar.close()
    report.removed_by_reason = dict(sorted(reasons.items()))
    report.removed_per_query = {str(k): histogram[k] for k in sorted(histogram)}
    report.scores = {"positive": collected["positive"].summary(), "kept": collected["kept"].summary(),
                     **{k: v.summary() for k, v in collected.items() if k.startswith("removed:")}}
    report.elapsed_s = round(time.monotonic() - started, 3)
    if on_finish is not None:
        on_finish(report, collected)
    if finished:
        StageOutput(output).write_report(asdict(report))
    logger.info("%s", report.summary())
    return report


def _apply(record: FilterRecord, decision: Decision, keep_removed: bool, report: FilterReport,
           reasons: Counter, histogram: Counter, collected: dict[str, ScoreStats]) -> dict:
    out = dict(record.data)
    n = len(record.neg)
    if len(decision.reasons) != n:
        raise RuntimeError(f"filter decided {len(decision.reasons)} negatives of a record with {n}")
    keep = [reason is None for reason in decision.reasons]
    removed = []
    for text, reason, score in zip(record.neg, decision.reasons, decision.scores):
        if reason is None:
            if score is not None:
                collected["kept"].append(score)
            continue
        reasons[reason] += 1
        entry: dict = {"text": text, "reason": reason}
        if score is not None:
            entry["score"] = round(float(score), 6)
            collected.setdefault(f"removed:{reason}", ScoreStats()).append(score)
        removed.append(entry)
    if decision.positive_score is not None:
        collected["positive"].append(decision.positive_score)
    if decision.positive_reasons is not None:
        dropped = [(text, reason) for text, reason in zip(record.pos, decision.positive_reasons) if reason]
        for text, reason in dropped:
            reasons[reason] += 1
            removed.append({"text": text, "reason": reason, "positive": True})
        if dropped:
            kept_pos = [i for i, reason in enumerate(decision.positive_reasons) if reason is None]
            for key, value in record.data.items():  # pos, pos_scores, pos_ids, ... stay aligned
                if (key == "pos" or key.startswith("pos_")) and isinstance(value, list) and len(value) == len(record.pos):
                    out[key] = [value[i] for i in kept_pos]
            report.positives_removed += len(dropped)
            report.records_without_positives += not kept_pos
    out["neg"] = [text for text, k in zip(record.neg, keep) if k]
    for key, value in record.data.items():  # keep aligned per-negative fields aligned
        if key.startswith("neg_") and isinstance(value, list) and len(value) == n:
            out[key] = [v for v, k in zip(value, keep) if k]
    if keep_removed:
        earlier = record.data.get("removed")
        out["removed"] = (earlier if isinstance(earlier, list) else []) + removed
    report.records += 1
    report.negatives += n
    negatives_removed = sum(1 for entry in removed if not entry.get("positive"))
    report.removed += negatives_removed
    report.kept += n - negatives_removed
    report.queries_with_removals += bool(removed)
    report.queries_left_without_negatives += bool(n) and not out["neg"]
    histogram[len(removed)] += 1
    return out


# ----------------------------------------------------------------------------------------------- teachers

class Teacher(Protocol):
    def score(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """Score each pair ``(queries[i], passages[i])``; higher = more relevant."""


class EmbeddingTeacher:
    """Cosine similarity of an embedding model's query and passage embeddings."""

    def __init__(self, encoder, batch_size: int = 64, precision: str = "auto") -> None:
        self.encoder = encoder
        self.batch_size = batch_size
        self.precision = precision

    def score(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        # each distinct text is encoded once per batch (a query appears once per negative)
        q_texts = list(dict.fromkeys(queries))
        p_texts = list(dict.fromkeys(passages))
        q_emb = self.encoder.encode(q_texts, "query", batch_size=self.batch_size, precision=self.precision)
        p_emb = self.encoder.encode(p_texts, "passage", batch_size=self.batch_size, precision=self.precision)
        q_emb = q_emb / np.maximum(np.linalg.norm(q_emb, axis=1, keepdims=True), 1e-12)
        p_emb = p_emb / np.maximum(np.linalg.norm(p_emb, axis=1, keepdims=True), 1e-12)
        q_row = {t: i for i, t in enumerate(q_texts)}
        p_row = {t: i for i, t in enumerate(p_texts)}
        qi = np.fromiter((q_row[t] for t in queries), dtype=np.int64, count=len(queries))
        pi = np.fromiter((p_row[t] for t in passages), dtype=np.int64, count=len(passages))
        return np.einsum("nd,nd->n", q_emb[qi], p_emb[pi])


def load_teacher(path: str | None, kind: Literal["auto", "embedding", "cross-encoder"] = "auto", *,
                 batch_size: int = 64, precision: str = "auto", max_length: int | None = None,
                 device: str | None = "auto") -> Teacher:
    """The teacher in folder ``path`` (None = the bundled MiniLM embedding model), on ``device`` (``auto``, ``cpu``,
    ``cuda``, ``cuda:N``)."""
    from ..device import resolve_device
    from ..models.cross_encoder import CrossEncoder, is_cross_encoder
    from ..models.encoder import resolve_model_path
    from ..resources import default_model_path

    resolve_device(device)  # checked before the model loads
    if kind not in ("auto", "embedding", "cross-encoder"):
        raise ConfigError(f"teacher kind must be auto, embedding or cross-encoder, got {kind!r}")
    path = path or default_model_path()
    if kind != "cross-encoder":  # (a cross-encoder resolves itself: any layout, a Hugging Face cache folder too)
        path = str(resolve_model_path(path, "teacher"))  # checked: a model folder
    if kind == "cross-encoder" or (kind == "auto" and is_cross_encoder(path)):
        return CrossEncoder(path, batch_size=batch_size, max_length=max_length, precision=precision, device=device,
                            what="teacher")
    from ..models.encoder import Encoder

    overrides = {"query_max_length": max_length, "passage_max_length": max_length} if max_length else {}
    return EmbeddingTeacher(Encoder.from_pretrained(path, device=device, **overrides), batch_size=batch_size,
                            precision=precision)


# ----------------------------------------------------------------------------------------------- the filter

@config_dataclass
class TeacherFilterConfig:
    """Options of the teacher-margin filter (``robustir filter --method teacher``)."""

    model: ModelName | None = None
    """Teacher folder: embedding model or cross-encoder (None = the bundled all-MiniLM-L6-v2)."""
    kind: Annotated[Literal["auto", "embedding", "cross-encoder"], cli("teacher-kind")] = "auto"
    """What the teacher is (``auto``: a cross-encoder when the folder holds a sequence-classification head)."""
    absolute_margin: NonNegativeFloat | None = None
    """Remove a negative scoring above the positive's score minus this."""
    relative_margin: OpenFraction | None = 0.05
    """Remove a negative scoring above the positive's score times (1 - this): NV-Retriever's TopK-PercPos
    default; set None to use only the absolute margin (both None: negatives are kept, only positives judged)."""
    suspect_positive_share: OpenFraction | None = None
    """Also judge the positives: remove a positive when more than this share of the record's negatives
    score above it (a likely false positive: a mislabelled pair or a failed generated query). None = off."""
    random_like_share: OpenFraction | None = None
    """Also judge each positive against random passages: remove it when at least this share of
    ``random_passages`` passages drawn from the file (other records' positives and negatives, seeded) score as high
    as it -- a positive that looks like a random passage to the teacher (a mislabelled pair, a failed generation).
    The rule of ``robustir audit``'s ``random_like`` flag: 0.1 keeps 99 % of clean SciFact positives. None = off."""
    random_passages: PositiveInt = 200
    """How many random passages ``random_like_share`` compares each positive with."""
    seed: Seed = 0
    """Seed of the random passages."""
    batch_size: PositiveInt = operational(64)
    """Encoding batch size."""
    max_length: PositiveInt | None = None
    """Teacher token limit (None = the model's own)."""
    precision: Precision = "auto"
    """Encoding precision: auto (bf16 where native: GPU, AMX/AVX512-BF16 CPU; else fp32), fp32, bf16 or fp16."""
    device: str = operational("auto")
    """Where the teacher runs: auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N."""
    batch_records: PositiveInt = operational(256)
    """Records read and filtered together."""
    keep_removed: Annotated[bool, cli("removed")] = True
    """Add the ``removed`` list (text + reason) to each record."""
    shard: str | None = operational(None)
    """``I/N``: filter shard I of N of the records (the output gets a shard suffix)."""
    overwrite: bool = operational(False)
    """Redo a complete output."""
    progress: bool = operational(True)
    """Show a progress bar."""

    def validate(self) -> None:
        if self.absolute_margin is None and self.relative_margin is None and self.random_like_share is None \
                and self.suspect_positive_share is None:
            raise ConfigError("teacher filter: nothing to judge; set absolute_margin and/or relative_margin (false "
                              "negatives), or random_like_share / suspect_positive_share (false positives)")
        if self.model is not None and not self.model.strip():
            raise ConfigError("teacher filter: model is empty; name a model folder, or leave it out for the bundled "
                              "all-MiniLM-L6-v2")
        if self.relative_margin is not None and not 0 <= self.relative_margin < 1:
            raise ConfigError(f"relative_margin must be in [0, 1), got {self.relative_margin}")
        if self.suspect_positive_share is not None and not 0 <= self.suspect_positive_share < 1:
            raise ConfigError(f"suspect_positive_share must be in [0, 1), got {self.suspect_positive_share}")
        if self.random_like_share is not None and not 0 < self.random_like_share < 1:
            raise ConfigError(f"random_like_share must be in (0, 1), got {self.random_like_share}")


def suspect_positives(positive_scores: Sequence[float], negative_scores: Sequence[float],
                      share: float | None) -> list[str | None] | None:
    """Per positive: ``suspect_positive`` when more than ``share`` of the negatives score above it, else None.

    Returns None when the rule is off or the record has no scored negative to compare with.
    """
    if share is None or not negative_scores:
        return None
    negatives = np.asarray(negative_scores, dtype=np.float64)
    return [REASON_SUSPECT_POSITIVE if float((negatives > score).mean()) > share else None
            for score in positive_scores]


def random_like_positives(positive_scores: Sequence[float], random_scores: np.ndarray, share: float | None,
                          own: np.ndarray | None = None) -> list[str | None] | None:
    """Per positive: ``random_like_positive`` when at least ``share`` of the random passages score as high as it.

    ``random_scores``: ``(positives, R)`` scores of the record's query against the R random passages; ``own``:
    an optional ``(positives, R)`` bool mask of random passages that are this positive itself (not counted).
    The share is the audit's random p-value ``(1 + #{r >= s}) / (1 + R)`` (:mod:`robustir.audit`), so a positive
    that outscores every random passage has share ``1 / (R + 1)``. Returns None when the rule is off.
    """
    if share is None:
        return None
    random_scores = np.asarray(random_scores, dtype=np.float64).reshape(len(positive_scores), -1)
    own = np.zeros(random_scores.shape, dtype=bool) if own is None else np.asarray(own, dtype=bool)
    return [REASON_RANDOM_LIKE_POSITIVE if random_p_value(score, row, mine) >= share else None
            for score, row, mine in zip(positive_scores, random_scores, own)]


def random_p_value(score: float, random_scores: np.ndarray, own: np.ndarray) -> float:
    """``(1 + #{r >= score}) / (1 + R)`` over the random passages that are not the scored passage itself (``own``
    marks those): the random p-value of the audit's estimate and of :func:`random_like_positives`."""
    counted = ~own
    return (1 + int(((random_scores >= score) & counted).sum())) / (1 + int(counted.sum()))


def sample_passages(path: Path, count: int, seed: int) -> list[str]:
    """A seeded uniform sample (reservoir, one pass, ``count`` texts in memory) of the distinct passages of a
    training file: its positives and negatives."""
    import random

    from ..io import read_jsonl

    rng = random.Random(f"random-passages:{seed}")
    sample: list[str] = []
    seen = 0
    for line, obj in read_jsonl(path):
        for key in ("pos", "neg"):
            texts = obj.get(key)
            for text in texts if isinstance(texts, list) else ():
                if not isinstance(text, str) or not text.strip():
                    continue
                seen += 1
                if len(sample) < count:
                    sample.append(text)
                else:
                    j = rng.randrange(seen)
                    if j < count:
                        sample[j] = text
    return list(dict.fromkeys(sample))


def _combine(*verdicts: list[str | None] | None) -> list[str | None] | None:
    """Per positive, the first rule that removes it (None: every rule that ran keeps it); None when no rule ran."""
    ran = [v for v in verdicts if v is not None]
    if not ran:
        return None
    return [next((r for r in reasons if r), None) for reasons in zip(*ran)]


def teacher_filter(input_path: str | Path, output_path: str | Path, config: TeacherFilterConfig | None = None,
                   teacher: Teacher | None = None) -> FilterReport:
    """Remove negatives scored within the margin of the record's (lowest) positive, and (with the positive rules)
    positives that look random or that their negatives outscore; write a new file + report."""
    config = config or TeacherFilterConfig()
    config.validate()
    check_paths(input_path, output_path, config.overwrite)  # fail before loading a model
    if teacher is None:
        teacher = load_teacher(config.model, config.kind, batch_size=config.batch_size, precision=config.precision,
                               max_length=config.max_length, device=config.device)

    randoms = sample_passages(Path(input_path), config.random_passages, config.seed) \
        if config.random_like_share is not None else []
    random_array = np.array(randoms, dtype=object)
    if config.random_like_share is not None and len(randoms) + 1 <= 1 / config.random_like_share:
        raise ConfigError(f"random_like_share {config.random_like_share}: {input_path} has {len(randoms)} distinct "
                          "passages to compare a positive with, so even the best positive would match that share; "
                          "give more data, a larger random_like_share or raise random_passages")

    # negatives are scored only for a rule that reads them (robustir's recipe judges positives alone: ~10x less work)
    score_negatives = config.absolute_margin is not None or config.relative_margin is not None \
        or config.suspect_positive_share is not None

    def decide(batch: list[FilterRecord]) -> list[Decision]:
        queries: list[str] = []
        passages: list[str] = []
        for record in batch:
            positives = {p.strip() for p in record.pos}
            for text in record.pos:
                queries.append(record.query)
                passages.append(text)
            for text in record.neg if score_negatives else ():
                if text.strip() not in positives:
                    queries.append(record.query)
                    passages.append(text)
            if randoms:  # the query against each random passage (an embedding teacher encodes each text once)
                queries.extend([record.query] * len(randoms))
                passages.extend(randoms)
        scores = iter(teacher.score(queries, passages).tolist())
        decisions = []
        for record in batch:
            positives = {p.strip() for p in record.pos}
            pos_scores = [next(scores) for _ in record.pos]
            scored_negatives = [(text, next(scores)) for text in record.neg
                                if score_negatives and text.strip() not in positives]
            random_scores = np.array([next(scores) for _ in randoms], dtype=np.float64)
            positive_reasons = _combine(
                random_like_positives(pos_scores, np.tile(random_scores, (len(pos_scores), 1)),
                                      config.random_like_share,
                                      np.stack([random_array == p for p in record.pos]) if randoms else None),
                suspect_positives(pos_scores, [s for _, s in scored_negatives], config.suspect_positive_share))
            trusted = [s for s, r in zip(pos_scores, positive_reasons or [None] * len(pos_scores)) if r is None]
            pos_score = min(trusted or pos_scores)
            negative_scores = iter(s for _, s in scored_negatives)
            reasons: list[str | None] = []
            neg_scores: list[float | None] = []
            for text in record.neg:
                if text.strip() in positives:
                    reasons.append(REASON_EQUALS_POSITIVE)
                    neg_scores.append(None)
                    continue
                if not score_negatives:
                    reasons.append(None)
                    neg_scores.append(None)
                    continue
                score = next(negative_scores)
                # no trusted positive left: the record will not be trained on, its negatives stay as they are
                reasons.append(margin_reason(score, pos_score, config.absolute_margin, config.relative_margin)
                               if trusted else None)
                neg_scores.append(score)
            decisions.append(Decision(reasons, neg_scores, pos_score, positive_reasons))
        return decisions

    return run_filter(input_path, output_path, decide, method="teacher", config=asdict(config),
                      batch_records=config.batch_records, keep_removed=config.keep_removed,
                      shard=Shard.parse(config.shard), overwrite=False, progress=config.progress)


TEACHER = stage_step("filter teacher", TeacherFilterConfig,
                     lambda config, job: teacher_filter(job.inputs["input"],
                                                        StageOutput(job.output, job.shard, reports=True).path, config),
                     reports=True, inputs=lambda config, job: {"model": config.model})
"""NV-Retriever's teacher filter as a :class:`~robustir.runs.Step`: the teacher (``model``) by its content."""
