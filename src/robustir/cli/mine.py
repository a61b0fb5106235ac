"""``robustir mine``: mine hard negatives with BM25 or a dense model.

Examples::

    robustir mine --data ../shared/data/scifact --split train --method bm25 --output runs/mined.jsonl
    robustir mine --input train.jsonl --corpus corpus.jsonl --method dense --cache-dir runs/cache \\
        --num-negatives 15 --range-min 3 --relative-margin 0.05 --output runs/mined.jsonl
    robustir mine --input pairs.jsonl --output mined.jsonl --shard 2/4     # then: robustir merge --output mined.jsonl
    # a corpus of millions: embeddings cached on disk and searched 100k rows at a time (docs/scale.md)
    robustir mine --input train.jsonl --corpus corpus.jsonl --method dense --cache-dir runs/cache \\
        --corpus-chunk 100000 --output runs/mined.jsonl

Without ``--corpus`` a training JSONL is mined against every ``pos``/``neg`` text in the file (FlagEmbedding
convention). Positives -- by id and by identical text -- and the query itself are never returned.
A re-run resumes; a complete output is left alone (``--overwrite`` to redo).
"""

from __future__ import annotations

import argparse
import time

from ..negatives.mining import MiningConfig
from .common import (add_config_flags, add_encoder_args, config_from_flags, encoder_options,
                     model_or_default)




def register(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("input (one of)")
    source.add_argument("--data", help="BEIR folder: mine for the queries of --split against its corpus")
    source.add_argument("--split", default="train", help="qrels split of --data (default train)")
    source.add_argument("--input", help="training JSONL (query/pos[/neg]) to mine negatives for")
    source.add_argument("--corpus", help="with --input: candidate documents (BEIR corpus.jsonl); "
                                         "default: every pos/neg text of the input")
    parser.add_argument("--output", required=True,
                        help="training JSONL to write (with --shard i/n: .shard-0000i-of-0000n before the suffix)")
    keys = add_config_flags(parser, MiningConfig)
    parser.set_defaults(_flag_keys=keys)
    parser.add_argument("--shard", help="process shard I of N of the queries (round-robin), e.g. 2/8")
    parser.add_argument("--overwrite", action="store_true", help="redo even if the output is complete")
    add_encoder_args(parser)


def mining_config(args: argparse.Namespace) -> MiningConfig:
    """The :class:`MiningConfig` the flags describe (validated)."""
    config = config_from_flags(MiningConfig, args)
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    from ..negatives.mining import MINE
    from ..runs import Job, execute

    config = mining_config(args)
    settings: dict = {"split": args.split if args.data else None}
    inputs = {"data": args.data, "input": args.input, "corpus": args.corpus}
    if config.method == "dense":  # the model by its content: one retrained in place is a changed input
        settings.update(encoder_options(args))
        inputs["model"] = model_or_default(args.model)
    started = time.perf_counter()
    result = execute(MINE, config, Job(args.output, inputs, args.shard, settings), overwrite=args.overwrite)
    if not result.skipped:
        report, elapsed = result.report, max(time.perf_counter() - started, 1e-9)
        print(report.format())
        print(f"robustir mine: {report.queries} queries in {elapsed:.1f}s ({report.queries / elapsed:.1f} "
              f"queries/s); wrote {result.artifact.path} and {result.artifact.path.name}.report.json")
    return 0
