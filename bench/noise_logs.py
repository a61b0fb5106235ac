"""What the robust losses logged during a noise benchmark: PEG's sigma, mean w_q and momentum t, per condition.

    python bench/noise_logs.py runs/noise-bench-cpu            # every run of every method with these statistics
    python bench/noise_logs.py runs/noise-bench-cpu --steps 5  # average over the first / last 5 logged steps

For every ``runs/<condition>/<method>/train/train_log.jsonl`` under the benchmark folder, prints the mean of
each logged statistic over the first and the last ``--steps`` logged steps. This is how docs/robustness.md
explains *why* a method does or does not absorb a kind of noise (e.g. PEG's sigma, the batch mean of the
positive-pair cosine minus 0.1, is pulled down by planted false positives, and w_q = pos_cos - sigma
separates them only while sigma stays above them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("sigma", "mean_w_q", "t", "share_scaled_negatives", "pos_sim", "neg_sim", "loss")


def summarize(log: Path, steps: int) -> dict[str, tuple[float, float]]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r and "loss" in r]
    out = {}
    for key in KEYS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            head, tail = values[:steps], values[-steps:]
            out[key] = (sum(head) / len(head), sum(tail) / len(tail))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a robustir noise-bench output folder")
    parser.add_argument("--steps", type=int, default=5, help="logged steps averaged at the start and at the end")
    args = parser.parse_args(argv)
    logs = sorted((args.folder / "runs").glob("*/*/train/train_log.jsonl"))
    if not logs:
        raise SystemExit(f"no runs/<condition>/<method>/train/train_log.jsonl under {args.folder}")
    print(f"| condition | method | " + " | ".join(f"{k} first→last" for k in KEYS) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    for log in logs:
        condition, method = log.parts[-4], log.parts[-3]
        stats = summarize(log, args.steps)
        cells = [f"{stats[k][0]:.3f}→{stats[k][1]:.3f}" if k in stats else "" for k in KEYS]
        print(f"| {condition} | {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
