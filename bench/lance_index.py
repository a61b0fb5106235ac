"""The LanceDB index (issue 23): build throughput against ``SentenceTransformer.encode``, and dense-search latency
with and without a filter at 100k documents.

    python bench/lance_index.py build --data ../shared/data/scifact --docs 1000 --precision fp32
    python bench/lance_index.py latency --rows 100000 --queries 200
    python bench/lance_index.py recall --data ../shared/data/npl --precision bf16
    python bench/lance_index.py scale --data ../shared/data/{scifact,npl,dbpedia-entity-sub5k} --docs 100000

``build``: the same first ``--docs`` documents of a BEIR corpus, the same model (the bundled all-MiniLM-L6-v2),
precision and batch size: ``SearchIndex.build`` (reading, encoding, committing chunks, the full-text index) against
``SentenceTransformer.encode`` of the same texts alone, each timed once after a warm-up of 64 texts, in one run.

``latency``: a table of ``--rows`` documents whose vectors are random unit vectors (the store's speed does not depend
on the model; encoding 100k passages takes about an hour on 2 cores) and whose fields are ``lang`` (3 values),
``year`` (50 values) and a nested ``meta.cites``; the rows are written straight into the index's table after a real
build of 8 documents made it. Then ``--queries`` random query vectors, top 10, exact search (no ANN index): unfiltered,
``{"lang": "de"}`` (a third of the rows), ``{"year": {"$gte": 2020}}`` (a tenth) and ``{"meta.cites": {"$lt": 5}}``
(a twentieth); p50 / p95 in ms, peak RSS and size on disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without installing


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(args: argparse.Namespace) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from robustir.data.beir import load_corpus
    from robustir.resources import default_model_path
    from robustir.index.store import IndexConfig
    from robustir.index.store import SearchIndex

    source = Path(args.data) / "corpus.jsonl"
    lines = source.read_text(encoding="utf-8").splitlines()[:args.docs]
    work = Path(tempfile.mkdtemp(prefix="lance-bench-"))
    corpus = work / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs, _ = load_corpus(corpus)
    texts = docs.texts_for_encoding()
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 256
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model.to(dtype)
    model.encode(texts[:64], batch_size=args.batch_size)
    start = time.perf_counter()
    model.encode(texts, batch_size=args.batch_size)
    st = time.perf_counter() - start
    config = IndexConfig(precision=args.precision, batch_size=args.batch_size, device="cpu", show_progress=False)
    start = time.perf_counter()
    index, report = SearchIndex.build(work / "idx", default_model_path(), corpus, config=config)
    ours = time.perf_counter() - start
    size = sum(p.stat().st_size for p in (work / "idx").rglob("*") if p.is_file()) / 2**20
    row = {"bench": "build", "docs": len(texts), "precision": args.precision, "batch_size": args.batch_size,
           "st_encode_s": round(st, 1), "lance_build_s": round(ours, 1), "st_docs_per_s": round(len(texts) / st, 1),
           "build_docs_per_s": round(len(texts) / ours, 1), "ratio": round(st / ours, 3), "size_mb": round(size, 1)}
    print(json.dumps(row))
    _append(args, row)


def latency(args: argparse.Namespace) -> None:
    from robustir.index.store import IndexConfig, SearchIndex
    from robustir.index.store.lance_sql import column_value
    from robustir.index.store.table import _schema
    from robustir.resources import default_model_path

    work = Path(tempfile.mkdtemp(prefix="lance-latency-"))
    seed = work / "seed.jsonl"
    seed.write_text("".join(json.dumps({"_id": f"s{i}", "text": f"seed {i}", "lang": "en", "year": 2000,
                                        "meta": {"cites": 0}}) + "\n" for i in range(8)), encoding="utf-8")
    index, _ = SearchIndex.build(work / "idx", default_model_path(), seed, config=IndexConfig(show_progress=False))
    rng = np.random.default_rng(0)
    dim, started = index.dim, time.perf_counter()
    from index_upsert import add_random_rows  # bench/, beside this script

    for start in range(0, args.rows, 20_000):
        n = min(20_000, args.rows - start)
        records = [{"lang": ["en", "de", "fr"][i % 3], "year": 1975 + i % 50, "meta": {"cites": i % 100}}
                   for i in range(start, start + n)]
        # lang, year: typed columns, as a build of such a corpus makes
        add_random_rows(index, _schema, column_value, start, records, rng, job=99)
    from lancedb.index import Bitmap, BTree

    for entry in (index.manifest.get("columns") or {}).values():  # as the end of a build of all these rows makes them
        index._table.create_index(entry["column"], config=Bitmap() if entry["index"] == "BITMAP" else BTree(),
                                  replace=True)
    write_s = time.perf_counter() - started
    queries = rng.standard_normal((args.queries, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    filters = [("none", None), ("lang = de (1/3)", {"lang": "de"}), ("year >= 2020 (1/10)", {"year": {"$gte": 2020}}),
               ("meta.cites < 5 (1/20)", {"meta.cites": {"$lt": 5}})]
    rows: list[dict] = []
    exact: dict[str, list[set]] = {}
    for search in ("exact", "ivf_hnsw_sq"):
        if search != "exact":  # the ANN index SearchIndex builds from its threshold on, made here for the same rows
            index.manifest["ann"].update(kind=search, indexed=False)
            t0 = time.perf_counter()
            index._vector_index()
            index._finish_job()
            built_s = time.perf_counter() - t0
        reader = SearchIndex.open(work / "idx")
        typed = dict(reader.manifest.get("columns") or {})
        for name, flt in filters:
            # the same filter read from the typed columns (what an index built now does) and from the JSON column
            # (what an index built before them does, and what a field of mixed kinds gets), alternated per query
            reads = ("typed", "json") if flt and any(key in typed for key in flt) else ("typed",)
            times: dict[str, list[float]] = {read: [] for read in reads}
            found: dict[str, list[set]] = {read: [] for read in reads}
            for i, q in enumerate(queries):
                for read in reads if i % 2 else reads[::-1]:
                    reader.manifest["columns"] = typed if read == "typed" else {}
                    if i == 0:
                        reader.search_vectors(queries[:3], 10, flt)  # warm-up
                    t0 = time.perf_counter()
                    hits = reader.search_vectors(q[None], 10, flt)[0]
                    times[read].append((time.perf_counter() - t0) * 1000)
                    found[read].append({h.id for h in hits})
            reader.manifest["columns"] = typed
            if len(reads) == 2:
                assert found["typed"] == found["json"], f"typed and JSON reads disagree on {name}"
            for read in reads:
                row = {"bench": "latency", "search": search, "rows": reader.count, "filter": name, "read": read,
                       "p50_ms": round(float(np.percentile(times[read], 50)), 1),
                       "p95_ms": round(float(np.percentile(times[read], 95)), 1),
                       "hits_min": min(len(f) for f in found[read])}
                if search == "exact":
                    exact.setdefault(name, found[read])
                else:
                    row["recall@10"] = round(float(np.mean([len(a & b) / max(1, len(b))
                                                            for a, b in zip(found[read], exact[name])])), 3)
                    row["index_build_s"] = round(built_s, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    size = sum(p.stat().st_size for p in (work / "idx").rglob("*") if p.is_file()) / 2**20
    summary = {"bench": "latency-setup", "rows": reader.count, "write_s": round(write_s, 1),
               "size_mb": round(size, 1), "peak_rss_mb": round(_rss_mb(), 1)}
    print(json.dumps(summary))
    for row in [*rows, summary]:
        _append(args, row)


def recall(args: argparse.Namespace) -> None:
    """Recall@10 of the ANN index on real embeddings: ``SearchIndex.build`` of a BEIR corpus (exact), the collection's
    queries searched exactly, then with the IVF-HNSW-SQ index ``AnnConfig(kind="auto")`` builds, at several nprobes."""
    from robustir.data.beir import load_beir
    from robustir.resources import default_model_path
    from robustir.index.store import IndexConfig
    from robustir.index.store import SearchIndex

    work = Path(tempfile.mkdtemp(prefix="lance-recall-"))
    corpus = Path(args.data) / "corpus.jsonl"
    config = IndexConfig(precision=args.precision, device="cpu", show_progress=True)
    started = time.perf_counter()
    index, _ = SearchIndex.build(work / "idx", default_model_path(), corpus, config=config)
    build_s = time.perf_counter() - started
    dataset = load_beir(args.data, "test")
    texts = list(dataset.queries.values())
    vectors = index.encoder.encode(texts, "query", precision=args.precision, show_progress=False)
    exact = [{h.id for h in hits} for hits in index.search_vectors(vectors, 10)]
    index.manifest["ann"].update(kind="ivf_hnsw_sq", indexed=False)
    started = time.perf_counter()
    index._vector_index()
    index._finish_job()
    ann_s = time.perf_counter() - started
    for nprobes in args.nprobes:
        index.manifest["ann"]["nprobes"] = nprobes
        times, found = [], []
        for vector in vectors:
            t0 = time.perf_counter()
            found.append({h.id for h in index.search_vectors(vector[None], 10)[0]})
            times.append((time.perf_counter() - t0) * 1000)
        row = {"bench": "recall", "data": Path(args.data).name, "docs": index.count, "queries": len(texts),
               "precision": args.precision, "index": "ivf_hnsw_sq", "partitions": index.manifest["ann"]["partitions"],
               "nprobes": nprobes, "refine_factor": index.manifest["ann"]["refine_factor"],
               "recall@10": round(float(np.mean([len(a & b) / max(1, len(b)) for a, b in zip(found, exact)])), 3),
               "p50_ms": round(float(np.percentile(times, 50)), 1), "build_s": round(build_s, 1),
               "ann_index_s": round(ann_s, 1)}
        print(json.dumps(row), flush=True)
        _append(args, row)


def scale(args: argparse.Namespace) -> None:
    """A ``--docs``-passage build with the bundled MiniLM, as ``robustir index`` does it: the passages of the shared
    BEIR corpora in ``--data`` (each cut to its first ``--words`` words), repeated with a new id until there are
    ``--docs``, each with a ``lang`` (3 values) and a ``year`` (50 values). Reports the build time, docs/s, peak RSS and
    size on disk, then dense-search latency over the real vectors with 200 of the collections' queries: unfiltered,
    ``{"lang": "de"}`` (a third) and ``{"year": {"$gte": 2015}}`` (a fifth), p50 / p95 in ms."""
    import shutil
    import subprocess

    from robustir.resources import default_model_path
    from robustir.index.store import IndexConfig, SearchIndex

    work = Path(tempfile.mkdtemp(prefix="lance-scale-"))
    texts, queries = [], []
    for folder in args.data:
        with open(Path(folder) / "corpus.jsonl", encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                words = f"{row.get('title', '')} {row['text']}".split()[:args.words]
                if words:
                    texts.append(" ".join(words))
        with open(Path(folder) / "queries.jsonl", encoding="utf-8") as handle:
            queries += [json.loads(line)["text"] for line in handle][:60]
    corpus = work / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as handle:
        for i in range(args.docs):
            handle.write(json.dumps({"_id": f"p{i}", "text": texts[i % len(texts)] + ("" if i < len(texts) else
                                                                                       f" (copy {i // len(texts)})"),
                                     "lang": ["en", "de", "fr"][i % 3], "year": 1975 + i % 50}) + "\n")
    config = IndexConfig(precision=args.precision, batch_size=args.batch_size, show_progress=True)
    started = time.perf_counter()
    index, report = SearchIndex.build(work / "idx", default_model_path(), corpus, config=config)
    seconds = time.perf_counter() - started
    size = int(subprocess.run(["du", "-sb", str(work / "idx")], capture_output=True, text=True).stdout.split()[0])
    rows = {"docs": index.count, "unique_passages": len(texts), "words": args.words, "precision": args.precision,
            "build_s": round(seconds, 1), "docs_per_s": round(index.count / seconds, 1),
            "peak_rss_mb": round(_rss_mb()), "disk_mb": round(size / 2 ** 20, 1)}
    vectors = index.encoder.encode(queries[:200], "query", show_progress=False)
    for name, flt in [("unfiltered", None), ("lang=de", {"lang": "de"}), ("year>=2015", {"year": {"$gte": 2015}})]:
        times = []
        for vector in vectors:
            t = time.perf_counter()
            hits = index.search_vectors(vector[None], 10, flt)
            times.append((time.perf_counter() - t) * 1000)
            assert len(hits[0]) == 10
        rows[f"{name}_p50_ms"] = round(float(np.percentile(times, 50)), 1)
        rows[f"{name}_p95_ms"] = round(float(np.percentile(times, 95)), 1)
    # the ANN index ``--ann auto`` would build at this size, against the exact top 10 of the same queries
    exact = [[h.id for h in index.search_vectors(v[None], 10)[0]] for v in vectors]
    from lancedb.index import IvfHnswSq

    partitions = max(1, int(np.sqrt(index.count)))
    t = time.perf_counter()
    index._table.create_index("vector", config=IvfHnswSq(distance_type="dot", num_partitions=partitions))
    rows["ann_partitions"], rows["ann_build_s"] = partitions, round(time.perf_counter() - t, 1)
    for nprobes in args.nprobes:
        index.manifest["ann"].update(indexed=True, nprobes=nprobes, refine_factor=10)
        times, found = [], 0
        for vector, want in zip(vectors, exact):
            t = time.perf_counter()
            got = [h.id for h in index.search_vectors(vector[None], 10)[0]]
            times.append((time.perf_counter() - t) * 1000)
            found += len(set(got) & set(want))
        rows[f"ann_nprobes{nprobes}_recall10"] = round(found / (10 * len(exact)), 3)
        rows[f"ann_nprobes{nprobes}_p50_ms"] = round(float(np.percentile(times, 50)), 1)
    print(json.dumps(rows))
    _append(args, {"bench": "lance_index.scale", **rows})
    index.close()
    shutil.rmtree(work)


def _append(args: argparse.Namespace, row: dict) -> None:
    if args.output:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build")
    b.add_argument("--data", required=True)
    b.add_argument("--docs", type=int, default=1000)
    b.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    b.add_argument("--batch-size", type=int, default=64)
    lat = sub.add_parser("latency")
    lat.add_argument("--rows", type=int, default=100_000)
    lat.add_argument("--queries", type=int, default=200)
    rec = sub.add_parser("recall")
    rec.add_argument("--data", required=True)
    rec.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    rec.add_argument("--nprobes", type=int, nargs="+", default=[5, 20, 50])
    sc = sub.add_parser("scale")
    sc.add_argument("--data", nargs="+", required=True)
    sc.add_argument("--docs", type=int, default=100_000)
    sc.add_argument("--words", type=int, default=100)
    sc.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    sc.add_argument("--batch-size", type=int, default=64)
    sc.add_argument("--nprobes", type=int, nargs="+", default=[20, 50, 100])
    for p in (b, lat, rec, sc):
        p.add_argument("--output", default=None, help="JSONL the rows are appended to")
    args = parser.parse_args()
    {"build": build, "latency": latency, "recall": recall, "scale": scale}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
