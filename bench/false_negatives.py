"""False-negative detection with a known answer: inject false negatives into BM25 negatives, see who finds them.

On SciFact train (``../shared/data/scifact``): every query gets its BM25-mined negatives (positives excluded)
plus injected *known* false negatives at random positions:

* ``other_positive``: when a query has several relevant abstracts, the first stays the positive and the others
  are put among the negatives;
* ``near_duplicate``: a lightly perturbed copy of the positive (about 10% of the words dropped, two adjacent
  words swapped, the title dropped) -- the kind of duplicate a crawled corpus holds.

Each removal method then runs on that file, and precision / recall of "removed" against "injected" is printed
(``removed`` = the method's false-negative verdicts: ``teacher_*``, ``sieve``, ``llm_judge``; not
``over_limit`` / ``beyond_pool``, which only trim list length -- the sieve's pool is made to cover every list).

Methods: teacher margin with the bundled MiniLM (relative 0.05, and absolute 0.1), passage sieve without
training and after a brief CCR training (``--sieve-steps``), the LLM judge only with ``--base-url``.

    python bench/false_negatives.py --cache-dir runs/cache --bf16
    python bench/false_negatives.py --max-queries 300 --sieve-steps 40 --base-url http://localhost:8000/v1 --llm-model M
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "scifact"


def perturb(text: str, rng: random.Random) -> str:
    words = text.split()
    kept = [w for w in words if rng.random() > 0.1] or words
    if len(kept) > 3:
        i = rng.randrange(len(kept) - 1)
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return " ".join(kept)


class CachedEncoder:
    """An Encoder whose passage embeddings of the corpus come from ``encode_corpus`` (cached on disk)."""

    def __init__(self, encoder, corpus_texts: list[str], cache_dir: str | None, bf16: bool, batch_size: int) -> None:
        self.encoder = encoder
        self.bf16 = bf16
        self.batch_size = batch_size
        emb = encoder.encode_corpus(corpus_texts, cache_dir=cache_dir, batch_size=batch_size, bf16=bf16,
                                    show_progress=False)
        self.cache = {t: emb[i] for i, t in enumerate(corpus_texts)}

    def encode(self, texts, kind="passage", **kwargs):
        if kind != "passage":
            return self.encoder.encode(list(texts), kind, batch_size=self.batch_size, bf16=self.bf16)
        missing = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if missing:
            for t, e in zip(missing, self.encoder.encode(missing, "passage", batch_size=self.batch_size,
                                                         bf16=self.bf16)):
                self.cache[t] = e
        return np.stack([self.cache[t] for t in texts]) if texts else np.zeros((0, self.encoder.dim), np.float32)


def build_noisy_file(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, dict[str, str]], list[str]]:
    """Training JSONL with injected false negatives; returns (path, {record key: {text: kind}}, corpus texts)."""
    from robustir.data.beir import load_beir
    from robustir.negatives.mining import MiningConfig, mine_negatives, queries_from_beir

    dataset = load_beir(args.data, "train")
    texts = dataset.corpus.texts_for_encoding()
    by_id = dict(zip(dataset.corpus.ids, texts))
    raw_text = dict(zip(dataset.corpus.ids, dataset.corpus.texts))
    queries = queries_from_beir(dataset)
    rng = random.Random(args.seed)
    if args.max_queries:
        multi = [q for q in queries if len(q.positive_ids) > 1]
        single = [q for q in queries if len(q.positive_ids) == 1]
        rng.shuffle(single)
        queries = multi + single[: max(0, args.max_queries - len(multi))]  # keep every multi-positive query
    mined_path = work / "bm25.jsonl"
    if not mined_path.exists():
        # mine as if the first positive were the only one, so the other positives can come back as negatives too
        from robustir.negatives.mining import MiningQuery

        single_pos = [MiningQuery(q.query_id, q.text, [q.positive_ids[0]]) for q in queries]
        mine_negatives(single_pos, dataset.corpus.ids, texts, mined_path,
                       MiningConfig(num_negatives=args.num_negatives, range_max=50), show_progress=False)
    truth: dict[str, dict[str, str]] = {}
    noisy = work / "noisy.jsonl"
    positives_of = {q.query_id: q.positive_ids for q in queries}
    with open(noisy, "w", encoding="utf-8") as out, open(mined_path, encoding="utf-8") as src:
        for line in src:
            record = json.loads(line)
            qid = record["query_id"]
            pos_ids = positives_of[qid]
            negs = [n for n, i in zip(record["neg"], record["neg_ids"]) if i not in pos_ids]
            injected = {by_id[p]: "other_positive" for p in pos_ids[1:]}
            if rng.random() < args.duplicate_share:
                injected[perturb(raw_text[pos_ids[0]], rng)] = "near_duplicate"
            for text in injected:
                negs.insert(rng.randrange(len(negs) + 1), text)
            truth[qid] = injected
            out.write(json.dumps({"query": record["query"], "pos": [by_id[pos_ids[0]]], "neg": negs,
                                  "query_id": qid}) + "\n")
    return noisy, truth, texts


FN_REASONS = {"teacher_relative_margin", "teacher_absolute_margin", "sieve", "llm_judge", "equals_positive"}


def score(output: Path, truth: dict[str, dict[str, str]]) -> dict:
    tp = fp = 0
    found = {"other_positive": 0, "near_duplicate": 0}
    total = {"other_positive": 0, "near_duplicate": 0}
    for line in open(output, encoding="utf-8"):
        record = json.loads(line)
        injected = truth[record["query_id"]]
        for kind in injected.values():
            total[kind] += 1
        for removed in record.get("removed", []):
            if removed["reason"] not in FN_REASONS:
                continue
            if removed["text"] in injected:
                tp += 1
                found[injected[removed["text"]]] += 1
            else:
                fp += 1
    injected_total = sum(total.values())
    return {"removed": tp + fp, "true_positives": tp, "precision": tp / max(tp + fp, 1),
            "recall": tp / max(injected_total, 1),
            "recall_other_positive": found["other_positive"] / max(total["other_positive"], 1),
            "recall_near_duplicate": found["near_duplicate"] / max(total["near_duplicate"], 1),
            "injected": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--work", default="runs/bench-false-negatives")
    parser.add_argument("--cache-dir", default="runs/cache")
    parser.add_argument("--max-queries", type=int, default=0, help="0 = all train queries")
    parser.add_argument("--num-negatives", type=int, default=10, help="BM25 negatives per query")
    parser.add_argument("--duplicate-share", type=float, default=0.5, help="queries that get a near-duplicate")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--sieve-steps", type=int, default=40)
    parser.add_argument("--sieve-lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint for the LLM judge (skipped without)")
    parser.add_argument("--llm-model", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, force=True)

    from robustir.filtering.sieve import SieveConfig, sieve_negatives, train_sieve_model
    from robustir.filtering.teacher import EmbeddingTeacher, TeacherFilterConfig, teacher_filter
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    noisy, truth, corpus_texts = build_noisy_file(args, work)
    n_records = len(truth)
    lengths = [len(json.loads(line)["neg"]) for line in open(noisy, encoding="utf-8")]
    wanted = (max(lengths) + 1) // 2  # pool = 2 x wanted covers every list
    encoder = Encoder.from_pretrained(default_model_path(), query_max_length=64, passage_max_length=args.max_length)
    base = CachedEncoder(encoder, corpus_texts, args.cache_dir, args.bf16, 64)
    rows = []

    def record(name: str, output: Path, seconds: float) -> None:
        rows.append({"method": name, "seconds": round(seconds, 1), **score(output, truth)})

    for name, cfg in [("teacher MiniLM, relative 0.05", TeacherFilterConfig(relative_margin=0.05)),
                      ("teacher MiniLM, absolute 0.1", TeacherFilterConfig(relative_margin=None, absolute_margin=0.1))]:
        out = work / f"{name.split(',')[1].strip().replace(' ', '-')}.jsonl"
        cfg.overwrite, cfg.progress, cfg.batch_size = True, False, 64
        start = time.perf_counter()
        teacher_filter(noisy, out, cfg, teacher=EmbeddingTeacher(base, batch_size=64, precision="bf16" if args.bf16 else "fp32"))
        record(name, out, time.perf_counter() - start)

    sieve_common = dict(num_negatives=wanted, overwrite=True, progress=False, precision="bf16" if args.bf16 else "fp32",
                        passage_max_length=args.max_length, query_max_length=64)
    start = time.perf_counter()
    sieve_negatives(noisy, work / "sieve-untrained.jsonl", SieveConfig(train=False, **sieve_common), encoder=base)
    record("sieve, no training (MiniLM)", work / "sieve-untrained.jsonl", time.perf_counter() - start)

    start = time.perf_counter()
    config = SieveConfig(train=True, max_steps=args.sieve_steps, lr=args.sieve_lr, train_batch_size=16,
                         train_negatives=3, work_dir=str(work / f"sieve-work-{args.sieve_steps}-{args.sieve_lr}"),
                         **sieve_common)
    model_path, training = train_sieve_model(noisy, config, Path(config.work_dir))
    trained = Encoder.from_pretrained(model_path, query_max_length=64, passage_max_length=args.max_length)
    # only the file's texts are encoded with the briefly trained model (no point caching the whole corpus)
    sieve_negatives(noisy, work / "sieve-trained.jsonl", config, encoder=trained)
    record(f"sieve, CCR {training['steps']} steps lr {args.sieve_lr}", work / "sieve-trained.jsonl",
           time.perf_counter() - start)

    if args.base_url:
        from robustir.llm import LLMClient, LLMConfig
        from robustir.filtering.llm_judge import judge_negatives

        start = time.perf_counter()
        with LLMClient(LLMConfig(base_url=args.base_url, model=args.llm_model, temperature=0.0, max_tokens=16)) as c:
            judge_negatives(noisy, work / "llm.jsonl", c, overwrite=True, progress=False)
        record(f"LLM judge ({args.llm_model})", work / "llm.jsonl", time.perf_counter() - start)

    injected = rows[0]["injected"]
    print(f"SciFact train: {n_records} queries, {sum(lengths)} negatives of which {sum(injected.values())} injected "
          f"false negatives ({injected['other_positive']} other positives, {injected['near_duplicate']} near-duplicates)")
    print(f"{'method':36s} {'removed':>7s} {'precision':>9s} {'recall':>7s} {'R other-pos':>11s} {'R near-dup':>10s} {'sec':>6s}")
    for row in rows:
        print(f"{row['method']:36s} {row['removed']:7d} {row['precision']:9.3f} {row['recall']:7.3f} "
              f"{row['recall_other_positive']:11.3f} {row['recall_near_duplicate']:10.3f} {row['seconds']:6.1f}")
    (work / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
