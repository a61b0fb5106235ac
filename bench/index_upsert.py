"""What an HTTP write costs as the index grows (issue 51): a 1-document upsert into indexes of 1k, 10k and 100k
documents, plus dense-search latency and ingestion throughput, for two source trees in one alternated run.

    git archive main src | tar -x -C /tmp/before
    python bench/index_upsert.py --src before=/tmp/before/src after=src --sizes 1000 10000 100000 --rounds 7

Each ``--src`` gets its own worker process (``PYTHONPATH`` = that tree) holding the bundled all-MiniLM-L6-v2 encoder
and its own indexes; the workers take turns, the order flipped every round, and each times only the call inside it.

* ``upsert``: :func:`robustir.index.store.spool.upsert_documents` -- the function ``POST /documents`` runs on its model
  worker thread (without HTTP: the route adds only the request parsing) -- with one document, alternately a new id
  and a replacement of an existing one. Each index is made by a real build of 8 documents, then random unit vectors
  written straight into its table in chunks of 1,024 rows (as a build commits them: one fragment each; encoding 100k
  passages takes about an hour on 2 cores and the index's costs do not depend on the model), then the job's end
  (full-text, scalar indexes, the manifest's file records), as a build ends.
* ``search``: ``search_vectors`` of 30 random query vectors, top 10, unfiltered and ``{"lang": "de"}``, on a reader
  opened once: median ms (``--same-index``: every tree reads the first tree's index files).
* ``ingest``: ``upsert_documents`` of 128 new documents into the 10k index: documents per second.

Rows: the median of the rounds and the range (min-max), per tree, as wall time and as the worker's CPU time (all
its threads: steadier than wall time on a shared box); ratios after/before where both ran.
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

BENCH = Path(__file__).resolve()


# ------------------------------------------------------------------------------------------------ worker side

def _doc(i: int, replace: bool) -> dict:
    return {"_id": f"r{i}" if replace else f"new{i}", "title": "", "text": f"an upserted passage number {i}",
            "lang": ["en", "de", "fr"][i % 3], "year": 1975 + i % 50}


def _api():
    """(the index API, its table module, filters, the HTTP write module) of this tree: before issue 51 they were
    robustir.serving.{index, index, filters, ingest}."""
    import importlib

    try:
        store = importlib.import_module("robustir.index.store")
        return (store, importlib.import_module("robustir.index.store.table"),
                importlib.import_module("robustir.index.store.lance_sql"),
                importlib.import_module("robustir.index.store.spool"))
    except ImportError:
        index = importlib.import_module("robustir.serving.index")
        return (index, index, importlib.import_module("robustir.serving.filters"),
                importlib.import_module("robustir.serving.ingest"))


def add_random_rows(index, schema, column_value, start: int, records: list[dict], rng, job: int) -> None:
    """Rows ``r{start}`` ... with ``records`` as their fields and random unit vectors, written straight into the
    index's table as one commit (one fragment), their typed columns filled as a build fills them."""
    import numpy as np
    import pyarrow as pa

    m, dim, columns = len(records), index.dim, index.manifest.get("columns") or {}
    vectors = rng.standard_normal((m, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index._table.add(pa.table({
        "id": [f"r{i}" for i in range(start, start + m)], "title": [""] * m,
        "text": [f"passage {i}" for i in range(start, start + m)],
        "content": [f"passage {i}" for i in range(start, start + m)],
        "fields": pa.array([json.dumps(r) for r in records], type=pa.json_(pa.string())),
        **{entry["column"]: [column_value(entry["kind"], r.get(name)) for r in records]
           for name, entry in columns.items()},
        "job": [job] * m, "line": list(range(start, start + m)),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), dim)},
        schema=schema(dim, columns)))


def _build(work: Path, n: int, encoder) -> float:
    import numpy as np
    import pyarrow as pa

    module, table, filters, _ = _api()

    started = time.perf_counter()
    seed = work / f"seed-{n}.jsonl"
    seed.write_text("".join(json.dumps({"_id": f"s{i}", "text": f"seed {i}", "lang": "en", "year": 2000}) + "\n"
                            for i in range(8)), encoding="utf-8")
    index, _ = module.SearchIndex.build(work / f"idx-{n}", encoder, seed,
                                        config=module.IndexConfig(show_progress=False))
    rng = np.random.default_rng(n)
    columns = index.manifest.get("columns") or {}
    for start in range(0, n, 1024):
        m = min(1024, n - start)
        records = [{"lang": ["en", "de", "fr"][i % 3], "year": 1975 + i % 50} for i in range(start, start + m)]
        add_random_rows(index, table._schema, filters.column_value, start, records, rng, job=1)
    index._finish_job()  # as a build ends: full-text and scalar indexes, the manifest's version, count and files
    index.close()
    return time.perf_counter() - started


