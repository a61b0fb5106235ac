"""``robustir mine``: mine hard negatives with BM25 or a dense model.

Examples::

    robustir mine --data ../shared/data/scifact --split train --method bm25 --output runs/mined.jsonl
    robustir mine --input train.jsonl --corpus corpus.jsonl --method dense --bf16 --cache-dir runs/cache \\
        --num-negatives 15 --range-min 3 --relative-margin 0.05 --output runs/mined.jsonl
    robustir mine --input pairs.jsonl --output mined.jsonl --shard 2/4     # then: robustir merge --output mined.jsonl

Without ``--corpus`` a training JSONL is mined against every ``pos``/``neg`` text in the file (FlagEmbedding
convention). Positives -- by id and by identical text -- and the query itself are never returned.
A re-run resumes; a complete output is left alone (``--overwrite`` to redo).
"""

from __future__ import annotations

import argparse
import time

from ..outputs import StageOutput
from ..errors import ConfigError
from ..index.dense import DenseIndexConfig
from ..io import Shard
from ..negatives.mining import MiningConfig, mine_beir, mine_jsonl
from .common import add_encoder_args, encoder_options, model_or_default


def register(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("input (one of)")
    source.add_argument("--data", help="BEIR folder: mine for the queries of --split against its corpus")
    source.add_argument("--split", default="train", help="qrels split of --data (default train)")
    source.add_argument("--input", help="training JSONL (query/pos[/neg]) to mine negatives for")
    source.add_argument("--corpus", help="with --input: candidate documents (BEIR corpus.jsonl); "
                                         "default: every pos/neg text of the input")
    parser.add_argument("--output", required=True,
                        help="training JSONL to write (with --shard i/n: .shard-0000i-of-0000n before the suffix)")
    parser.add_argument("--method", choices=["bm25", "dense"], default="bm25")
    parser.add_argument("--num-negatives", type=int, default=15, help="negatives per query (default 15)")
    parser.add_argument("--range-min", type=int, default=0,
                        help="skip this many top-ranked non-positives (likely false negatives)")
    parser.add_argument("--range-max", type=int, default=100, help="retrieve to this rank (default 100)")
    parser.add_argument("--max-score", type=float, help="drop candidates scoring above this")
    parser.add_argument("--min-score", type=float, help="drop candidates scoring below this")
    parser.add_argument("--absolute-margin", type=float, help="keep if score <= positive score - margin")
    parser.add_argument("--relative-margin", type=float,
                        help="keep if score <= positive score * (1 - margin) (NV-Retriever; e.g. 0.05)")
    parser.add_argument("--sampling", choices=["top", "random"], default="top",
                        help="take the top survivors, or sample them at random (seeded)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cache-dir", help="reuse corpus embeddings saved here (dense)")
    parser.add_argument("--index", choices=["flat", "ivf", "hnsw"], default="flat", help="FAISS index (dense)")
    parser.add_argument("--query-batch-size", type=int, default=1024, help="queries retrieved per chunk")
    parser.add_argument("--shard", help="process shard I of N of the queries (round-robin), e.g. 2/8")
    parser.add_argument("--overwrite", action="store_true", help="redo even if the output is complete")
    add_encoder_args(parser)


def mining_config(args: argparse.Namespace) -> MiningConfig:
    """The :class:`MiningConfig` the flags describe (validated)."""
    config = MiningConfig(method=args.method, num_negatives=args.num_negatives, range_min=args.range_min,
                          range_max=args.range_max, max_score=args.max_score, min_score=args.min_score,
                          absolute_margin=args.absolute_margin, relative_margin=args.relative_margin,
                          sampling=args.sampling, seed=args.seed, query_batch_size=args.query_batch_size,
                          encode_batch_size=args.batch_size, bf16=args.bf16, cache_dir=args.cache_dir,
                          index=DenseIndexConfig(kind=args.index))
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    if bool(args.data) == bool(args.input):
        raise ConfigError("give exactly one of --data BEIR_DIR (with --split) or --input train.jsonl")
    if args.corpus and not args.input:
        raise ConfigError("--corpus goes with --input (a BEIR folder brings its own corpus)")
    config = mining_config(args)
    shard = Shard.parse(args.shard)
    target = StageOutput(args.output, shard, reports=True)
    output, report_path = target.path, target.report
    if target.complete() and not args.overwrite:
        print(f"robustir mine: {output} is complete; nothing to do (--overwrite to redo)")
        return 0
    if args.overwrite:
        target.clear()
    encoder = None
    if config.method == "dense":
        from ..models.encoder import Encoder

        encoder = Encoder.from_pretrained(model_or_default(args.model), **encoder_options(args))
    started = time.perf_counter()
    if args.data:
        report = mine_beir(args.data, args.split, output, config, encoder, shard)
    else:
        report = mine_jsonl(args.input, output, config, encoder, shard, corpus=args.corpus)
    elapsed = max(time.perf_counter() - started, 1e-9)
    print(report.format())
    print(f"robustir mine: {report.queries} queries in {elapsed:.1f}s ({report.queries / elapsed:.1f} queries/s); "
          f"wrote {output} and {report_path.name}")
    return 0
