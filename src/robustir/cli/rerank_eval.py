"""``robustir rerank-eval``: MAP / MRR@10 over given candidate lists (C-MTEB reranking style)."""

from __future__ import annotations

import argparse

from ..evaluation.metrics import format_table
from ..evaluation.rerank import evaluate_reranking, load_rerank_data
from ..io import write_json
from ..models.encoder import Encoder
from .common import add_encoder_args, add_encoding_args, encoder_options, model_or_default


def register(parser: argparse.ArgumentParser) -> None:
    add_encoder_args(parser)
    add_encoding_args(parser)
    parser.add_argument("--data", required=True,
                        help='JSONL: {"query": ..., "positive": [...], "negative": [...]} per line')
    parser.add_argument("--output", default=None, help="folder for metrics.json")


def run(args: argparse.Namespace) -> int:
    encoder = Encoder.from_pretrained(model_or_default(args.model), device=args.device or "auto",
                                      **encoder_options(args))
    metrics = evaluate_reranking(encoder, load_rerank_data(args.data), args.batch_size, args.precision or "auto")
    print(format_table({args.model or "all-MiniLM-L6-v2": metrics}, columns=("map", "mrr@10", "ndcg@10")))
    if args.output:
        write_json(f"{args.output}/metrics.json", metrics)
    return 0
