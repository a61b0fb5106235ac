"""How well ``robustir audit`` measures planted noise: estimated false-positive rate against the planted one,
precision / recall of its flags, over kinds, rates and seeds (issue 25; figures in docs/audit.md).

The noisy files are the noise benchmark's own (``robustir.robustness.bench``: SciFact train, BM25 pools of 10,
``plant_noise``), so the audit is scored on exactly the data the training benchmark measured. Each audit runs with
``--corpus`` and ``--eval-data`` set to the same BEIR folder (the test qrels are the clean reference), corpus
embeddings cached.

    python bench/audit.py --data ../shared/data/scifact --kinds fp-random fp-hard --rates 0 0.2 0.4 --seeds 1 2 3
    python bench/audit.py --kinds label-fn dup-fn chunk-fn --rates 0.2 0.4 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def planted(folder: Path) -> tuple[dict[int, str], dict[str, dict], int]:
    """line -> query id of the noisy file, query id -> its plant, and the number of pairs."""
    lines, pairs = {}, 0
    with open(folder / "noisy.jsonl", encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            obj = json.loads(raw)
            lines[number] = str(obj.get("query_id"))
            pairs += len(obj["pos"])
    plants = {}
    with open(folder / "plants.jsonl", encoding="utf-8") as handle:
        for raw in handle:
            plant = json.loads(raw)
            plants[plant["query_id"]] = plant
    return lines, plants, pairs


def score(audit_dir: Path, folder: Path) -> dict:
    lines, plants, pairs = planted(folder)
    report = json.loads((audit_dir / "report.json").read_text())
    fp_pairs = sum(len(p["false_positives"]) for p in plants.values())
    fn_planted = {(qid, text) for qid, p in plants.items() for text in p["false_negatives"]}
    fp_flags, fn_flags = set(), set()
    with open(audit_dir / "flagged.jsonl", encoding="utf-8") as handle:
        for raw in handle:
            item = json.loads(raw)
            if item["kind"] == "false_positive":
                fp_flags.add(lines[item["line"]])
            elif item["kind"] == "false_negative":
                fn_flags.add((lines[item["line"]], item["text"]))
    fp_truth = {qid for qid, p in plants.items() if p["false_positives"]}
    est = report["false_positives"]["estimate"]
    near = report["false_positives"].get("near_miss") or {}

    def pr(flags: set, truth: set) -> tuple[float | None, float | None]:
        hit = len(flags & truth)
        return (hit / len(flags) if flags else None), (hit / len(truth) if truth else None)

    fp_p, fp_r = pr(fp_flags, fp_truth)
    fn_p, fn_r = pr(fn_flags, fn_planted)
    return {"planted_pair_rate": fp_pairs / pairs, "planted_query_rate": len(fp_truth) / len(lines),
            "estimate": est["rate"], "low": est["low"], "high": est["high"], "random_like": est["random_like"],
            "hard_like": est["hard_like"], "near_miss": near.get("rate"), "near_miss_low": near.get("low"),
            "near_miss_high": near.get("high"), "near_miss_hard_like": near.get("hard_like"),
            "fp_flagged": len(fp_flags), "fp_precision": fp_p, "fp_recall": fp_r,
            "fn_flagged": len(fn_flags), "fn_planted": len(fn_planted), "fn_precision": fn_p, "fn_recall": fn_r,
            "recommendation": report["recommendation"]["loss"], "elapsed_s": report.get("elapsed_s")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"))
    parser.add_argument("--kinds", nargs="+", default=["fp-random", "fp-hard"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.2, 0.4])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--mining", choices=["bm25", "dense"], default="bm25",
                        help="how the clean pools are mined (dense: fp-hard plants dense near-miss positives)")
    parser.add_argument("--work", default="runs/audit-bench")
    parser.add_argument("--out", default="docs/results/audit_bench.jsonl")
    args = parser.parse_args()
    from robustir.audit import AuditConfig, audit
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path
    from robustir.robustness.bench import NoiseBenchConfig, _Bench

    bench = _Bench(NoiseBenchConfig(data=args.data, output=args.work, preset="cpu", mining=args.mining))
    teacher = Encoder.from_pretrained(default_model_path())
    rows = []
    for kind in args.kinds:
        for rate in args.rates:
            for seed in args.seeds:
                folder = bench.noisy(kind, rate, seed).parent
                out = Path(args.work) / "audits" / folder.name
                started = time.monotonic()
                audit(AuditConfig(data=str(folder / "noisy.jsonl"), output=str(out), corpus=args.data,
                                  eval_data=args.data, cache_dir=str(Path(args.work) / "cache"), progress=False,
                                  seed=seed), encoder=teacher)
                row = {"kind": kind, "mining": args.mining, "rate": rate, "seed": seed, **score(out, folder),
                       "wall_s": round(time.monotonic() - started, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
