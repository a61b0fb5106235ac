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

Driver memory (issue 53): does the driver's peak RSS stay flat in the corpus size, and is the model loaded once per
actor for the whole job?

    python bench/ray_encode.py --driver-memory 20000,100000 --rounds 2     # ~5 min on 2 cores

Each size runs in a fresh process (its peak RSS, `ru_maxrss`, is its own), alternating `process` (`Encoder.encode`
of the whole corpus in that process) and `ray` (`encode_with_ray` on a local Ray session of all cores, one 1-CPU
actor per core, --part-rows 20000: several commits). To run in minutes on 2 cores it uses a tiny random BERT
(2 layers, 32 wide, MiniLM's tokenizer) and short synthetic passages (12-40 words), so the figures are the
engine's own overhead and memory, not a real model's speed. Prints per run: seconds, passages/s, the process's
peak RSS, and for Ray the model loads counted by the job's actors.
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


def tiny_model(target: Path) -> str:
    """A 2-layer, 32-wide random BERT with the bundled MiniLM's tokenizer (as tests/conftest.py makes)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from robustir.resources import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def synthetic_corpus(rows: int, target: Path) -> Path:
    import random

    words = ("protein cell gene study patients results effect analysis expression model data response risk "
             "treatment clinical level increased disease factor human cancer role function trial").split()
    rng = random.Random(rows)
    with target.open("w", encoding="utf-8") as handle:
        for i in range(rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(12, 40)))
            handle.write(json.dumps({"_id": f"p{i:08d}", "title": f"title {i % 977}", "text": text}) + "\n")
    return target


def one_run(engine: str, corpus: str, model: str, out: str) -> None:
    """In a fresh process: encode ``corpus`` with ``engine``; print a JSON line of seconds, peak RSS, loads."""
    import resource

    cores = os.cpu_count() or 2
    started = time.perf_counter()
    loads = None
    if engine == "process":
        from robustir.data.beir import load_corpus
        from robustir.models.encoder import Encoder

        loaded, _ = load_corpus(corpus)
        encoder = Encoder.from_pretrained(model, device="cpu")
        vectors = encoder.encode(loaded.texts_for_encoding(), "passage", batch_size=64, precision="fp32",
                                 show_progress=False)
        rows = len(vectors)
    else:
        import ray

        from robustir.scale import ray_encode

        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
        started = time.perf_counter()  # the session's start is not the engine's
        config = ray_encode.RayEncodeConfig(precision="fp32", batch_rows=2048, part_rows=20_000, concurrency=cores,
                                            num_cpus=1, show_progress=False)
        rows = ray_encode.encode_with_ray(corpus, model, out, config=config).rows
        loads = ray_encode._LAST.get("model_loads")
        ray.shutdown()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"engine": engine, "rows": rows, "seconds": round(seconds, 2), "peak_rss_mib": round(peak),
                      "model_loads": loads}))


def driver_memory(sizes: list[int], rounds: int) -> int:
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="ray-mem-"))
    model = tiny_model(work / "tiny-bert")
    corpora = {n: str(synthetic_corpus(n, work / f"corpus-{n}.jsonl")) for n in sizes}
    results: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(rounds):
        for n in sizes:
            for engine in ("process", "ray"):
                out = work / f"v-{n}-{round_}.lance"
                reply = subprocess.run([sys.executable, __file__, "--one", engine, corpora[n], model, str(out)],
                                       capture_output=True, text=True, check=True)
                got = json.loads(reply.stdout.strip().splitlines()[-1])
                results.setdefault((engine, n), []).append(got)
                print(f"round {round_ + 1} {engine:8s} {n:7d} passages: {got['seconds']:6.1f} s "
                      f"({n / got['seconds']:6.0f}/s), driver peak RSS {got['peak_rss_mib']} MiB"
                      + (f", model loads {got['model_loads']}" if got["model_loads"] is not None else ""), flush=True)
                shutil.rmtree(out, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores, {rounds} rounds (median):")
    for n in sizes:
        rate = {e: statistics.median(n / r["seconds"] for r in results[(e, n)]) for e in ("process", "ray")}
        rss = {e: statistics.median(r["peak_rss_mib"] for r in results[(e, n)]) for e in ("process", "ray")}
        print(f"{n:7d} passages: process {rate['process']:6.0f}/s {rss['process']:5.0f} MiB | ray "
              f"{rate['ray']:6.0f}/s {rss['ray']:5.0f} MiB, x{rate['ray'] / rate['process']:.2f} of process, "
              f"model loads {[r['model_loads'] for r in results[('ray', n)]]}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        one_run(*argv[1:5])
        return 0
    if "--driver-memory" in argv:
        at = argv.index("--driver-memory")
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
        return driver_memory([int(n) for n in argv[at + 1].split(",")], rounds)
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
