"""``robustir pairs``: mine GUR (sentence, sentence) pairs by weighted longest common substring."""

from __future__ import annotations

import argparse
import sys
import time

from ..config import load_config
from ..outputs import StageOutput, refuse_overwriting_inputs, stage_settings
from ..io import Shard
from ..queries.pairs import PairMiningConfig, mine_pairs
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
    from tqdm import tqdm

    config = build_config(args)
    shard = Shard.parse(args.shard)
    target = StageOutput(args.output, shard)
    output = target.path
    refuse_overwriting_inputs(output, args.input, stage="pairs")
    settings = stage_settings("pairs", config, {"input": args.input},
                              extra={"format": args.format, "text_unit": args.text_unit})
    if target.nothing_to_do(args.overwrite, "pairs", settings):
        return 0
    started = time.perf_counter()
    stats = mine_pairs(args.input, output, config, fmt=args.format, text_unit=args.text_unit, shard=shard,
                       progress=lambda docs: tqdm(docs, desc="pairs", unit="doc", file=sys.stderr, disable=None))
    elapsed = max(time.perf_counter() - started, 1e-9)
    print(f"robustir pairs: {stats.summary()} in {elapsed:.1f}s = {stats.pairs / elapsed:.0f} pairs/s, "
          f"{stats.documents / elapsed:.0f} documents/s; wrote {output}")
    target.finished()
    return 0
