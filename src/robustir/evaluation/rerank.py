"""Reranking evaluation (as C-MTEB's reranking tasks): rank each query's given candidates, report MAP/MRR.

Input JSONL, one object per query: ``{"query": str, "positive": [str, ...], "negative": [str, ...]}``
(``pos``/``neg`` are accepted too, so FlagEmbedding training files work as well).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from ..errors import DataError
from ..io import read_jsonl
from ..models.encoder import Encoder
from .metrics import compute_metrics


@dataclass
class RerankExample:
    query: str
    positive: list[str]
    negative: list[str]


def load_rerank_data(path: str | Path) -> list[RerankExample]:
    examples = []
    for line, obj in read_jsonl(path):
        query = obj.get("query")
        positive = obj.get("positive", obj.get("pos"))
        negative = obj.get("negative", obj.get("neg", []))
        if not isinstance(query, str) or not query.strip():
            raise DataError(path, "missing or empty 'query'", line=line, field="query")
        for name, value in (("positive", positive), ("negative", negative)):
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise DataError(path, "expected a list of strings", line=line, field=name,
                                fix=f'"{name}": ["candidate text", ...]')
        if not positive:
            continue  # a query without a relevant candidate has no defined AP; C-MTEB skips it too
        examples.append(RerankExample(query, positive, negative))
    if not examples:
        raise DataError(path, "no query with at least one positive candidate")
    return examples


def evaluate_reranking(encoder: Encoder, examples: list[RerankExample], batch_size: int = 64,
                       precision: str = "auto") -> dict[str, float]:
    """MAP over each query's full candidate list and MRR@10, by cosine similarity of embeddings."""
    texts: list[str] = []
    for ex in examples:
        texts.extend(ex.positive)
        texts.extend(ex.negative)
    cand = encoder.encode(texts, "passage", batch_size=batch_size, precision=precision)
    queries = encoder.encode([ex.query for ex in examples], "query", batch_size=batch_size, precision=precision)
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, dict[str, float]] = {}
    offset = 0
    for i, ex in enumerate(examples):
        n = len(ex.positive) + len(ex.negative)
        scores = cand[offset:offset + n] @ queries[i]
        offset += n
        qid = f"q{i}"
        qrels[qid] = {f"c{j}": 1 for j in range(len(ex.positive))}
        run[qid] = {f"c{j}": float(s) for j, s in enumerate(scores)}
    depth = max(len(r) for r in run.values())
    metrics = compute_metrics(qrels, run, ndcg=(10,), recall=(), map_at=(depth,), mrr=(10,))
    return {"map": metrics[f"map@{depth}"], "mrr@10": metrics["mrr@10"], "ndcg@10": metrics["ndcg@10"],
            "queries": float(len(examples))}


