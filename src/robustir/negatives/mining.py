"""Hard-negative mining with BM25 (bm25s) or a dense model (FAISS).

For every query, candidates are retrieved to depth ``range_max``; then

1. every positive is excluded — by id *and* by identical text — and so is the query itself;
2. the rank window ``[range_min, range_max)`` and score limits apply: ``max_score`` / ``min_score``,
   ``absolute_margin`` (keep if score <= positive − margin) and ``relative_margin`` (keep if
   score <= positive − |positive| × margin, NV-Retriever's "TopK-PercPos"; the one rule of
   :mod:`robustir.negatives.margins`, shared with the teacher filter); the positive score used is the
   *lowest* of the query's positives, the conservative choice when a query has several;
3. ``num_negatives`` are taken from the survivors, from the top or sampled at random (seeded).

Queries are processed in chunks (never a full query × corpus matrix), results stream to a resumable
JSONL file, corpus embeddings can be cached, and ``shard`` splits the queries across workers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from ..data.beir import BeirDataset, load_beir
from ..errors import ConfigError
from ..index.bm25 import BM25Config, BM25Index
from ..index.dense import DenseIndex, DenseIndexConfig
from ..io import ResumableJsonlWriter, Shard
from ..outputs import StageOutput, refuse_overwriting_inputs
from .margins import margin_reason
from ..validation import Checked, NonNegativeFloat, NonNegativeInt, OpenFraction, PositiveInt

logger = logging.getLogger(__name__)


@dataclass
class MiningConfig(Checked):
    method: Literal["bm25", "dense"] = "bm25"  # retriever that ranks the candidates
    num_negatives: PositiveInt = 15  # negatives per query
    range_min: NonNegativeInt = 0  # skip this many top-ranked non-positives (likely false negatives)
    range_max: PositiveInt = 100  # retrieve to this rank
    max_score: float | None = None  # drop candidates scoring above this
    min_score: float | None = None  # drop candidates scoring below this
    absolute_margin: NonNegativeFloat | None = None  # keep if score <= positive score - margin
    relative_margin: OpenFraction | None = None  # keep if score <= positive score * (1 - margin) (NV-Retriever; e.g. 0.05)
    sampling: Literal["top", "random"] = "top"  # take the top survivors, or sample them at random (seeded)
    seed: NonNegativeInt = 42
    query_batch_size: PositiveInt = 1024  # queries retrieved per chunk
    encode_batch_size: PositiveInt = 64
    bf16: bool = False
    cache_dir: str | None = None  # reuse corpus embeddings saved here (dense)
    device: str = "auto"  # dense: where model and search run: auto (first GPU if any, else CPU), cpu, cuda, cuda:N
    index: DenseIndexConfig = field(default_factory=DenseIndexConfig)
    bm25: BM25Config = field(default_factory=BM25Config)

    def validate(self) -> None:
        if self.method not in ("bm25", "dense"):
            raise ConfigError(f"mining method must be bm25 or dense, got {self.method!r}")
        if not 0 <= self.range_min < self.range_max:
            raise ConfigError(f"need 0 <= range_min < range_max, got {self.range_min}, {self.range_max}")
        if self.num_negatives < 1:
            raise ConfigError("num_negatives must be >= 1")
        if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
            raise ConfigError(f"min_score ({self.min_score}) is above max_score ({self.max_score}): no candidate could "
                              "pass; swap them or drop one")
        if self.sampling not in ("top", "random"):
            raise ConfigError(f"sampling must be top or random, got {self.sampling!r}")


@dataclass
class MiningQuery:
    query_id: str
    text: str
    positive_ids: list[str]
    extra: dict = field(default_factory=dict)
    """Other fields of an input training record, copied to the output (mined fields take precedence)."""


@dataclass
class MiningReport:
    queries: int = 0
    negatives: int = 0
    unfilled: int = 0  # queries that got fewer than num_negatives
    empty: int = 0  # queries that got none
    excluded_positive: int = 0
    excluded_by_score: int = 0
    positive_scores: list[float] = field(default_factory=list)
    negative_scores: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The report as written to ``OUT.report.json``."""
        def stats(values: list[float]) -> dict:
            if not values:
                return {}
            arr = np.asarray(values)
            return {"mean": float(arr.mean()), "min": float(arr.min()), "p25": float(np.percentile(arr, 25)),
                    "median": float(np.median(arr)), "p75": float(np.percentile(arr, 75)), "max": float(arr.max())}

        return {"queries": self.queries, "negatives": self.negatives, "unfilled_queries": self.unfilled,
                "queries_without_negatives": self.empty, "excluded_positive_or_duplicate": self.excluded_positive,
                "excluded_by_score_limits": self.excluded_by_score,
                "positive_scores": stats(self.positive_scores), "negative_scores": stats(self.negative_scores)}

    def summary(self) -> str:
        """One line, like every stage's report."""
        return (f"{self.queries} queries, {self.negatives} negatives ({self.unfilled} queries unfilled, {self.empty} "
                f"with none), {self.excluded_positive} positives/duplicates and {self.excluded_by_score} by score "
                "limits excluded")

    def format(self) -> str:
        s = self.as_dict()
        lines = [f"queries {s['queries']}, negatives {s['negatives']}, unfilled {s['unfilled_queries']} "
                 f"(none at all: {s['queries_without_negatives']})",
                 f"excluded: positives/duplicates {s['excluded_positive_or_duplicate']}, "
                 f"score limits {s['excluded_by_score_limits']}"]
        for name in ("positive_scores", "negative_scores"):
            st = s[name]
            if st:
                lines.append(f"{name.replace('_', ' '):16s} mean {st['mean']:.3f}  min {st['min']:.3f}  "
                             f"p25 {st['p25']:.3f}  median {st['median']:.3f}  p75 {st['p75']:.3f}  max {st['max']:.3f}")
        return "\n".join(lines)


