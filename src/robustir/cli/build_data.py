"""``robustir build-data``: chunk -> generate/pairs -> mine -> filter from one config, resuming finished stages.

Example::

    robustir build-data --config configs/build-data-example.yaml
    robustir build-data --config configs/build-data-example.yaml work_dir=runs/bd2 filter.method=sieve \\
        filter.sieve.num_negatives=7 filter.sieve.max_steps=50

Re-running the same command skips every stage whose output is complete (see ``work_dir/build-data.json``).
"""

from __future__ import annotations

import argparse

from ..config import load_config
from ..mining.build_data import BuildDataConfig, build_data


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML/JSON BuildDataConfig (see configs/build-data-example.yaml)")
    parser.add_argument("--input", help="raw documents (overrides input:)")
    parser.add_argument("--work-dir", help="stage outputs go here (overrides work_dir:)")
    parser.add_argument("--output", help="copy the final training JSONL here (overrides output:)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. mine.method=dense filter.method=sieve")


def run(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in {"input": args.input, "work_dir": args.work_dir, "output": args.output}.items()
             if v is not None}
    config = load_config(BuildDataConfig, args.config, args.overrides, flags)
    final, results = build_data(config)
    for result in results:
        state = "skipped (complete)" if result.skipped else f"ran in {result.seconds:.1f}s"
        print(f"  {result.name:18s} {state:22s} {result.output}" + (f"  [{result.summary}]" if result.summary else ""))
    print(f"robustir build-data: training data -> {final}")
    return 0
