"""Can a model tell a labelled positive from its nearest non-relevant passage? (issue 50)

A near-miss label is a positive replaced by a passage close to the right one. Every rule that reads a model to find
or fix such labels -- the audit's estimate, the teacher's ``suspect_positive`` removal, a label correction that lets a
confident top candidate replace the given positive -- needs the model to prefer the true positive over the near
miss. This script measures that preference on clean mined data: per query, ``d = max cos(q, positive) - cos(q, top
non-relevant passage of the pool)``. On clean data a correction rule with margin ``m`` fires where ``d < -m`` (it
*corrupts* a right label); on swapped data (``fp-swap``: the near miss stands as the positive, the true one is the
top negative) it fires where ``d > m`` (it fixes the label). The printed table gives both shares and, for a noise
rate, how many labels such a rule would fix and break.

    python bench/near_miss_separability.py --mined runs/nb-dense/data/mined.jsonl \
        --model start=<bundled> --model clean=runs/nb-dense/runs/clean-s1/infonce/train/model \
        --exclude runs/nb-dense/runs/clean-s1/infonce/rows.jsonl

``--exclude``: leave out the queries of a training rows file (an out-of-fold reading for a model trained on them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def load(mined: Path, exclude: list[Path]) -> list[dict]:
    skip: set[str] = set()
    for path in exclude:
        with open(path, encoding="utf-8") as handle:
            skip |= {json.loads(line)["query"] for line in handle if line.strip()}
    rows = []
    with open(mined, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record["query"] in skip or not record.get("pos") or not record.get("neg"):
                continue
            positives = set(record["pos"])
            near = next((text for text in record["neg"] if text not in positives), None)  # pools come ranked
            if near is not None:
                rows.append({"query": record["query"], "pos": record["pos"], "near": near})
    return rows


def gaps(model: str, rows: list[dict], batch_size: int) -> np.ndarray:
    from robustir.models.encoder import Encoder, resolve_model_path
    from robustir.resources import default_model_path

    encoder = Encoder.from_pretrained(str(resolve_model_path(model or default_model_path())))
    passages = sorted({text for row in rows for text in row["pos"] + [row["near"]]})
    where = {text: i for i, text in enumerate(passages)}
    q = encoder.encode([row["query"] for row in rows], "query", batch_size=batch_size, precision="auto")
    p = encoder.encode(passages, "passage", batch_size=batch_size, precision="auto")
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    out = np.empty(len(rows))
    for i, row in enumerate(rows):
        best = max(float(q[i] @ p[where[text]]) for text in row["pos"])
        out[i] = best - float(q[i] @ p[where[row["near"]]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mined", type=Path, required=True, help="clean mined JSONL with ranked pools")
    parser.add_argument("--model", action="append", default=[], help="NAME=FOLDER ('NAME=' = the bundled model)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="training rows whose queries to skip")
    parser.add_argument("--rate", type=float, default=0.4, help="share of swapped labels for the fixed/broken columns")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    rows = load(args.mined, args.exclude)
    print(f"{len(rows)} queries from {args.mined}" + (f", excluding {len(args.exclude)} rows file(s)" if args.exclude else ""))
    print()
    print("| model | margin m | model right by > m (fixes a swapped label) | model wrong by > m (breaks a clean one) "
          f"| at {args.rate:.0%} swapped: labels fixed | labels broken |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec in args.model or ["start="]:
        name, _, folder = spec.partition("=")
        d = gaps(folder, rows, args.batch_size)
        for m in (0.0, 0.02, 0.05, 0.1):
            right, wrong = float((d > m).mean()), float((d < -m).mean())
            print(f"| {name} | {m:.2f} | {right:.3f} | {wrong:.3f} | {args.rate * right:.3f} | "
                  f"{(1 - args.rate) * wrong:.3f} |")
        print(f"| {name} | median d | {np.median(d):+.3f} | | | |")


if __name__ == "__main__":
    main()