class _Retriever:
    """Scores for top-k retrieval and for specific (query, document) pairs, BM25 or dense."""

    def __init__(self, config: MiningConfig, texts: list[str], encoder=None) -> None:
        self.config = config
        if config.method == "bm25":
            self.bm25 = BM25Index(config.bm25).index(texts, show_progress=len(texts) > 50_000)
        else:
            if encoder is None:
                raise ConfigError("dense mining needs a model (--model)")
            from ..device import resolve_device

            device = resolve_device(config.device)
            self.encoder = encoder.to(device) if hasattr(encoder, "to") else encoder
            self.doc_emb = encoder.encode_corpus(texts, cache_dir=config.cache_dir,
                                                 batch_size=config.encode_batch_size, bf16=config.bf16,
                                                 show_progress=True)
            self.dense = DenseIndex(config.index, device=device).index(self.doc_emb)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if self.config.method == "bm25":
            scores, indices = self.bm25.search(queries, k)
            return scores, indices, None
        q = self.encoder.encode(queries, "query", batch_size=self.config.encode_batch_size, bf16=self.config.bf16)
        scores, indices = self.dense.search(q, k)
        return scores, indices, q

    def pair_scores(self, query: str, query_emb: np.ndarray | None, doc_rows: list[int]) -> list[float]:
        if self.config.method == "bm25":
            ids = self.bm25._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)[0]
            if not ids:
                return [0.0] * len(doc_rows)
            all_scores = self.bm25._retriever.get_scores(ids)
            return [float(all_scores[r]) for r in doc_rows]
        return [float(self.doc_emb[r] @ query_emb) for r in doc_rows]


def select_negatives(candidates: list[tuple[int, float]], positive_score: float | None, config: MiningConfig,
                     rng: random.Random, report: MiningReport) -> list[tuple[int, float]]:
    """Apply score limits and sampling to ``(row, score)`` candidates already stripped of positives."""
    kept = []
    for row, score in candidates:
        if config.max_score is not None and score > config.max_score:
            report.excluded_by_score += 1
            continue
        if config.min_score is not None and score < config.min_score:
            report.excluded_by_score += 1
            continue
        if positive_score is not None:
            if margin_reason(score, positive_score, config.absolute_margin, config.relative_margin):
                report.excluded_by_score += 1
                continue
        kept.append((row, score))
    if config.sampling == "random" and len(kept) > config.num_negatives:
        chosen = sorted(rng.sample(range(len(kept)), config.num_negatives))
        kept = [kept[i] for i in chosen]
    return kept[: config.num_negatives]


