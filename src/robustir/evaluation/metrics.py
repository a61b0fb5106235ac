"""Retrieval metrics computed by trec_eval itself (through pytrec_eval), as the papers report them.

Keys are lowercase ``<measure>@<k>``: ``ndcg@10``, ``mrr@10``, ``recall@100``, ``map@100``; values in
[0, 1], averaged over **every judged query** (a query the run misses counts as 0, unlike a bare
pytrec_eval average, which silently drops it).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

NDCG_CUTOFFS = (1, 3, 5, 10, 100)
RECALL_CUTOFFS = (1, 5, 10, 20, 50, 100, 1000)
MAP_CUTOFFS = (100,)
MRR_CUTOFFS = (10,)

Run = Mapping[str, Mapping[str, float]]
Qrels = Mapping[str, Mapping[str, int]]


def trec_order(scores: Mapping[str, float]) -> list[str]:
    """Documents in trec_eval's order: score descending, ties by document id descending."""
    return [d for d, _ in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]


def truncate_run(run: Run, k: int) -> dict[str, dict[str, float]]:
    return {q: {d: float(docs[d]) for d in trec_order(docs)[:k]} for q, docs in run.items()}


def drop_identical_ids(run: Run) -> dict[str, dict[str, float]]:
    """Remove a document whose id equals the query id (BEIR's ``ignore_identical_ids``; needed for ArguAna,
    where each query is itself in the corpus)."""
    return {q: {d: s for d, s in docs.items() if d != q} for q, docs in run.items()}


def per_query_metrics(qrels: Qrels, run: Run, ndcg: Iterable[int] = NDCG_CUTOFFS,
                      recall: Iterable[int] = RECALL_CUTOFFS, map_at: Iterable[int] = MAP_CUTOFFS,
                      mrr: Iterable[int] = MRR_CUTOFFS) -> dict[str, dict[str, float]]:
    """``{metric: {query_id: value}}`` for every judged query (0 where the run has nothing for it)."""
    import pytrec_eval

    ndcg, recall, map_at, mrr = list(ndcg), list(recall), list(map_at), list(mrr)
    qrels = {q: {d: int(g) for d, g in docs.items()} for q, docs in qrels.items()}
    run = {q: {d: float(s) for d, s in docs.items()} for q, docs in run.items() if q in qrels}
    measures = set()
    if ndcg:
        measures.add("ndcg_cut." + ",".join(map(str, ndcg)))
    if recall:
        measures.add("recall." + ",".join(map(str, recall)))
    if map_at:
        measures.add("map_cut." + ",".join(map(str, map_at)))
    results = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run) if measures else {}
    out: dict[str, dict[str, float]] = {}
    for k in ndcg:
        out[f"ndcg@{k}"] = {q: results.get(q, {}).get(f"ndcg_cut_{k}", 0.0) for q in qrels}
    for k in mrr:
        truncated = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(truncate_run(run, k))
        out[f"mrr@{k}"] = {q: truncated.get(q, {}).get("recip_rank", 0.0) for q in qrels}
    for k in recall:
        out[f"recall@{k}"] = {q: results.get(q, {}).get(f"recall_{k}", 0.0) for q in qrels}
    for k in map_at:
        out[f"map@{k}"] = {q: results.get(q, {}).get(f"map_cut_{k}", 0.0) for q in qrels}
    return out


def compute_metrics(qrels: Qrels, run: Run, *, ignore_identical_ids: bool = False, **cutoffs) -> dict[str, float]:
    """Mean of each metric over all judged queries. ``cutoffs`` as in :func:`per_query_metrics`."""
    judged = {q: docs for q, docs in qrels.items() if any(g > 0 for g in docs.values())}
    if ignore_identical_ids:
        run = drop_identical_ids(run)
    per_query = per_query_metrics(judged, run, **cutoffs)
    return {name: float(np.mean(list(values.values()))) if values else 0.0 for name, values in per_query.items()}


def format_table(rows: Mapping[str, Mapping[str, float]],
                 columns: Iterable[str] = ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100"),
                 title: str = "") -> str:
    """A plain-text table, one row per system, values in percent."""
    columns = list(columns)
    name_width = max([len("system"), *map(len, rows)])
    lines = []
    if title:
        lines.append(title)
    header = "system".ljust(name_width) + "".join(c.rjust(12) for c in columns)
    lines += [header, "-" * len(header)]
    for name, metrics in rows.items():
        cells = "".join((f"{100 * metrics[c]:.2f}" if c in metrics else "-").rjust(12) for c in columns)
        lines.append(name.ljust(name_width) + cells)
    return "\n".join(lines)
