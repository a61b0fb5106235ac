"""Held-out generalisation: the base model against fine-tuned ones on BEIR sets no choice was made on.

    python bench/heldout.py --models runs/vs_st/cpu/robustir-infonce-07db196b-seed{1,2,3}/model \
        --data medline cisi cacm --output runs/heldout38/results.jsonl

Every model is scored with the same evaluation (`robustir.robustness.sidebyside.evaluate_model`, the cpu preset's
lengths and precision) on each set's test split; one JSON row per (set, model) is appended to --output and a
table (base, each model, mean ± std of the fine-tuned ones, difference) is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from robustir.resources import default_model_path
    from robustir.robustness.sidebyside import PRESETS, evaluate_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="fine-tuned model folders")
    parser.add_argument("--base", default=None, help="base model folder (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--data", nargs="+", default=["medline", "cisi", "cacm"],
                        help="BEIR folders, or names under ../shared/data")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--output", default="runs/heldout/results.jsonl")
    args = parser.parse_args(argv)
    budget = PRESETS[args.preset]
    models = {"base": args.base or default_model_path(), **{str(m): m for m in args.models}}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = []
    with open(out, "a", encoding="utf-8") as handle:
        for data in args.data:
            folder = data if Path(data).is_dir() else f"../shared/data/{data}"
            cache: dict = {}
            scores = {}
            for name, path in models.items():
                started = time.perf_counter()
                metrics = evaluate_model(path, folder, "test", budget, cache)
                scores[name] = 100 * metrics["ndcg@10"]
                handle.write(json.dumps({"data": data, "model": name, "ndcg@10": metrics["ndcg@10"],
                                         "recall@100": metrics["recall@100"],
                                         "seconds": round(time.perf_counter() - started)}) + "\n")
                handle.flush()
            tuned = [v for k, v in scores.items() if k != "base"]
            std = statistics.stdev(tuned) if len(tuned) > 1 else 0.0
            table.append(f"{data:12s} base {scores['base']:.2f}  fine-tuned {' / '.join(f'{v:.2f}' for v in tuned)}"
                         f" = {statistics.mean(tuned):.2f} ± {std:.2f}  ({statistics.mean(tuned) - scores['base']:+.2f})")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
