"""Corpus encoding: one process against Ray Data (`robustir encode --engine ray`), on this box.

    python bench/ray_encode.py --rows 6000 --rounds 2     # ~10 min on 2 cores

Three ways to encode the same passages with the bundled all-MiniLM-L6-v2 (128-token passages, precision auto):
* `process`: `Encoder.encode` in this process (torch on every core);
* `ray-local`: `encode_with_ray` on a local Ray session of all cores, one 1-CPU encoder actor per core;
* `ray-2nodes`: the same on a simulated two-node cluster (`ray.cluster_utils.Cluster`, two raylets on 127.0.0.1 with
  half the cores each), one actor per node.
Rounds alternate the three (process, ray-local, ray-2nodes, process, ...); the Ray rows include starting the actors
(one model load each) and the Lance commits, not starting the Ray session. Prints passages/s per round, the median
and range, and each engine's ratio to `process`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def corpus_file(rows: int, target: Path) -> Path:
    """``rows`` passages from the BEIR corpora under ../shared/data (SciFact first), ids made unique."""
    out, n = [], 0
    for name in ("scifact", "dbpedia-entity-sub5k", "msmarco-dl19-sub5k", "npl", "cacm", "cisi", "medline"):
        path = Path(__file__).resolve().parents[1].parent / "shared" / "data" / name / "corpus.jsonl"
        for line in filter(str.strip, path.read_text(encoding="utf-8").split("\n")):
            if n == rows:
                break
            record = json.loads(line)
            record["_id"] = f"{name}-{record['_id']}"
            out.append(json.dumps(record))
            n += 1
    if n < rows:
        raise SystemExit(f"only {n} passages available")
    target.write_text("\n".join(out) + "\n", encoding="utf-8")
    return target


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from robustir.data.beir import load_corpus
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path
    from robustir.scale.ray_encode import RayEncodeConfig, encode_with_ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 2
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    corpus = corpus_file(args.rows, work / "corpus.jsonl")
    options = {"passage_max_length": args.length}
    model = default_model_path()
    config = RayEncodeConfig(batch_rows=2048, part_rows=args.rows, concurrency=cores, num_cpus=1,
                             show_progress=False)

    def process() -> float:
        loaded, _ = load_corpus(corpus)
        started = time.perf_counter()
        encoder = Encoder.from_pretrained(model, **options)
        encoder.encode(loaded.texts_for_encoding(), "passage", batch_size=64, precision="auto", show_progress=False)
        return time.perf_counter() - started

    def on_ray(connect) -> float:
        connect()
        out = work / "v.lance"
        shutil.rmtree(out, ignore_errors=True)
        Path(str(out) + ".run.json").unlink(missing_ok=True)
        started = time.perf_counter()
        encode_with_ray(corpus, model, out, config=config, encoder_options=options)
        seconds = time.perf_counter() - started
        ray.shutdown()
        return seconds

    cluster: list = []

    def two_nodes() -> None:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": cores // 2})
        c.add_node(num_cpus=cores - cores // 2)
        cluster.append(c)
        ray.init(address=c.address, log_to_driver=False)

    engines = {"process": process,
               "ray-local": lambda: on_ray(lambda: ray.init(num_cpus=cores, include_dashboard=False,
                                                              log_to_driver=False)),
               "ray-2nodes": lambda: on_ray(two_nodes)}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name, run in engines.items():
            seconds = run()
            while cluster:
                cluster.pop().shutdown()
            rates[name].append(args.rows / seconds)
            print(f"round {round_ + 1} {name:10s} {args.rows / seconds:7.1f} passages/s ({seconds:.1f} s)", flush=True)
    base = statistics.median(rates["process"])
    print(f"\n{args.rows} passages, {args.length} tokens, {cores} cores, {args.rounds} rounds (median [min, max]):")
    for name, values in rates.items():
        print(f"{name:10s} {statistics.median(values):7.1f} [{min(values):.1f}, {max(values):.1f}] passages/s"
              f"  x{statistics.median(values) / base:.2f} of process")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
