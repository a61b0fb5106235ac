"""robustir vs sentence-transformers, side by side on the same rows, steps and settings.

    python bench/vs_st.py --preset cpu                     # SciFact, 3 seeds a side (~30-40 min on 2 cores)
    python bench/vs_st.py --preset gpu --seeds 1 2 3       # the H100 settings of issue 9
    python bench/vs_st.py --preset cpu --robustir-loss peg # another robustir loss, its defaults
    python bench/vs_st.py --preset gpu --robustir-mining dense --robustir-set num_negatives=7   # issue 38 goal 2
    python bench/vs_st.py --preset gpu --dev 200 --robustir-base-weight 0.1 0.3   # + WiSE-FT copies, scored too

--robustir-mining / --robustir-set leave the fixed rows on purpose (issue 38's goal 2: robustir's own recipe
against ST's, each side's train seconds reported): the robustir side then trains on rows drawn from negatives it
mined itself with the base model (dense, top 100, positive-aware margin: a candidate scoring above 95 % of the
positive is dropped, NV-Retriever's TopK-PercPos) and with its own budget fields (more negatives, a larger batch).

Both sides train the bundled all-MiniLM-L6-v2 (or --model) on identical rows built once per seed from the
BEIR train split's BM25-mined negatives (robustir.robustness.sidebyside.materialize_rows): every
(query, positive) pair once per epoch with k negatives drawn from its pool. sentence-transformers runs
its own SentenceTransformerTrainer with MultipleNegativesRankingLoss and the NO_DUPLICATES batch sampler;
robustir runs `robustir train` with no loss options beyond --robustir-options. Same optimizer steps, batch,
lr schedule, weight decay, gradient clipping, lengths, precision and seed; the same evaluation code scores
both. Finished runs are kept in <output>/results.jsonl and never redone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from robustir.data.training_data import load_training_data
    from robustir.models.interpolate import interpolate_folder
    from robustir.resources import default_model_path
    from robustir.negatives.mining import MiningConfig, mine_beir
    from robustir.robustness.sidebyside import (PRESETS, evaluate_model, materialize_rows, train_robustir,
                                                train_sentence_transformers, write_rows)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--data", default="../shared/data/scifact", help="BEIR folder with train and test splits")
    parser.add_argument("--split", default="test", help="evaluation split")
    parser.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--output", default="runs/vs_st")
    parser.add_argument("--robustir-loss", default="infonce")
    parser.add_argument("--robustir-options", default="{}", help="JSON loss options for robustir (default: none)")
    parser.add_argument("--sides", nargs="+", default=["st", "robustir"], choices=["st", "robustir"])
    parser.add_argument("--dev", type=int, default=0, metavar="N",
                        help="choose defaults on a dev split: hold out N train queries (seeded), train on the rest, "
                             "evaluate on them instead of --split")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override budget fields, e.g. epochs=1")
    parser.add_argument("--robustir-mining", choices=["bm25", "dense"], default="bm25",
                        help="dense: the robustir side trains on rows from its own dense, positive-aware mining")
    parser.add_argument("--robustir-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="budget fields for the robustir side only (its recipe), e.g. num_negatives=7")
    parser.add_argument("--robustir-chunk-size", type=int, default=None, metavar="N",
                        help="GradCache for the robustir side: N rows per forward chunk (the same loss, less memory: "
                             "a larger --robustir-set batch_size on the card)")
    parser.add_argument("--robustir-memory", type=int, default=0, metavar="N",
                        help="cross-batch memory for the robustir side: the last N passages as extra negatives "
                             "(train's memory_size; the same rows and steps)")
    parser.add_argument("--robustir-base-weight", type=float, nargs="*", default=[], metavar="W",
                        help="also score each robustir model moved back toward the base model by W (WiSE-FT, "
                             "robustir.models.interpolate; what train's base_weight saves), a row each")
    args = parser.parse_args(argv)

    def with_overrides(budget, items):
        for item in items:
            key, _, value = item.partition("=")
            budget = replace(budget, **{key: type(getattr(budget, key))(json.loads(value))})
        budget.validate()
        return budget

    budget = with_overrides(PRESETS[args.preset], args.set)
    ours_budget = with_overrides(budget, args.robustir_set)
    recipe = {"mining": args.robustir_mining, **dict(item.partition("=")[::2] for item in args.robustir_set)} \
        if args.robustir_mining != "bm25" or args.robustir_set else {}
    options = json.loads(args.robustir_options)
    out = Path(args.output) / (args.preset + (f"-dev{args.dev}" if args.dev else ""))
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[(row["side"], row["seed"], row["tag"])] = row
    tag = json.dumps({"loss": args.robustir_loss, **options, **({"recipe": recipe} if recipe else {}),
                      **({"memory_size": args.robustir_memory} if args.robustir_memory else {})}, sort_keys=True)

    mined = out / "mined-bm25.jsonl"
    if not mined.exists():
        mine_beir(args.data, "train", mined, MiningConfig(method="bm25", num_negatives=budget.pool))
    examples, _ = load_training_data(mined)
    ours_examples = examples
    if args.robustir_mining == "dense":  # the robustir recipe's own negatives: dense, positive-aware (95 %)
        mined_dense = out / "mined-dense.jsonl"
        if not mined_dense.exists():
            from robustir.models.encoder import Encoder

            mine_beir(args.data, "train", mined_dense,
                      MiningConfig(method="dense", num_negatives=ours_budget.pool, range_max=100, relative_margin=0.05),
                      encoder=Encoder.from_pretrained(args.model or default_model_path(), device="auto",
                                                     passage_max_length=budget.passage_max_length))
        ours_examples, _ = load_training_data(mined_dense)
    cache: dict = {}
    evaluation = args.data
    if args.dev:
        from robustir.robustness.sidebyside import dev_split

        evaluation, dev_ids = dev_split(args.data, "train", args.dev)
        examples = [e for e in examples if e.extra.get("query_id") not in dev_ids]
        ours_examples = [e for e in ours_examples if e.extra.get("query_id") not in dev_ids]
        print(f"dev split: {len(dev_ids)} held-out train queries; training on {len(examples)}")
    for seed in args.seeds:
        rows_path = out / f"rows-seed{seed}.jsonl"
        if not rows_path.exists():
            write_rows(materialize_rows(examples, budget.num_negatives, budget.epochs, seed), rows_path)
        ours_rows = rows_path
        if recipe:
            digest = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
            ours_rows = out / f"rows-{digest}-seed{seed}.jsonl"
            if not ours_rows.exists():
                write_rows(materialize_rows(ours_examples, ours_budget.num_negatives, ours_budget.epochs, seed),
                           ours_rows)
        for side in args.sides:
            key = (side, seed, tag if side == "robustir" else "st")
            if key in done:
                continue
            started = time.perf_counter()
            if side == "st":
                outcome = train_sentence_transformers(rows_path, out / f"st-seed{seed}", budget, seed, model=args.model)
            else:
                digest = hashlib.sha1(tag.encode()).hexdigest()[:8]  # stable across processes (resume)
                name = f"robustir-{args.robustir_loss}-{digest}-seed{seed}"
                outcome = train_robustir(ours_rows, out / name, ours_budget, seed, model=args.model,
                                         loss=args.robustir_loss, loss_options=options,
                                         chunk_size=args.robustir_chunk_size, memory_size=args.robustir_memory)
            metrics = evaluate_model(outcome.model_path, evaluation, args.split, budget, cache)
            side_rows, side_budget = (ours_rows, ours_budget) if side == "robustir" else (rows_path, budget)
            row = {"side": side, "seed": seed, "tag": key[2], "steps": outcome.steps,
                   "rows": sum(1 for _ in open(side_rows)), "train_seconds": round(outcome.seconds, 1),
                   "seconds": round(time.perf_counter() - started, 1), "metrics": metrics,
                   "budget": asdict(side_budget)}
            if side == "robustir" and args.robustir_chunk_size:
                row["chunk_size"] = args.robustir_chunk_size  # GradCache: rows per forward chunk
            with open(results_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            done[key] = row
            print(f"{side} seed {seed}: ndcg@10 {100 * metrics['ndcg@10']:.2f} ({outcome.steps} steps, "
                  f"{row['seconds']:.0f} s)", flush=True)
        for weight in args.robustir_base_weight if "robustir" in args.sides else ():
            # the same trained model moved back toward the base (WiSE-FT): no training, a row of its own
            key = ("robustir", seed, json.dumps({**json.loads(tag), "base_weight": weight}, sort_keys=True))
            if key in done:
                continue
            trained = done[("robustir", seed, tag)]
            name = f"robustir-{args.robustir_loss}-{hashlib.sha1(tag.encode()).hexdigest()[:8]}-seed{seed}"
            merged = interpolate_folder(out / name / "model", args.model or default_model_path(), weight,
                                        out / name / f"base-{weight:g}")
            metrics = evaluate_model(merged, evaluation, args.split, budget, cache)
            row = {**trained, "tag": key[2], "metrics": metrics, "base_weight": weight}
            with open(results_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            done[key] = row
            print(f"robustir seed {seed} base_weight {weight:g}: ndcg@10 {100 * metrics['ndcg@10']:.2f}", flush=True)

    def scores(side_key: str) -> list[float]:
        return [100 * r["metrics"]["ndcg@10"] for (s, seed, t), r in done.items()
                if seed in args.seeds and (s, t) == (side_key, "st" if side_key == "st" else tag)]

    st, ours = scores("st"), scores("robustir")
    print(f"\npreset {args.preset}: {asdict(budget)}")
    merged = [(f"robustir base_weight {w:g}", [100 * r["metrics"]["ndcg@10"] for (s, seed, t), r in done.items()
                                              if s == "robustir" and seed in args.seeds and r.get("base_weight") == w
                                              and t == json.dumps({**json.loads(tag), "base_weight": w}, sort_keys=True)])
              for w in args.robustir_base_weight]
    for name, values in (("sentence-transformers MNRL", st), (f"robustir {tag}", ours), *merged):
        if values:
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{name:55s} NDCG@10 {statistics.mean(values):.2f} ± {std:.2f}  ({', '.join(f'{v:.2f}' for v in values)})")
    if st and ours:
        print(f"difference robustir - ST: {statistics.mean(ours) - statistics.mean(st):+.2f} NDCG@10")
    return 0


if __name__ == "__main__":
    sys.exit(main())
