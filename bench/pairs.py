"""Throughput of GUR pair mining on real corpora (documents/s, LCS comparisons/s, pairs/s).

    python bench/pairs.py                       # cmrc2018-trial and scifact from ../shared/data
    python bench/pairs.py --corpus PATH --limit 2000
    python bench/pairs.py --compare-library     # also time the authors' `suffixautomaton` package if installed

Mining runs in-process over the raw documents (title + text), single core, default
:class:`~robustir.queries.pairs.PairMiningConfig`, no file output, so the figures are the miner's own.
"""

from __future__ import annotations

import argparse
import time
import unicodedata
from itertools import islice
from pathlib import Path

from robustir.data.documents import read_documents
from robustir.queries.pairs import (PairMiningConfig, SuffixAutomaton, _DocCounters, document_rows,
                                   mine_document_pairs)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_CORPORA = [SHARED_DATA / "cmrc2018-trial", SHARED_DATA / "scifact"]


def bench_corpus(path: Path, limit: int | None, config: PairMiningConfig) -> dict[str, float]:
    docs = list(islice(read_documents(path), limit))
    counters = _DocCounters()
    seen: set[int] = set()
    started = time.perf_counter()
    n_pairs = 0
    for doc in docs:
        n_pairs += len(mine_document_pairs(doc.id, doc.title, doc.text, config, seen, counters))
    elapsed = time.perf_counter() - started
    return {"documents": len(docs), "seconds": elapsed, "docs_per_s": len(docs) / elapsed,
            "comparisons": counters.comparisons, "comparisons_per_s": counters.comparisons / elapsed,
            "lcs_runs": counters.lcs_runs,
            "pairs": n_pairs, "pairs_per_s": n_pairs / elapsed}


def compare_library(path: Path, limit: int | None) -> None:
    """Time build+match per sentence pair: ours vs the authors' package (``pip install suffixautomaton``)."""
    try:
        import SuffixAutomaton as library  # noqa: N813 - the package's own module name
    except ImportError:
        print("  (suffixautomaton not installed; skipping the library comparison)")
        return

    def weight(s: str) -> float:  # the authors' float weight
        return sum((1.0 if ord(c) > 10000 else 0.3) if unicodedata.category(c)[0] == "L" else 0.1 for c in s)

    pairs = []
    for doc in islice(read_documents(path), limit):
        rows = [r[:128].lower() for r in document_rows(doc.title, doc.text, PairMiningConfig())[0]]
        pairs += [(rows[i], rows[j]) for i in range(len(rows)) for j in range(i + 1, min(len(rows), i + 10))]
    pairs = pairs[:20000]
    t0 = time.perf_counter()
    ours = [SuffixAutomaton(a).heaviest_match(b)[0] / 10 for a, b in pairs]
    t1 = time.perf_counter()
    theirs = [max((weight(x[3]) for x in library.SuffixAutomaton(a).lcs1(b, min_len=1, output_lcs=True)),
                  default=0.0) for a, b in pairs]
    t2 = time.perf_counter()
    lower = sum(t < o - 1e-6 for o, t in zip(ours, theirs))
    higher = sum(t > o + 1e-6 for o, t in zip(ours, theirs))
    print(f"  {len(pairs)} sentence pairs: ours {1e6 * (t1 - t0) / len(pairs):.1f} us/pair, "
          f"suffixautomaton {1e6 * (t2 - t1) / len(pairs):.1f} us/pair; library weight lower on {lower}, "
          f"higher on {higher}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", type=Path, help="BEIR folder / JSONL / text (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="documents per corpus (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-library", action="store_true")
    args = parser.parse_args()
    config = PairMiningConfig(seed=args.seed)
    for path in args.corpus or DEFAULT_CORPORA:
        if not path.exists():
            print(f"{path}: not found, skipped")
            continue
        r = bench_corpus(path, args.limit, config)
        print(f"{path.name}: {r['documents']} docs in {r['seconds']:.2f}s = {r['docs_per_s']:.0f} docs/s, "
              f"{r['comparisons']} candidate comparisons = {r['comparisons_per_s']:.0f}/s "
              f"({r['lcs_runs']} needed the automaton), "
              f"{r['pairs']} pairs = {r['pairs_per_s']:.0f} pairs/s")
        if args.compare_library:
            compare_library(path, args.limit)


if __name__ == "__main__":
    main()
