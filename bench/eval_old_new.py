"""``robustir eval`` wall time with the input path before issue 54 (commit d3f3afd) and with this tree's.

The old tree is ``git archive``d into a temporary folder and each side runs as its own ``python -m robustir.cli.main
eval`` process (model loading, encoding, search: the whole command), in alternated rounds (old, new, new, old, ...
so neither side always goes first). Prints each side's median and range, the median of the per-round ratios
new/old (> 1: the new path is slower) and whether both wrote the same metrics.

    python bench/eval_old_new.py --data BEIR_FOLDER [--rounds 3] [--subset QUERIES PASSAGES] [-- extra eval args]

``--subset 50 600``: evaluate on a seeded subset (seed 0) of the test split instead -- that many test queries, their
relevant passages plus random others up to that many passages -- for a shared machine where a full run is long.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_eval(src: Path, data: str, output: Path, extra: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "robustir.cli.main", "eval", "--data", data, "--output", str(output),
                    "--no-show-progress", *extra], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def make_subset(data: Path, queries: int, passages: int, out: Path) -> Path:
    """A BEIR folder with ``queries`` seeded test queries and ``passages`` passages (their relevant ones first)."""
    import random

    rows = [line.split("\t") for line in (data / "qrels" / "test.tsv").read_text().splitlines()]
    header, rows = rows[0], rows[1:]
    rng = random.Random(0)
    keep = set(rng.sample(sorted({r[0] for r in rows}), queries))
    relevant = {r[1] for r in rows if r[0] in keep}
    docs = [json.loads(line) for line in (data / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    others = [d for d in docs if d["_id"] not in relevant]
    rng.shuffle(others)
    chosen = [d for d in docs if d["_id"] in relevant] + others[:max(0, passages - len(relevant))]
    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in chosen), encoding="utf-8")
    (out / "queries.jsonl").write_text("".join(line + "\n" for line in (data / "queries.jsonl").read_text(
        encoding="utf-8").splitlines() if json.loads(line)["_id"] in keep), encoding="utf-8")
    kept = [header] + [r for r in rows if r[0] in keep]
    (out / "qrels" / "test.tsv").write_text("".join("\t".join(r) + "\n" for r in kept))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-commit", default="d3f3afd")
    parser.add_argument("--subset", type=int, nargs=2, metavar=("QUERIES", "PASSAGES"))
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.subset:
            args.data = str(make_subset(Path(args.data), *args.subset, Path(tmp) / "subset"))
        old_src = Path(tmp) / "old"
        old_src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.old_commit, "src"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_src)], input=archive, check=True)
        sides = {"old": old_src / "src", "new": REPO / "src"}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[name].append(run_eval(sides[name], args.data, Path(tmp) / f"{name}-{r}", extra))
                print(f"round {r} {name}: {times[name][-1]:.1f} s", flush=True)
        metrics = {name: json.loads((Path(tmp) / f"{name}-0" / "metrics.json").read_text()) for name in sides}
    ratios = [n / o for n, o in zip(times["new"], times["old"])]
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.1f} s, range {min(values):.1f} - {max(values):.1f} s")
    print(f"new/old wall time: median {statistics.median(ratios):.3f}, range {min(ratios):.3f} - {max(ratios):.3f} "
          f"({args.rounds} alternated rounds); same metrics: {metrics['old'] == metrics['new']}")


if __name__ == "__main__":
    main()
