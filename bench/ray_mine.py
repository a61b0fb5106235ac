"""Dense mining of a 100k-passage corpus: one process against Ray Data on a simulated two-node cluster.

    python bench/ray_mine.py --passages 100000          # ~30 min on 2 cores

The corpus: every document of the BEIR sets under ../shared/data chunked into passages of at most 32 words
(`robustir.data.chunking.chunk_document`, one sentence of overlap) until --passages are reached, SciFact's first,
so that SciFact's train positives are in it. The queries: SciFact's train split (809 queries) as a training JSONL.
Both runs mine the same queries against the same corpus with the bundled all-MiniLM-L6-v2 (dense, 128-token
passages, --precision (auto: bf16 where native), 15 negatives from the top 100, relative margin 0.05), from an empty cache:
* `process`: `mine_jsonl` with the corpus encoded in this process;
* `ray-2nodes`: the same with `engine: ray` on `ray.cluster_utils.Cluster` (two raylets on 127.0.0.1, half the cores
  each, one encoder actor per node); the search and the mining rules run in the driver as without Ray;
* with --search-shards N, twice more on the same cluster from the vectors `ray-2nodes` cached, so only the search
  differs: `cached-driver` (the search in the driver, as `ray-2nodes`) and `cached-sharded` (the corpus vectors split
  among N search actors, `ray_search_shards`).
Prints the wall time of each (the Ray ones without starting the cluster) and how many queries got the same negatives.

    python bench/ray_mine.py --passages 20000 --search-shards 2

The driver's memory (issue 53): each run in a fresh process whose peak RSS (`ru_maxrss`) is the driver's alone,
from an empty cache, the two engines alternated (the first size `process` first, the next `ray` first):
`process` = `mine_jsonl` in one process; `ray` = `engine: ray` on the simulated two-node cluster, 2 encoder actors,
the corpus texts read from the corpus file by Ray tasks (the driver reads none), the search on 2 shard actors
(`ray_search_shards`), so no corpus-sized array is in the driver but the corpus file's index (`CorpusFile`, 56 bytes
a passage, which mining's rules use in either engine). Prints seconds, driver peak RSS and how many
queries got the same negatives.

    python bench/ray_mine.py --driver-memory 20000,100000 [--tiny]

With --tiny the model is a 2-layer, 32-wide random BERT (fp32), so that both sizes run in minutes on 2 shared
cores: the figures are then the engines' own memory and overhead, not the bundled model's speed.

    python bench/ray_mine.py --npy-write 100000,300000 384      # the driver heap writing mining's .npy from Lance
    python bench/ray_mine.py --read-paths 6000 tasks,driver      # corpus rows read by Ray tasks vs by the driver
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def build(passages: int, work: Path) -> tuple[Path, Path]:
    from robustir.data.chunking import chunk_document
    from robustir.data.training_data import examples_from_beir

    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    rows, seen = [], set()
    for name in ("scifact", "dbpedia-entity-sub5k", "msmarco-dl19-sub5k", "npl", "cacm", "cisi", "medline"):
        for line in (shared / name / "corpus.jsonl").read_text(encoding="utf-8").split("\n"):
            if not line.strip():
                continue
            doc = json.loads(line)
            for passage in chunk_document(f"{name}-{doc['_id']}", doc.get("title", ""), doc["text"], max_tokens=32,
                                          min_tokens=6):
                if len(rows) < passages and passage.text not in seen:
                    seen.add(passage.text)
                    rows.append({"_id": passage.id, "title": passage.title, "text": passage.text})
    if len(rows) < passages:
        raise SystemExit(f"only {len(rows)} passages could be made")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps({"query": e.query, "pos": e.pos}) + "\n"
                             for e in examples_from_beir(shared / "scifact", "train")), encoding="utf-8")
    return corpus, train


def one(engine: str, corpus: Path, train: Path, work: Path, precision: str, model: str) -> None:
    """One run in this (fresh) process: prints a JSON line of seconds and this driver's peak RSS."""
    import resource

    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import MiningConfig, mine_jsonl
    from robustir.resources import default_model_path

    common = dict(method="dense", num_negatives=15, range_max=100, relative_margin=0.05, precision=precision,
                  cache_dir=str(work / f"cache-{engine}"))
    encoder = Encoder.from_pretrained(model or default_model_path(), passage_max_length=128)
    cluster = None
    if engine == "ray":
        import ray
        from ray.cluster_utils import Cluster

        cores = os.cpu_count() or 2
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cores // 2})
        cluster.add_node(num_cpus=cores - cores // 2)
        ray.init(address=cluster.address, log_to_driver=False)
        common.update(engine="ray", ray_actors=2, ray_search_shards=2)
    started = time.perf_counter()
    mine_jsonl(train, work / f"{engine}.jsonl", MiningConfig(**common), encoder=encoder, corpus=corpus)
    seconds = time.perf_counter() - started
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    parts = {k: round(int(status[k].split()[0]) / 1024) for k in ("RssAnon", "RssFile", "RssShmem") if k in status}
    if cluster is not None:
        ray.shutdown()
        cluster.shutdown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the parts of the RSS at the end (MiB): the heap (anon), mapped files and shared memory (Ray's object store)
    print(json.dumps({"engine": engine, "seconds": round(seconds, 1), "peak_mib": round(peak), "end_mib": parts}),
          flush=True)


def driver_memory(sizes: list[int], precision: str, tiny: bool) -> None:
    import subprocess

    model = ""
    if tiny:  # the engines' own memory and overhead in minutes: a 2-layer, 32-wide random BERT
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ray_encode import tiny_model

        model = tiny_model(Path(tempfile.mkdtemp(prefix="ray-mine-model-")) / "tiny-bert")

    rows = []
    for turn, n in enumerate(sizes):
        work = Path(tempfile.mkdtemp(prefix=f"ray-mine-{n}-"))
        corpus, train = build(n, work)
        got = {}
        for engine in (("process", "ray") if turn % 2 == 0 else ("ray", "process")):
            reply = subprocess.run([sys.executable, __file__, "--one", engine, str(corpus), str(train), str(work),
                                    precision, model], capture_output=True, text=True, check=True)
            got[engine] = json.loads(reply.stdout.strip().splitlines()[-1])
            print(n, got[engine], os.getloadavg(), flush=True)
        a = [json.loads(x) for x in (work / "process.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (work / "ray.jsonl").read_text().splitlines()]
        same = sum(x["neg_ids"] == y["neg_ids"] for x, y in zip(a, b))
        rows.append((n, got, same, len(a)))
        shutil.rmtree(work, ignore_errors=True)
    print("\n| passages | driver peak RSS, ray | one process | seconds, ray | one process | ray / process "
          "throughput | same negatives |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, got, same, total in rows:
        r, p = got["ray"], got["process"]
        print(f"| {n:,} | {r['peak_mib']} MiB | {p['peak_mib']} MiB | {r['seconds']:.0f} | {p['seconds']:.0f} | "
              f"x{p['seconds'] / r['seconds']:.2f} | {same} of {total} |")


def npy_write(rows: int, dim: int) -> None:
    """The driver heap `write_in_row_order` keeps (RssAnon after the write minus before), on a Lance dataset of
    8,192-row fragments in shuffled row order, as the Ray encoding writes it; run in a fresh process."""
    import gc

    import numpy as np
    import pyarrow as pa
    import lance

    from robustir.index.dense import EmbeddingFile
    from robustir.scale.ray_encode import write_in_row_order

    def anon() -> int:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(status["RssAnon"].split()[0]) // 1024

    work = Path(tempfile.mkdtemp(prefix="npy-write-"))
    uri, rng = str(work / "v.lance"), np.random.default_rng(0)
    schema = pa.schema([("id", pa.string()), ("vector", pa.list_(pa.float32(), dim))])
    order = rng.permutation(rows)
    for start in range(0, rows, 8192):
        part = order[start:start + 8192]
        vectors = pa.array(rng.standard_normal(len(part) * dim).astype(np.float32))
        lance.write_dataset(pa.table({"id": pa.array([f"{i:012d}" for i in part]),
                                      "vector": pa.FixedSizeListArray.from_arrays(vectors, dim)}, schema=schema),
                            uri, mode="append" if start else "create", max_rows_per_file=8192)
    gc.collect()
    before = anon()
    file = EmbeddingFile.create(work / "x.npy", rows, dim)
    written = write_in_row_order(uri, file)
    file.close()
    gc.collect()
    print(json.dumps({"rows": rows, "dim": dim, "written": written, "heap_growth_mib": anon() - before}), flush=True)
    shutil.rmtree(work, ignore_errors=True)


def read_paths(passages: int, order: list[str]) -> None:
    """Ray mining's encoding with the corpus file's rows read by Ray tasks (`tasks`) or by the driver (`driver`:
    `file_pieces` made to answer None), in the order given, in one process on the simulated two-node cluster, the
    bundled model in fp32: seconds of each."""
    import ray
    from ray.cluster_utils import Cluster

    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import FileDocuments, MiningConfig, mine_jsonl
    from robustir.resources import default_model_path

    work = Path(tempfile.mkdtemp(prefix="read-paths-"))
    corpus, train = build(passages, work)
    encoder = Encoder.from_pretrained(default_model_path(), passage_max_length=128)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    own = FileDocuments.file_pieces
    for i, mode in enumerate(order):
        FileDocuments.file_pieces = own if mode == "tasks" else (lambda self, rows: None)
        started = time.perf_counter()
        mine_jsonl(train, work / f"{i}.jsonl", MiningConfig(
            method="dense", num_negatives=15, range_max=100, relative_margin=0.05, precision="fp32",
            cache_dir=str(work / f"cache{i}"), engine="ray", ray_actors=2), encoder=encoder, corpus=corpus)
        print(mode, round(time.perf_counter() - started, 1), "s", flush=True)
    FileDocuments.file_pieces = own
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--npy-write"]:  # python bench/ray_mine.py --npy-write 100000,300000 384
        import subprocess

        for rows in argv[1].split(","):
            subprocess.run([sys.executable, __file__, "--npy-write-one", rows, argv[2]], check=True)
        return 0
    if argv[:1] == ["--npy-write-one"]:
        npy_write(int(argv[1]), int(argv[2]))
        return 0
    if argv[:1] == ["--read-paths"]:  # python bench/ray_mine.py --read-paths 6000 tasks,driver,tasks,driver
        read_paths(int(argv[1]), argv[2].split(","))
        return 0
    if argv[:1] == ["--one"]:
        one(argv[1], Path(argv[2]), Path(argv[3]), Path(argv[4]), argv[5], argv[6])
        return 0
    if argv[:1] == ["--driver-memory"]:
        driver_memory([int(x) for x in argv[1].split(",")], "fp32" if "--tiny" in argv else "auto", "--tiny" in argv)
        return 0
    import ray
    from ray.cluster_utils import Cluster

    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import MiningConfig, mine_jsonl
    from robustir.resources import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--precision", default="auto", help="auto (bf16 where native) or fp32")
    parser.add_argument("--search-shards", type=int, default=0, help="also mine with the search on N Ray actors")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 2
    work = Path(tempfile.mkdtemp(prefix="ray-mine-"))
    corpus, train = build(args.passages, work)
    encoder = Encoder.from_pretrained(default_model_path(), passage_max_length=128)
    common = dict(method="dense", num_negatives=15, range_max=100, relative_margin=0.05, precision=args.precision)
    seconds = {}

    started = time.perf_counter()
    mine_jsonl(train, work / "process.jsonl", MiningConfig(**common, cache_dir=str(work / "cache-process")),
               encoder=encoder, corpus=corpus)
    seconds["process"] = time.perf_counter() - started
    print(f"process     {seconds['process']:.0f} s", flush=True)

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cores // 2})
    cluster.add_node(num_cpus=cores - cores // 2)
    ray.init(address=cluster.address, log_to_driver=False)
    started = time.perf_counter()
    mine_jsonl(train, work / "ray.jsonl",
               MiningConfig(**common, cache_dir=str(work / "cache-ray"), engine="ray", ray_actors=2),
               encoder=encoder, corpus=corpus)
    seconds["ray-2nodes"] = time.perf_counter() - started
    print(f"ray-2nodes  {seconds['ray-2nodes']:.0f} s", flush=True)
    for name, shards in ([("cached-driver", None), ("cached-sharded", args.search_shards)] if args.search_shards
                         else []):
        started = time.perf_counter()
        mine_jsonl(train, work / f"{name}.jsonl",
                   MiningConfig(**common, cache_dir=str(work / "cache-ray"), engine="ray", ray_actors=2,
                                ray_search_shards=shards), encoder=encoder, corpus=corpus)
        seconds[name] = time.perf_counter() - started
        print(f"{name} {seconds[name]:.0f} s", flush=True)
    ray.shutdown()
    cluster.shutdown()

    a = [json.loads(x) for x in (work / "process.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (work / "ray.jsonl").read_text().splitlines()]
    same = sum(x["neg_ids"] == y["neg_ids"] for x, y in zip(a, b))
    overlap = sum(len(set(x["neg_ids"]) & set(y["neg_ids"])) for x, y in zip(a, b)) / max(1, sum(
        len(x["neg_ids"]) for x in a))
    print(f"\n{args.passages} passages, {len(a)} queries, {cores} cores: process {seconds['process']:.0f} s, "
          f"ray-2nodes {seconds['ray-2nodes']:.0f} s (x{seconds['process'] / seconds['ray-2nodes']:.2f} the "
          f"throughput); the same negatives for {same} of {len(a)} queries, {overlap:.1%} of all negatives shared "
          f"(precision {args.precision})")
    if args.search_shards:
        c = [json.loads(x) for x in (work / "cached-sharded.jsonl").read_text().splitlines()]
        d = [json.loads(x) for x in (work / "cached-driver.jsonl").read_text().splitlines()]
        gap = max((abs(s - t) for x, y in zip(d, c) for s, t in zip(x["neg_scores"], y["neg_scores"])), default=0.0)
        print(f"from cached vectors: search in the driver {seconds['cached-driver']:.0f} s, on {args.search_shards} "
              f"search actors {seconds['cached-sharded']:.0f} s; the same negative ids for "
              f"{sum(x['neg_ids'] == y['neg_ids'] for x, y in zip(d, c))} of {len(d)} queries, identical records "
              f"for {sum(x == y for x, y in zip(d, c))}, scores at most {gap:.1e} apart (FAISS's BLAS rounds with "
              f"its thread count: {cores} threads in the driver, 1 in a search actor)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
