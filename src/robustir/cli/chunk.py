"""``robustir chunk``: split raw documents into passages (a BEIR corpus.jsonl) that fit a token budget."""

from __future__ import annotations

import argparse
import time

from ..config import load_config
from ..data.chunking import ChunkConfig
from .common import add_config_flags, flags_from_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL/BEIR corpus.jsonl file, BEIR folder, or plain text")
    parser.add_argument("--output", required=True,
                        help="passages JSONL (with --shard i/n: .shard-0000i-of-0000n is added before the suffix)")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "beir"],
                        help="input format (auto: folder -> beir, .jsonl/.json -> jsonl, else text)")
    parser.add_argument("--text-unit", default="block", choices=["block", "line"],
                        help="plain text: one document per blank-line-separated block, or per line")
    keys = add_config_flags(parser, ChunkConfig)
    parser.set_defaults(_flag_keys=keys)
    parser.add_argument("--shard", default=None, help="process shard I of N (round-robin over documents), e.g. 2/8")
    parser.add_argument("--overwrite", action="store_true", help="redo even if the output is complete")


def build_config(args: argparse.Namespace) -> ChunkConfig:
    return load_config(ChunkConfig, None, None, flags_from_args(args, args._flag_keys))


def run(args: argparse.Namespace) -> int:
    from ..data.chunking import CHUNK
    from ..runs import Job, execute

    config = build_config(args)
    job = Job(args.output, {"input": args.input}, args.shard, {"format": args.format, "text_unit": args.text_unit})
    started = time.perf_counter()
    result = execute(CHUNK, config, job, overwrite=args.overwrite)
    if not result.skipped:
        print(f"robustir chunk: {result.report.summary()} in {time.perf_counter() - started:.1f}s; wrote "
              f"{result.artifact.path}")
    return 0