def worker(args: argparse.Namespace) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else the libraries print goes to stderr
    import numpy as np

    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path
    module, _, _, spool = _api()
    SearchIndex, upsert_documents = module.SearchIndex, spool.upsert_documents

    encoder = Encoder.from_pretrained(default_model_path(), device="cpu")
    encoder.source = default_model_path()
    work = Path(args.work)
    readers: dict[int, SearchIndex] = {}
    rng = np.random.default_rng(0)
    for line in sys.stdin:
        cmd = json.loads(line)
        n, path = cmd.get("n"), Path(cmd["path"]) if cmd.get("path") else work / f"idx-{cmd.get('n')}"
        if cmd["op"] == "build":
            result = {"s": _build(work, n, encoder)}
        elif cmd["op"] == "upsert":
            doc = _doc(cmd["i"], replace=cmd["i"] % 2 == 1)
            t0, c0 = time.perf_counter(), time.process_time()
            upsert_documents(path, encoder, [doc])
            result = {"ms": (time.perf_counter() - t0) * 1000, "cpu_ms": (time.process_time() - c0) * 1000}
        elif cmd["op"] == "search":
            reader = readers.get(n) or readers.setdefault(n, SearchIndex.open(path))  # opened once per size
            queries = rng.standard_normal((30, reader.dim)).astype(np.float32)
            result = {}
            for name, flt in (("none", None), ("lang", {"lang": "de"})):
                reader.search_vectors(queries[:2], 10, flt)  # warm
                times, cpu = [], []
                for q in queries:
                    t0, c0 = time.perf_counter(), time.process_time()
                    reader.search_vectors(q[None], 10, flt)
                    times.append((time.perf_counter() - t0) * 1000)
                    cpu.append((time.process_time() - c0) * 1000)
                result[name] = statistics.median(times)
                result[name + "/cpu"] = statistics.median(cpu)
        elif cmd["op"] == "ingest":
            docs = [{"_id": f"ing{cmd['i']}-{j}", "title": "", "text": f"ingested passage {j} of round {cmd['i']}",
                     "lang": "de", "year": 2001} for j in range(128)]
            t0, c0 = time.perf_counter(), time.process_time()
            upsert_documents(path, encoder, docs)
            result = {"docs_s": len(docs) / (time.perf_counter() - t0),
                      "docs_cpu_s": len(docs) / (time.process_time() - c0)}
        else:
            result = {"error": f"unknown op {cmd['op']}"}
        out.write(json.dumps(result) + "\n")


# ------------------------------------------------------------------------------------------------ driver side

class _Worker:
    def __init__(self, name: str, src: str, work: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(src).resolve()), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(BENCH), "worker", "--work", str(work)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        answer = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not answer:
            raise RuntimeError(f"worker {self.name} died")
        return json.loads(answer)

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def _row(what: str, name: str, values: list[float], **extra) -> dict:
    return {"bench": what, "src": name, **extra, "median": round(statistics.median(values), 2),
            "min": round(min(values), 2), "max": round(max(values), 2), "rounds": len(values)}


def drive(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="index-upsert-"))
    trees = dict(s.split("=", 1) for s in args.src)
    workers = [_Worker(name, src, work / name) for name, src in trees.items()]
    load = os.getloadavg()
    rows: list[dict] = []
    for n in args.sizes:
        for w in workers:
            print(json.dumps({"built": n, "src": w.name, "s": round(w.ask(op="build", n=n)["s"], 1)}), flush=True)
    up: dict = {}
    search: dict = {}
    ingest: dict = {}
    for r in range(args.rounds):
        order = workers if r % 2 == 0 else workers[::-1]
        for n in args.sizes:
            for w in order:
                for key, ms in w.ask(op="upsert", n=n, i=r).items():
                    up.setdefault((w.name, n, key), []).append(ms)
                shared = str(work / workers[0].name / f"idx-{n}") if args.same_index else None
                for key, ms in w.ask(op="search", n=n, path=shared).items():
                    search.setdefault((w.name, n, key), []).append(ms)
        if r < args.ingest_rounds:
            for w in order:
                for key, rate in w.ask(op="ingest", n=args.ingest_size, i=r).items():
                    ingest.setdefault((w.name, key), []).append(rate)
    for w in workers:
        w.close()
    for (name, n, key), values in up.items():
        rows.append(_row(f"upsert_1doc_{key}", name, values, documents=n))
    for (name, n, flt), values in search.items():
        rows.append(_row("search_ms", name, values, documents=n, filter=flt))
    for (name, key), values in ingest.items():
        rows.append(_row(f"ingest_{key}", name, values, documents=args.ingest_size, batch=128))
    for row in rows:
        print(json.dumps(row), flush=True)
    for name in trees:
        for bench in ("upsert_1doc_ms", "upsert_1doc_cpu_ms"):
            one = [r for r in rows if r["bench"] == bench and r["src"] == name]
            if len(one) > 1:
                print(json.dumps({"growth": name, "bench": bench, f"{max(args.sizes)}_over_{min(args.sizes)}":
                                  round(one[-1]["median"] / one[0]["median"], 2)}))
    if len(trees) == 2:
        before, after = list(trees)
        by = {(r["bench"], r["src"], r.get("documents"), r.get("filter")): r["median"] for r in rows}
        for (bench, src, n, flt), value in by.items():
            if src == after and (bench, before, n, flt) in by:
                print(json.dumps({"ratio": f"{after}/{before}", "bench": bench, "documents": n, "filter": flt,
                                  "x": round(value / by[(bench, before, n, flt)], 2)}))
    print(json.dumps({"load_avg_at_start": [round(x, 2) for x in load], "cpus": os.cpu_count()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--work", required=True)
    parser.add_argument("--src", nargs="+", default=["here=" + str(BENCH.parents[1] / "src")],
                        help="NAME=PATH of a source tree's src folder (one worker each)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ingest-rounds", type=int, default=3)
    parser.add_argument("--same-index", action="store_true",
                        help="every tree searches the first tree's index files (the search rows compare code only)")
    parser.add_argument("--ingest-size", type=int, default=10_000, help="the index the ingest rows write into")
    args = parser.parse_args()
    if args.cmd == "worker":
        worker(args)
    else:
        drive(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
