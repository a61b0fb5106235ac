"""``robustir pairs``: mine GUR (sentence, sentence) pairs by weighted longest common substring."""

from __future__ import annotations

import argparse
import time

from ..config import load_config
from ..queries.pairs import PairMiningConfig
from .common import add_config_flags, flags_from_args

# PairMiningConfig fields with a flag (help from the dataclass); the others via --config or key=value


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="raw documents: JSONL, BEIR folder/corpus.jsonl, or text")
    parser.add_argument("--output", required=True,
                        help="FlagEmbedding JSONL (with --shard i/n: .shard-0000i-of-0000n is added before the suffix)")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "beir"])
    parser.add_argument("--text-unit", default="block", choices=["block", "line"],
                        help="plain text: one document per blank-line-separated block, or per line")
    parser.add_argument("--config", default=None, help="YAML/JSON file of PairMiningConfig options")
    keys = add_config_flags(parser, PairMiningConfig)
    parser.set_defaults(_flag_keys=keys)
    parser.add_argument("--shard", default=None, help="process shard I of N (round-robin over documents), e.g. 2/8")
    parser.add_argument("--overwrite", action="store_true", help="redo even if the output is complete")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. short_text_weight=20")


def build_config(args: argparse.Namespace) -> PairMiningConfig:
    return load_config(PairMiningConfig, args.config, args.overrides, flags_from_args(args, args._flag_keys))


def run(args: argparse.Namespace) -> int:
    from ..queries.pairs import PAIRS
    from ..runs import Job, execute

    config = build_config(args)
    job = Job(args.output, {"input": args.input}, args.shard, {"format": args.format, "text_unit": args.text_unit})
    started = time.perf_counter()
    result = execute(PAIRS, config, job, overwrite=args.overwrite)
    if not result.skipped:
        stats, elapsed = result.report, max(time.perf_counter() - started, 1e-9)
        print(f"robustir pairs: {stats.summary()} in {elapsed:.1f}s = {stats.pairs / elapsed:.0f} pairs/s, "
              f"{stats.documents / elapsed:.0f} documents/s; wrote {result.artifact.path}")
    return 0
