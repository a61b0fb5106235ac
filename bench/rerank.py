"""``/search`` with ``rerank: true`` against the first stage alone, through a running ``robustir serve`` (issue 36).

    python bench/rerank.py --data ../shared/data/scifact --output docs/results/rerank.jsonl
    python bench/rerank.py --data ../shared/data/scifact --rerank-model path/to/cross-encoder

Builds (or reuses) a LanceDB index of the collection's corpus with the bundled MiniLM, starts the server in this
process on 127.0.0.1, and sends every test query once per setting, one at a time: ``lexical`` / ``dense`` /
``hybrid`` alone, and each of them with ``rerank: true`` (each query's best ``--candidates`` re-scored by the
reranker: ``--rerank-model``, a cross-encoder, else the served model's cosine). NDCG@10 from pytrec_eval on the
answers, and the client-side latency per query (median and p90 of one pass). Prints a table and appends one JSON line
per setting to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without installing

import httpx  # noqa: E402

from robustir.data.beir import load_beir  # noqa: E402
from robustir.evaluation.metrics import compute_metrics  # noqa: E402
from robustir.resources import default_model_path  # noqa: E402
from robustir.index.store import IndexConfig, SearchIndex  # noqa: E402
from robustir.serving import ServeConfig, create_app, running_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="BEIR folder (test split)")
    parser.add_argument("--index", default=None, help="index folder (default: runs/rerank-index-<collection>)")
    parser.add_argument("--rerank-model", default=None, help="a cross-encoder folder; default: the model's cosine")
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--modes", nargs="+", default=["lexical", "dense", "hybrid"], choices=["lexical", "dense",
                                                                                             "hybrid"])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    data = Path(args.data)
    dataset = load_beir(data, "test")
    index = Path(args.index or f"runs/rerank-index-{data.name}")
    started = time.perf_counter()
    SearchIndex.build(index, default_model_path(), data, config=IndexConfig(precision=args.precision))[0].close()
    print(f"index {index}: {time.perf_counter() - started:.0f} s (0 when reused)", flush=True)
    config = ServeConfig(precision=args.precision, rerank_model=args.rerank_model,
                         rerank_candidates=args.candidates, max_top_k=max(100, args.candidates),
                         max_rerank_pairs=max(1000, args.candidates))
    app = create_app(None, index, config)
    reranker = args.rerank_model or "the model's cosine (all-MiniLM-L6-v2)"
    rows = []
    with running_server(app) as url, httpx.Client(base_url=url, timeout=600) as client:
        for mode in args.modes:
            for rerank in (False, True):
                run, seconds = {}, []
                for qid, text in dataset.queries.items():
                    tick = time.perf_counter()
                    reply = client.post("/search", json={"query": text, "top_k": 10, "mode": mode, "rerank": rerank})
                    seconds.append(time.perf_counter() - tick)
                    reply.raise_for_status()
                    hits = reply.json()["hits"]
                    key = "rerank_score" if rerank else "score"
                    run[qid] = {h["id"]: float(h[key]) - 1e-6 * rank for rank, h in enumerate(hits)}  # rank order kept
                metrics = compute_metrics(dataset.qrels, run)
                seconds.sort()
                row = {"data": data.name, "mode": mode, "rerank": rerank, "reranker": reranker if rerank else None,
                       "candidates": args.candidates if rerank else None,
                       "ndcg@10": round(100 * metrics["ndcg@10"], 2), "queries": len(run),
                       "median_ms": round(1000 * statistics.median(seconds), 1),
                       "p90_ms": round(1000 * seconds[int(0.9 * (len(seconds) - 1))], 1),
                       "precision": args.precision, "machine": platform.processor() or platform.machine()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{data.name}: NDCG@10 (median ms per query), reranker: {reranker}, {args.candidates} candidates")
    print(f"{'mode':<10}{'alone':>18}{'+ rerank':>18}")
    for mode in args.modes:
        alone, reranked = (next(r for r in rows if r["mode"] == mode and r["rerank"] == flag) for flag in (False, True))
        print(f"{mode:<10}{alone['ndcg@10']:>9.2f} ({alone['median_ms']:>5.0f}){reranked['ndcg@10']:>9.2f} "
              f"({reranked['median_ms']:>5.0f})")
    if args.output:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