def mine_negatives(queries: list[MiningQuery], doc_ids: list[str], doc_texts: list[str], output: str | Path,
                   config: MiningConfig | None = None, encoder=None, shard: Shard | None = None,
                   show_progress: bool = True) -> MiningReport:
    """Mine hard negatives for ``queries`` from the documents; write training JSONL to ``output``.

    Each output line: ``{"query", "pos", "neg", "pos_scores", "neg_scores", "query_id", "pos_ids", "neg_ids"}``.
    A re-run continues after the last query written (resume); the report goes to ``<output>.report.json``.
    """
    config = config or MiningConfig()
    config.validate()
    shard = shard or Shard()
    output = Path(output)
    row_of = {doc_id: i for i, doc_id in enumerate(doc_ids)}
    text_key = {}
    for i, text in enumerate(doc_texts):
        text_key.setdefault(text.strip(), []).append(i)
    mine = [q for q in shard.select(queries)]
    for q in mine:
        missing = [p for p in q.positive_ids if p not in row_of]
        if missing:
            raise ConfigError(f"query {q.query_id!r}: positive id(s) {missing[:3]} not in the corpus")
    report = MiningReport()
    writer = ResumableJsonlWriter(output, key_field="query_id")
    todo = [q for q in mine if q.query_id not in writer.done_keys]
    if len(todo) < len(mine):
        logger.info("resuming: %d of %d queries already mined", len(mine) - len(todo), len(mine))
    retriever = _Retriever(config, doc_texts, encoder) if todo else None
    bar = tqdm(total=len(todo), desc=f"mine ({config.method})", disable=not show_progress, unit="query")
    try:
        for start in range(0, len(todo), config.query_batch_size):
            chunk = todo[start:start + config.query_batch_size]
            depth = min(config.range_max + max(len(q.positive_ids) for q in chunk) + 1, len(doc_ids))
            scores, indices, q_emb = retriever.search([q.text for q in chunk], depth)
            for j, query in enumerate(chunk):
                report.queries += 1
                rng = random.Random(f"{config.seed}:{query.query_id}")
                positive_rows = {row_of[p] for p in query.positive_ids}
                positive_texts = {doc_texts[r].strip() for r in positive_rows}
                hit_score = {int(r): float(s) for r, s in zip(indices[j], scores[j]) if r >= 0}
                pos_rows = sorted(positive_rows)
                missing = [r for r in pos_rows if r not in hit_score]
                if missing:
                    hit_score.update(zip(missing, retriever.pair_scores(
                        query.text, None if q_emb is None else q_emb[j], missing)))
                pos_scores = [hit_score[r] for r in pos_rows]
                candidates = []
                rank = 0
                for r, s in zip(indices[j], scores[j]):
                    r = int(r)
                    if r < 0:
                        continue
                    text = doc_texts[r].strip()
                    if r in positive_rows or text in positive_texts or text == query.text.strip() \
                            or doc_ids[r] == query.query_id:
                        report.excluded_positive += 1
                        continue  # positives and their duplicates never become negatives, nor the query
                    if config.range_min <= rank < config.range_max:
                        candidates.append((r, float(s)))
                    rank += 1
                chosen = select_negatives(candidates, min(pos_scores) if pos_scores else None, config, rng, report)
                report.negatives += len(chosen)
                report.unfilled += len(chosen) < config.num_negatives
                report.empty += not chosen
                report.positive_scores.extend(pos_scores)
                report.negative_scores.extend(s for _, s in chosen)
                writer.write({
                    **query.extra,
                    "query": query.text, "pos": [doc_texts[r] for r in pos_rows],
                    "neg": [doc_texts[r] for r, _ in chosen],
                    "pos_scores": pos_scores, "neg_scores": [s for _, s in chosen],
                    "query_id": query.query_id, "pos_ids": [doc_ids[r] for r in pos_rows],
                    "neg_ids": [doc_ids[r] for r, _ in chosen],
                })
                bar.update(1)
        writer.finish()
    finally:
        writer.close()
        bar.close()
    StageOutput(output).write_report({"config": _plain(config), **report.as_dict()})
    return report


def _plain(config: MiningConfig) -> dict:
    from dataclasses import asdict

    return asdict(config)


def queries_from_beir(dataset: BeirDataset) -> list[MiningQuery]:
    return [MiningQuery(qid, dataset.queries[qid], [d for d, g in dataset.qrels[qid].items() if g > 0])
            for qid in dataset.qrels]


