"""``robustir eval``: retrieval metrics of a model (or BM25) on a BEIR folder."""

from __future__ import annotations

import argparse

from ..evaluation.metrics import format_table
from ..evaluation.retrieval import EvalConfig, evaluate
from ..index.dense import DenseIndexConfig
from .common import add_encoder_args, data_or_default, encoder_options, model_or_default


def register(parser: argparse.ArgumentParser) -> None:
    add_encoder_args(parser)
    parser.add_argument("--data", default=None, help="BEIR folder (default: the bundled SciFact)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--output", default=None, help="folder for metrics.json and run.trec")
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--index", choices=["flat", "ivf", "hnsw"], default="flat",
                        help="FAISS index: exact inner product (flat) or approximate for large corpora")
    parser.add_argument("--nprobe", type=int, default=32, help="IVF cells searched")
    parser.add_argument("--ignore-identical-ids", action="store_true",
                        help="drop a retrieved document whose id equals the query id (ArguAna)")
    parser.add_argument("--cache-dir", default=None, help="reuse corpus embeddings saved here")


def run(args: argparse.Namespace) -> int:
    model = args.model if args.model and args.model.lower() == "bm25" else model_or_default(args.model)
    config = EvalConfig(top_k=args.top_k, batch_size=args.batch_size, bf16=args.bf16,
                        ignore_identical_ids=args.ignore_identical_ids, cache_dir=args.cache_dir,
                        index=DenseIndexConfig(kind=args.index, nprobe=args.nprobe))
    data = data_or_default(args.data)
    options = {} if model == "bm25" else encoder_options(args)
    result = evaluate(model, data, args.split, config, output=args.output, **options)
    name = "bm25" if model == "bm25" else (args.model or "all-MiniLM-L6-v2 (bundled)")
    print(format_table({name: result.metrics}, title=f"{data.name} / {args.split}  ({result.seconds:.0f} s)"))
    if args.output:
        print(f"wrote {args.output}/metrics.json and {args.output}/run.trec")
    return 0
