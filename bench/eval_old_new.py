"""``robustir eval`` wall time with the input path before issue 54 (commit d3f3afd) and with this tree's.

The old tree is ``git archive``d into a temporary folder and each side runs as its own ``python -m robustir.cli.main
eval`` process (model loading, encoding, search: the whole command), in alternated rounds (old, new, new, old, ...
so neither side always goes first). Prints each side's median and range, the median of the per-round ratios
new/old (> 1: the new path is slower) and whether both wrote the same metrics.

    python bench/eval_old_new.py --data BEIR_FOLDER [--rounds 3] [--old-commit d3f3afd] [-- extra eval args]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-commit", default="d3f3afd")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
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