def load_jsonl_for_mining(path: str | Path, corpus: str | Path | None = None
                          ) -> tuple[list[MiningQuery], list[str], list[str]]:
    """Queries and candidate documents for mining negatives for a training JSONL (``query``/``pos``[/``neg``]).

    * With ``corpus`` (a BEIR ``corpus.jsonl``: ``_id``, ``title``, ``text``): candidates are its documents. A
      record's positives are matched by ``pos_ids`` / ``pos_id`` when those are corpus ids, else by identical
      text; a positive found in neither way is added to the pool under a synthetic id (``pos:<n>``), so it is
      scored and excluded like any positive.
    * Without: the FlagEmbedding convention -- the candidate pool is every distinct ``pos`` and ``neg`` text
      in the file (ids ``p0``, ``p1``, ...).

    Existing ``neg`` lists are replaced by the mined ones (without a corpus they are still candidates).
    Query ids: the record's ``query_id`` / ``qid`` when every record has a distinct one, else ``L<line>``.
    Other record fields are carried to the output unchanged.
    """
    from ..data.training_data import parse_example
    from ..io import read_jsonl

    path = Path(path)
    records = []
    for line, obj in read_jsonl(path):
        example = parse_example(obj, path, line)  # DataError names file, line and field
        if example is None:
            logger.warning("%s, line %d: empty query or positive, skipped", path, line)
            continue
        records.append((line, example))
    if not records:
        from ..errors import DataError

        raise DataError(path, "no usable record", fix='each line needs "query" and a non-empty "pos" list')
    given = [str(e.extra.get("query_id", e.extra.get("qid", ""))) for _, e in records]
    unique_ids = all(given) and len(set(given)) == len(given)
    doc_ids: list[str] = []
    doc_texts: list[str] = []
    by_text: dict[str, str] = {}
    known_ids: set[str] = set()
    if corpus is not None:
        from ..data.beir import load_corpus

        loaded, _ = load_corpus(corpus)
        doc_ids, doc_texts = list(loaded.ids), list(loaded.texts_for_encoding())
        known_ids = set(doc_ids)
        for doc_id, text, raw in zip(doc_ids, doc_texts, loaded.texts):
            by_text.setdefault(text.strip(), doc_id)
            by_text.setdefault(raw.strip(), doc_id)
    else:
        for _, example in records:
            for text in (*example.pos, *example.neg):
                if text.strip() not in by_text:
                    by_text[text.strip()] = f"p{len(doc_ids)}"
                    doc_ids.append(by_text[text.strip()])
                    doc_texts.append(text)
    queries = []
    for (line, example), qid in zip(records, given):
        declared = example.extra.get("pos_ids", example.extra.get("pos_id"))
        declared = [declared] if isinstance(declared, str) else declared
        positives: list[str] = []
        for i, text in enumerate(example.pos):
            doc_id = None
            if isinstance(declared, list) and i < len(declared) and str(declared[i]) in known_ids:
                doc_id = str(declared[i])
            doc_id = doc_id or by_text.get(text.strip())
            if doc_id is None:  # positive text absent from the corpus: add it so it can be scored
                doc_id = f"pos:{len(doc_ids)}"
                by_text[text.strip()] = doc_id
                doc_ids.append(doc_id)
                doc_texts.append(text)
            positives.append(doc_id)
        extra = {k: v for k, v in example.extra.items() if k not in ("pos_ids", "neg_ids", "query_id")}
        if example.prompt is not None:
            extra["prompt"] = example.prompt
        queries.append(MiningQuery(qid if unique_ids else f"L{line}", example.query,
                                   list(dict.fromkeys(positives)), extra))
    return queries, doc_ids, doc_texts


def mine_jsonl(path: str | Path, output: str | Path, config: MiningConfig | None = None, encoder=None,
               shard: Shard | None = None, corpus: str | Path | None = None) -> MiningReport:
    """Mine negatives for the records of a training JSONL (see :func:`load_jsonl_for_mining`)."""
    refuse_overwriting_inputs(output, path, corpus, stage="mine")
    queries, doc_ids, doc_texts = load_jsonl_for_mining(path, corpus)
    return mine_negatives(queries, doc_ids, doc_texts, output, config, encoder, shard)


def mine_beir(path: str | Path, split: str, output: str | Path, config: MiningConfig | None = None,
              encoder=None, shard: Shard | None = None) -> MiningReport:
    """Mine negatives for the queries of a BEIR split against its corpus."""
    refuse_overwriting_inputs(output, path, stage="mine")
    dataset = load_beir(path, split)
    return mine_negatives(queries_from_beir(dataset), dataset.corpus.ids, dataset.corpus.texts_for_encoding(),
                          output, config, encoder, shard)
