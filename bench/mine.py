"""Hard-negative mining throughput and peak memory: robustir vs ``sentence_transformers.util.mine_hard_negatives``.

Same corpus, queries, model, passage max length, batch size, thread count, number of negatives and depth; each
side runs in its own subprocess (peak RSS from ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of that process,
after the model is loaded and before mining, and at the end). Defaults: SciFact train queries (809) x corpus
(5,183 abstracts), the bundled all-MiniLM-L6-v2, max length 128, fp32, batch 64, top-10 of the first 50.

    python bench/mine.py                      # prints both sides and the ratios, plus robustir BM25 alone
    python bench/mine.py --threads 2 --max-length 128 --num-negatives 10

Throughput = distinct queries / wall seconds of the mining call (corpus encoding included, model loading not).
sentence-transformers mines one row per (query, positive) pair (919 rows for 809 queries); robustir one
record per query with all its positives excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "scifact"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(data: str):
    from robustir.data.beir import load_beir

    dataset = load_beir(data, "train")
    return dataset


def side_robustir(args: argparse.Namespace) -> dict:
    from robustir.negatives.mining import MiningConfig, mine_negatives, queries_from_beir
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path

    dataset = _load(args.data)
    queries = queries_from_beir(dataset)
    encoder = None
    if args.method == "dense":
        encoder = Encoder.from_pretrained(default_model_path(), query_max_length=args.max_length,
                                          passage_max_length=args.max_length)
    rss_loaded = _rss_mb()
    config = MiningConfig(method=args.method, num_negatives=args.num_negatives, range_max=args.range_max,
                          encode_batch_size=args.batch_size,
                          precision="bf16" if args.bf16 else "fp32")  # the same precision as the ST side
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        report = mine_negatives(queries, dataset.corpus.ids, dataset.corpus.texts_for_encoding(),
                                Path(tmp) / "out.jsonl", config, encoder, show_progress=False)
        elapsed = time.perf_counter() - start
    return {"side": f"robustir-{args.method}", "queries": len(queries), "seconds": elapsed,
            "queries_per_s": len(queries) / elapsed, "rss_loaded_mb": rss_loaded, "peak_rss_mb": _rss_mb(),
            "negatives": report.negatives}


def side_st(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from robustir.resources import default_model_path

    dataset = _load(args.data)
    texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
    anchors, positives = [], []
    for qid, judged in dataset.qrels.items():
        for doc_id, grade in judged.items():
            if grade > 0:
                anchors.append(dataset.queries[qid])
                positives.append(texts[doc_id])
    pairs = Dataset.from_dict({"anchor": anchors, "positive": positives})
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = args.max_length
    if args.bf16:
        model = model.to(dtype=__import__("torch").bfloat16)
    rss_loaded = _rss_mb()
    start = time.perf_counter()
    mined = mine_hard_negatives(pairs, model, corpus=list(texts.values()), range_max=args.range_max,
                                num_negatives=args.num_negatives, sampling_strategy="top", batch_size=args.batch_size,
                                output_format="n-tuple", use_faiss=False, verbose=False)
    elapsed = time.perf_counter() - start
    n_queries = len(set(anchors))
    return {"side": "sentence-transformers", "queries": n_queries, "rows": len(pairs), "seconds": elapsed,
            "queries_per_s": n_queries / elapsed, "rss_loaded_mb": rss_loaded, "peak_rss_mb": _rss_mb(),
            "output_rows": len(mined)}


def run_side(name: str, args: argparse.Namespace, method: str = "dense") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--side", name, "--method", method, "--data", str(args.data),
           "--max-length", str(args.max_length), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
           "--num-negatives", str(args.num_negatives), "--range-max", str(args.range_max)] + (["--bf16"] if args.bf16 else [])
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-negatives", type=int, default=10)
    parser.add_argument("--range-max", type=int, default=50)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--method", default="dense", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=["robustir", "st"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(side_robustir(args) if args.side == "robustir" else side_st(args)))
        return
    ours = run_side("robustir", args)
    theirs = run_side("st", args)
    bm25 = run_side("robustir", args, method="bm25")
    print(f"mining SciFact train queries x corpus, MiniLM, max length {args.max_length}, batch {args.batch_size}, "
          f"{args.threads} threads, {'bf16' if args.bf16 else 'fp32'}, top {args.num_negatives} of {args.range_max}")
    print(f"{'side':24s} {'queries':>7s} {'seconds':>8s} {'queries/s':>10s} {'RSS after load MB':>18s} {'peak RSS MB':>12s}")
    for row in (ours, theirs, bm25):
        print(f"{row['side']:24s} {row['queries']:7d} {row['seconds']:8.1f} {row['queries_per_s']:10.1f} "
              f"{row['rss_loaded_mb']:18.0f} {row['peak_rss_mb']:12.0f}")
    print(f"ratios robustir-dense / sentence-transformers: throughput x{ours['queries_per_s'] / theirs['queries_per_s']:.2f}, "
          f"peak RSS x{ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}, "
          f"mining-time RSS growth {ours['peak_rss_mb'] - ours['rss_loaded_mb']:.0f} MB vs "
          f"{theirs['peak_rss_mb'] - theirs['rss_loaded_mb']:.0f} MB")


if __name__ == "__main__":
    main()
