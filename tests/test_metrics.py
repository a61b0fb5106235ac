"""Metrics equal trec_eval's (pytrec_eval) and the textbook definitions, incl. the edge cases."""

from __future__ import annotations

import math
import random

import pytest
import pytrec_eval

from robustir.evaluation.metrics import compute_metrics, format_table, trec_order


def textbook(qrels, run, k_ndcg=10, k_mrr=10, k_recall=100, k_map=100):
    """Independent definitions (trec_eval conventions: linear gain, log2 discount, ties by docid desc)."""
    out = {"ndcg": [], "mrr": [], "recall": [], "map": []}
    for q, judged in qrels.items():
        ranked = trec_order(run.get(q, {}))
        rel = [judged.get(d, 0) for d in ranked]
        dcg = sum(r / math.log2(i + 2) for i, r in enumerate(rel[:k_ndcg]) if r > 0)
        ideal = sorted((g for g in judged.values() if g > 0), reverse=True)
        idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal[:k_ndcg]))
        out["ndcg"].append(dcg / idcg if idcg else 0.0)
        first = next((i for i, r in enumerate(rel[:k_mrr]) if r > 0), None)
        out["mrr"].append(0.0 if first is None else 1 / (first + 1))
        n_rel = sum(1 for g in judged.values() if g > 0)
        out["recall"].append(sum(1 for r in rel[:k_recall] if r > 0) / n_rel)
        hits, precisions = 0, []
        for i, r in enumerate(rel[:k_map]):
            if r > 0:
                hits += 1
                precisions.append(hits / (i + 1))
        out["map"].append(sum(precisions) / n_rel)
    return {k: sum(v) / len(v) for k, v in out.items()}


def random_case(seed: int, graded: bool):
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(300)]
    qrels, run = {}, {}
    for q in range(40):
        qid = f"q{q}"
        qrels[qid] = {d: rng.choice([1, 2, 3]) if graded else 1 for d in rng.sample(docs, rng.randint(1, 6))}
        if q % 13 == 5:
            qrels[qid]["d_not_retrieved"] = 1
        if q == 7:
            continue  # run misses this query entirely
        run[qid] = {d: rng.random() for d in rng.sample(docs, 150)}
    return qrels, run


@pytest.mark.parametrize("seed, graded", [(0, False), (1, True), (2, True)])
def test_against_textbook_and_pytrec_eval(seed, graded):
    qrels, run = random_case(seed, graded)
    metrics = compute_metrics(qrels, run)
    expected = textbook(qrels, run)
    assert metrics["ndcg@10"] == pytest.approx(expected["ndcg"], abs=1e-9)
    assert metrics["mrr@10"] == pytest.approx(expected["mrr"], abs=1e-9)
    assert metrics["recall@100"] == pytest.approx(expected["recall"], abs=1e-9)
    assert metrics["map@100"] == pytest.approx(expected["map"], abs=1e-9)
    # pytrec_eval directly: identical per-query values; its bare average drops the missing query
    raw = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map_cut.100", "recall.1000"}).evaluate(run)
    mean_all = sum(raw[q]["ndcg_cut_10"] for q in raw) / len(qrels)
    assert metrics["ndcg@10"] == pytest.approx(mean_all, abs=1e-12)
    assert metrics["recall@1000"] == pytest.approx(sum(raw[q]["recall_1000"] for q in raw) / len(qrels), abs=1e-12)


def test_mrr_at_10_is_truncated():
    qrels = {"q": {"d11": 1}}
    run = {"q": {f"d{i}": 1.0 - i / 100 for i in range(20)}}  # relevant doc at rank 12
    metrics = compute_metrics(qrels, run)
    assert metrics["mrr@10"] == 0.0
    assert pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(run)["q"]["recip_rank"] == pytest.approx(1 / 12)


def test_ties_follow_trec_eval():
    qrels = {"q": {"a": 1}}
    run = {"q": {"a": 1.0, "b": 1.0}}  # trec_eval puts "b" first (docid descending on ties)
    assert compute_metrics(qrels, run)["mrr@10"] == 0.5
    ref = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(run)["q"]["recip_rank"]
    assert ref == 0.5


def test_ignore_identical_ids():
    qrels = {"q1": {"d1": 1}}
    run = {"q1": {"q1": 0.99, "d1": 0.5}}
    assert compute_metrics(qrels, run)["mrr@10"] == 0.5
    assert compute_metrics(qrels, run, ignore_identical_ids=True)["mrr@10"] == 1.0


def test_values_in_unit_range_and_keys():
    qrels, run = random_case(3, True)
    metrics = compute_metrics(qrels, run)
    for key in ["ndcg@1", "ndcg@3", "ndcg@5", "ndcg@10", "ndcg@100", "mrr@10", "recall@1", "recall@5",
                "recall@10", "recall@20", "recall@50", "recall@100", "recall@1000", "map@100"]:
        assert 0.0 <= metrics[key] <= 1.0
    assert "ndcg@10" in format_table({"sys": metrics})
