"""Dense search latency while a 1,000-document HTTP upsert runs, before and after issue 55's fix, in one run.

    python bench/upsert_search.py --rounds 2                    # ~3 min on 2 cores (MiniLM, the default precision)
    python bench/upsert_search.py --rounds 3 --precision fp32 --output docs/results/upsert_search.jsonl

Issue 55, item 1: ``POST /documents`` ran the whole upsert -- its encoding included -- on a model worker, so dense
searches issued during a 100-document upsert waited p50 25 s. Since the fix the upsert's documents go through the
batcher as background micro-batches (``--ingest-batch-size``, default one forward pass): on a CPU with one worker
(fp32) on a lane of their own beside the searches' batches, else taking turns with them on ``workers - 1`` workers.

Each round copies an index of ``--base`` documents built here with ``--model`` (default: the bundled MiniLM) and
starts ``robustir serve`` on 127.0.0.1 (a free port; nothing else is reached) in a subprocess: "before" runs the
source of ``--baseline-ref`` (``git archive`` of that commit), "after" this checkout's ``src``. ``--clients`` clients
send 1-query dense searches one after another: ``--idle`` of them first (the idle latency), then while one POST
/documents of ``--documents`` documents (``--words`` words each) runs (every search issued before the upsert's answer
counts, however long it waited). The rounds alternate before / after. Printed:
per round the idle and during-upsert latency (p50, p99, max), the ratio during p99 / idle p99 (the goal: <= 1.5) and
the upsert's seconds, and where the slowest 1% of the searches during the upsert spent their time (mean ms: the
whole request, the batcher's queue, the model, the server in all: its ``X-Queue-Time``, ``X-Inference-Time`` and
``X-Total-Time``); then the median and range over the rounds of each side, and the machine load (``uptime``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from rerank_load import WORDS, append_rows, baseline_source, free_port, print_sides, served_round  # noqa: E402


def text(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3 + j * j) % len(WORDS)] for j in range(words)) + f" item {i}"


def build_index(folder: Path, model: str, base: int, words: int, precision: str) -> Path:
    from robustir.index.store import IndexConfig, SearchIndex

    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"b{i}", "text": text(i, words)}) + "\n" for i in range(base)))
    SearchIndex.build(folder / "index", model, corpus, config=IndexConfig(show_progress=False,
                                                                           precision=precision))[0].close()
    return folder / "index"


def start_server(src: Path, index: Path, port: int, precision: str, log: Path, more: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "robustir.cli.main", "serve", "--index", str(index), "--host", "127.0.0.1",
               "--port", str(port), "--precision", precision, *more]
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max": ordered[-1], "n": len(ordered)}


async def load(url: str, args: argparse.Namespace, round_: int) -> dict:
    documents = [{"_id": f"r{round_}-{i}", "text": text(10_000 + i, args.words)} for i in range(args.documents)]
    idle: list[float] = []
    during: list[float] = []
    when: list[tuple[float, float]] = []  # (seconds into the upsert the search started, its latency ms)
    parts: list[tuple[float, ...]] = []  # per search during the upsert: latency, queue, inference, server total (ms)
    statuses: dict[int, int] = {}
    upserting = asyncio.Event()
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=64)) as client:
        await client.post("/search", json={"query": "warm up", "top_k": 10})

        async def search(k: int, i: int, during: bool = False) -> float:
            started = time.perf_counter()
            reply = await client.post("/search", json={"query": f"{WORDS[(k + i) % len(WORDS)]} study {i}",
                                                       "top_k": 10})
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
            ms = (time.perf_counter() - started) * 1000
            if during:  # where the time went: the batcher's queue, the model, the rest of the server, outside it
                parts.append((ms, *(float(reply.headers.get(h, "nan")) for h in ("X-Queue-Time", "X-Inference-Time",
                                                                                 "X-Total-Time"))))
            return ms

        async def idle_client(k: int) -> None:
            for i in range(args.idle // args.clients):
                idle.append(await search(k, i))

        await asyncio.gather(*(idle_client(k) for k in range(args.clients)))

        async def busy_client(k: int) -> None:
            await upserting.wait()
            i = 0
            while not done.is_set():  # each search issued while the upsert runs counts, however long it waits
                at = time.perf_counter() - upsert_started[0]
                during.append(await search(k, i, during=True))
                when.append((at, during[-1]))
                i += 1

        upsert_started = [time.perf_counter()]

        async def upsert() -> tuple[float, int]:
            upserting.set()
            started = upsert_started[0] = time.perf_counter()
            reply = await client.post("/documents", json={"documents": documents})
            seconds = time.perf_counter() - started
            done.set()
            return seconds, reply.status_code

        (seconds, status), *_ = await asyncio.gather(upsert(), *(busy_client(k) for k in range(args.clients)))
    slowest = sorted(when, key=lambda w: -w[1])[:5]  # where in the upsert the slowest searches started
    tail = sorted(parts)[-max(1, len(parts) // 100):]  # the slowest 1%: mean ms of each part
    split = {name: round(statistics.mean(t[j] for t in tail), 1) for j, name in
             enumerate(("latency", "queue", "inference", "server"))}
    return {"idle": quantiles(idle), "during": quantiles(during), "upsert_s": seconds, "upsert_status": status,
            "statuses": statuses, "slowest": [(round(at / seconds, 3), round(ms, 1)) for at, ms in slowest],
            "tail_split_ms": split}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-ref", default="458c5ec", help="commit before the fix (default: 458c5ec)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per side, alternated (default 2)")
    parser.add_argument("--model", default=None, help="embedding model (default: the bundled MiniLM)")
    parser.add_argument("--precision", default="auto", help="serve --precision (default auto)")
    parser.add_argument("--base", type=int, default=200, help="documents in the index before (default 200)")
    parser.add_argument("--documents", type=int, default=1000, help="documents of the upsert (default 1000)")
    parser.add_argument("--words", type=int, default=40, help="words per document (default 40)")
    parser.add_argument("--clients", type=int, default=2, help="searching clients (default 2)")
    parser.add_argument("--idle", type=int, default=100, help="idle searches before the upsert (default 100)")
    parser.add_argument("--ingest-batch-size", type=int, default=None, help="the after side's --ingest-batch-size "
                        "(default: the server's)")
    parser.add_argument("--output", default=None, help="append one JSON line per round here")
    args = parser.parse_args()

    from robustir.resources import default_model_path

    model = args.model or default_model_path()
    rows = []
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    with tempfile.TemporaryDirectory(prefix="upsert-search-") as tmp:
        work = Path(tmp)
        index = build_index(work, model, args.base, args.words, args.precision)
        sources = {"before": baseline_source(args.baseline_ref, work), "after": ROOT / "src"}
        for round_ in range(args.rounds):
            for side in ("before", "after"):
                copy = work / f"index-{side}-{round_}"
                shutil.copytree(index, copy)
                port = free_port()
                log = work / f"server-{side}-{round_}.log"
                more = ["--ingest-batch-size", str(args.ingest_batch_size)] if args.ingest_batch_size and side == "after" \
                    else []
                server = start_server(sources[side], copy, port, args.precision, log, more)
                try:
                    result = served_round(server, port, log, lambda url: load(url, args, round_))
                finally:
                    shutil.rmtree(copy, ignore_errors=True)
                idle, during = result["idle"], result["during"]
                result["ratio_p99"] = during["p99"] / idle["p99"]
                rows.append({"side": side, "round": round_, **result})
                print(f"round {round_} {side:6s}: idle p50 {idle['p50']:7.1f} p99 {idle['p99']:7.1f} ms (n {idle['n']})"
                      f" | during upsert p50 {during['p50']:8.1f} p99 {during['p99']:8.1f} max {during['max']:8.1f} ms"
                      f" (n {during['n']}) | p99 ratio {result['ratio_p99']:6.2f} | upsert {result['upsert_s']:5.1f} s"
                      f" ({result['upsert_status']}) | statuses {result['statuses']} | slowest (fraction of the upsert "
                      f"when issued, ms) {result['slowest']} | slowest 1% (mean ms): {result['tail_split_ms']}",
                      flush=True)
    print_sides(rows, {"idle p50 ms": lambda r: r["idle"]["p50"], "idle p99 ms": lambda r: r["idle"]["p99"],
                       "during p50 ms": lambda r: r["during"]["p50"], "during p99 ms": lambda r: r["during"]["p99"],
                       "p99 ratio": lambda r: r["ratio_p99"], "upsert s": lambda r: r["upsert_s"]})
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    append_rows(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
