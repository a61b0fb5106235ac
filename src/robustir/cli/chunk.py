"""``robustir chunk``: split raw documents into passages (a BEIR corpus.jsonl) that fit a token budget."""

from __future__ import annotations

import argparse
import sys
import time

from ..data.chunking import chunk_corpus
from ..outputs import StageOutput
from ..io import Shard


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL/BEIR corpus.jsonl file, BEIR folder, or plain text")
    parser.add_argument("--output", required=True,
                        help="passages JSONL (with --shard i/n: .shard-0000i-of-0000n is added before the suffix)")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "beir"],
                        help="input format (auto: folder -> beir, .jsonl/.json -> jsonl, else text)")
    parser.add_argument("--text-unit", default="block", choices=["block", "line"],
                        help="plain text: one document per blank-line-separated block, or per line")
    parser.add_argument("--max-tokens", type=int, default=256, help="token budget of a passage")
    parser.add_argument("--overlap", type=int, default=1, help="sentences repeated from the previous passage")
    parser.add_argument("--min-tokens", type=int, default=32,
                        help="a shorter last passage borrows earlier sentences (within the budget)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer name or path for exact counts (default: words / CJK characters)")
    parser.add_argument("--shard", default=None, help="process shard I of N (round-robin over documents), e.g. 2/8")
    parser.add_argument("--overwrite", action="store_true", help="redo even if the output is complete")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    shard = Shard.parse(args.shard)
    target = StageOutput(args.output, shard)
    output = target.path
    if args.overwrite:
        target.clear()
    elif target.complete():
        print(f"robustir chunk: {output} is complete; nothing to do (--overwrite to redo)")
        return 0
    started = time.perf_counter()
    stats = chunk_corpus(args.input, output, fmt=args.format, text_unit=args.text_unit, tokenizer=args.tokenizer,
                         max_tokens=args.max_tokens, overlap_sentences=args.overlap, min_tokens=args.min_tokens,
                         shard=shard,
                         progress=lambda docs: tqdm(docs, desc="chunk", unit="doc", file=sys.stderr,
                                                    disable=None))
    elapsed = time.perf_counter() - started
    print(f"robustir chunk: {stats.documents} documents -> {stats.passages} passages "
          f"({stats.empty_documents} empty, {stats.skipped_done} already done) in {elapsed:.1f}s; wrote {output}")
    return 0
