"""NDCG@10 of dense, lexical (BM25) and hybrid (RRF) retrieval, side by side on the same collections (issue 23).

    python bench/hybrid.py --data ../shared/data/scifact ../shared/data/cisi ../shared/data/medline \\
        --precision fp32 --output docs/results/hybrid.jsonl

One model load per run; the corpus embeddings are computed once per collection (``--cache-dir``) and shared by the
dense and the hybrid mode, so the hybrid line costs one BM25 index more than the dense one. Prints a table and
appends one JSON line per (collection, mode) to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without installing

from robustir.evaluation.retrieval import EvalConfig, evaluate  # noqa: E402
from robustir.models.encoder import Encoder  # noqa: E402
from robustir.resources import default_model_path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", required=True, help="BEIR folders (test split)")
    parser.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--cache-dir", default="runs/hybrid-cache")
    parser.add_argument("--rrf-k", type=int, default=60)
    parser.add_argument("--output", default=None, help="JSONL file the rows are appended to")
    args = parser.parse_args()
    model = args.model or default_model_path()
    encoder = Encoder.from_pretrained(model)
    rows = []
    for data in args.data:
        for mode in ("lexical", "dense", "hybrid"):
            config = EvalConfig(mode=mode, top_k=100, precision=args.precision, cache_dir=args.cache_dir,
                                fusion={"rrf_k": args.rrf_k}, show_progress=False)
            start = time.perf_counter()
            result = evaluate(encoder, data, "test", config)
            row = {"data": Path(data).name, "mode": mode, "ndcg@10": round(100 * result.metrics["ndcg@10"], 2),
                   "recall@100": round(100 * result.metrics.get("recall@100", float("nan")), 2),
                   "seconds": round(time.perf_counter() - start, 1), "model": args.model or "all-MiniLM-L6-v2",
                   "precision": args.precision, "rrf_k": args.rrf_k, "machine": platform.processor() or
                   platform.machine()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'collection':<24}{'lexical':>10}{'dense':>10}{'hybrid':>10}   NDCG@10")
    for data in args.data:
        name = Path(data).name
        cells = {r["mode"]: r["ndcg@10"] for r in rows if r["data"] == name}
        print(f"{name:<24}{cells['lexical']:>10.2f}{cells['dense']:>10.2f}{cells['hybrid']:>10.2f}")
    if args.output:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
