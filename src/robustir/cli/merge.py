"""``robustir merge``: join the shards of a stage into one file, after checking that all of them are complete.

Example::

    for i in 1 2 3 4; do robustir mine --data ../shared/data/scifact --output runs/mined.jsonl --shard $i/4 & done; wait
    robustir merge --output runs/mined.jsonl     # -> runs/mined.jsonl + runs/mined.jsonl.report.json
"""

from __future__ import annotations

import argparse

from ..outputs import StageOutput


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True,
                        help="the un-sharded output name the stage was given (its shards are found next to it)")
    parser.add_argument("--shards", type=int, default=None, help="number of shards N (default: from the file names)")
    parser.add_argument("--allow-failures", action="store_true",
                        help="merge shards whose .failed.jsonl lists items still to retry (generate)")


def run(args: argparse.Namespace) -> int:
    result = StageOutput(args.output).merge(args.shards, args.allow_failures)
    extra = f" and {result.report.name}" if result.report else ""
    print(f"robustir merge: {result.shards} shards, {result.lines} lines -> {result.output}{extra}")
    return 0
