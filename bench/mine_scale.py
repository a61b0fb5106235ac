"""Hard-negative mining against corpus size: peak memory and queries/s, 10k to 1M passages.

Corpora are built from the shared BEIR corpora (``../shared/data/*/corpus.jsonl``, 53k passages in all): every
passage once, then again with `` r<k>`` appended (repetition k), until the size is reached -- so the vocabulary
barely grows with size (a real 1M corpus has a larger one: more BM25 memory). The positives of the 1,000 fixed
queries (drawn, seeded, from the shared datasets' qrels) come first, so every size holds them. Each (mode, size)
runs in its own process; its peak RSS (``VmHWM``) is split into the peak while loading and building the index or
encoding the corpus, and the peak while mining the queries (``VmHWM`` reset after the build); ``after imports`` is
its RSS before anything is read.

Modes (every one mines the same 1,000 queries: top 15 of 100, BM25 or dense, written to a JSONL):

* ``bm25``         -- ``mine_beir``: corpus read from disk on demand, BM25 index built a chunk of texts at a time;
* ``bm25-lists``   -- the previous in-memory path: corpus loaded as Python lists, BM25 tokenized whole (lists of
  token ids per document), ``mine_negatives``;
* ``dense-memory`` -- ``mine_beir``, dense, no ``corpus_chunk``: the embeddings loaded whole + a flat FAISS index;
* ``dense-chunked``-- ``mine_beir``, dense, ``corpus_chunk`` rows searched at a time from the embeddings file.

Dense uses a stand-in encoder, not a model: each block of texts gets 384-d unit vectors from a generator seeded by
the CRC32 of its texts (MiniLM's width; encoding a million passages with MiniLM takes about an hour on this
2-core box). So the figures are the search side and the pipeline around it (encode-to-file, chunked search,
reading hits back from the corpus file), not model encoding, which is per passage and independent of corpus size.

    python bench/mine_scale.py                                   # 10k, 100k, 1M; every mode
    python bench/mine_scale.py --sizes 10000,100000 --modes bm25,dense-chunked --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
MODES = ("bm25", "bm25-lists", "dense-memory", "dense-chunked")
DIM = 384


def status_mb(field: str = "VmRSS") -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak since start or since :func:`reset_peak`) in MB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    """Restart ``VmHWM`` from the current RSS (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


# --------------------------------------------------------------------------------------------- corpora

def base_data(n_queries: int, seed: int) -> tuple[list[dict], list[tuple[str, str, list[str]]]]:
    """Every shared passage (ids ``<dataset>/<id>``) and ``n_queries`` judged queries, positives first."""
    sys.path.insert(0, str(REPO / "src"))
    from robustir.data.beir import available_splits, load_beir

    docs: list[dict] = []
    queries: list[tuple[str, str, list[str]]] = []
    for folder in sorted(p for p in SHARED.iterdir() if (p / "corpus.jsonl").exists()):
        splits = available_splits(folder)
        if not splits:
            continue
        dataset = load_beir(folder, "test" if "test" in splits else splits[0], unknown_ids="skip")
        name = folder.name
        docs += [{"_id": f"{name}/{i}", "title": t, "text": x}
                 for i, t, x in zip(dataset.corpus.ids, dataset.corpus.titles, dataset.corpus.texts)]
        queries += [(f"{name}/{qid}", dataset.queries[qid], [f"{name}/{d}" for d, g in judged.items() if g > 0])
                    for qid, judged in dataset.qrels.items()]
    random.Random(seed).shuffle(queries)
    queries = queries[:n_queries]
    positives = {d for _, _, pos in queries for d in pos}
    docs.sort(key=lambda doc: doc["_id"] not in positives)  # stable: positives first, then file order
    return docs, queries


def build_folder(root: Path, size: int, n_queries: int, seed: int) -> Path:
    folder = root / f"corpus-{size}"
    if (folder / "qrels" / "train.tsv").exists():
        return folder
    docs, queries = base_data(n_queries, seed)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as handle:
        written = repetition = 0
        while written < size:
            for doc in docs[: size - written]:
                if repetition:
                    doc = {"_id": f"{doc['_id']}#r{repetition}", "title": doc["title"],
                           "text": f"{doc['text']} r{repetition}"}
                handle.write(json.dumps(doc, ensure_ascii=False) + "\n")
            written = min(size, written + len(docs))
            repetition += 1
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as handle:
        for qid, text, _ in queries:
            handle.write(json.dumps({"_id": qid, "text": text}, ensure_ascii=False) + "\n")
    with open(folder / "qrels" / "train.tsv.tmp", "w", encoding="utf-8") as handle:
        handle.write("query-id\tcorpus-id\tscore\n")
        for qid, _, positives in queries:
            handle.writelines(f"{qid}\t{d}\t1\n" for d in positives)
    os.replace(folder / "qrels" / "train.tsv.tmp", folder / "qrels" / "train.tsv")
    return folder


# --------------------------------------------------------------------------------------------- one run

class HashEncoder:
    """Stand-in for a model: 384-d unit vectors from a generator seeded by the CRC32 of the block's texts."""

    def to(self, device):
        return self

    def encode(self, texts, kind="passage", **kwargs):
        import numpy as np

        rng = np.random.default_rng([zlib.crc32(t.encode("utf-8", "surrogatepass")) for t in texts] or [0])
        vectors = rng.standard_normal((len(texts), DIM), dtype=np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def run_side(args: argparse.Namespace) -> dict:
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    from robustir.data.beir import load_beir
    from robustir.index.bm25 import BM25Index
    from robustir.negatives import mining
    from robustir.negatives.mining import MiningConfig, mine_beir, mine_negatives, queries_from_beir

    folder = Path(args.folder)
    output = Path(args.work) / f"{args.side}-{args.size}.jsonl"
    for stale in output.parent.glob(output.name + "*"):
        stale.unlink()
    dense = args.side.startswith("dense")
    config = MiningConfig(method="dense" if dense else "bm25", num_negatives=15, range_max=100, device="cpu",
                          corpus_chunk=args.chunk if args.side == "dense-chunked" else None)
    timings: dict[str, float] = {}
    build = mining._Retriever.__init__

    def timed_build(self, *a, **k):
        started = time.perf_counter()
        build(self, *a, **k)
        timings["build_s"] = time.perf_counter() - started
        timings["peak_build_mb"] = status_mb("VmHWM")  # loading, indexing / encoding
        timings["rss_after_build_mb"] = status_mb()
        reset_peak()  # from here: the mining itself

    mining._Retriever.__init__ = timed_build
    if dense:  # what a dense run has loaded anyway (the encoder module: torch, transformers)
        import robustir.models.encoder  # noqa: F401
    rss_imports = status_mb()
    started = time.perf_counter()
    if args.side == "bm25-lists":  # the previous path: everything in lists, BM25 tokenized whole
        BM25Index.index_chunks = lambda self, chunks, show_progress=False: self.index(
            [t for chunk in chunks for t in chunk], show_progress)
        dataset = load_beir(folder, "train")
        timings["load_s"] = time.perf_counter() - started
        report = mine_negatives(queries_from_beir(dataset), dataset.corpus.ids, dataset.corpus.texts_for_encoding(),
                                output, config, show_progress=False)
    else:
        report = mine_beir(folder, "train", output, config, HashEncoder() if dense else None)
    total = time.perf_counter() - started
    mine_s = total - timings["build_s"] - timings.get("load_s", 0.0)
    return {"mode": args.side, "size": args.size, "queries": report.queries, "negatives": report.negatives,
            "seconds": round(total, 1), "build_s": round(timings["build_s"], 1), "mine_s": round(mine_s, 1),
            "queries_per_s": round(report.queries / mine_s, 1), "rss_after_imports_mb": round(rss_imports),
            "peak_build_mb": round(timings["peak_build_mb"]), "rss_after_build_mb": round(timings["rss_after_build_mb"]),
            "peak_mining_mb": round(status_mb("VmHWM")),
            "peak_rss_mb": round(max(timings["peak_build_mb"], status_mb("VmHWM"))),
            "chunk": config.corpus_chunk, "threads": args.threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=65536, help="corpus_chunk of dense-chunked (rows)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="/tmp/robustir-mine-scale", help="corpora and outputs go here")
    parser.add_argument("--results", default=None, help="append one JSON line per run to this file")
    parser.add_argument("--side", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "src")}
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        folder = build_folder(work, size, args.queries, args.seed)
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--side", mode, "--size", str(size), "--folder", str(folder),
                   "--work", str(work), "--threads", str(args.threads), "--chunk", str(args.chunk)]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                print(f"{mode} {size}: failed\n{result.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.results:
                with open(args.results, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
    print(f"\n{'mode':14s} {'passages':>9s} {'build s':>8s} {'queries/s':>10s} {'RSS imports MB':>15s} "
          f"{'peak build MB':>14s} {'peak mining MB':>15s} {'peak RSS MB':>12s}")
    for row in rows:
        print(f"{row['mode']:14s} {row['size']:9d} {row['build_s']:8.1f} {row['queries_per_s']:10.1f} "
              f"{row['rss_after_imports_mb']:15d} {row['peak_build_mb']:14d} {row['peak_mining_mb']:15d} "
              f"{row['peak_rss_mb']:12d}")


if __name__ == "__main__":
    main()
