"""Embedding latency under concurrent cross-encoder reranks, before and after issue 52's fix, in one run.

    python bench/rerank_load.py --rounds 1                       # one round each side: ~1.5 min on 2 cores
    python bench/rerank_load.py --rounds 5 --documents 400 --output docs/results/rerank_load.jsonl

Issue 52, item 3: a cross-encoder's rerank ran on the model's worker thread beside the batcher's queue, so a 1-text
``/v1/embeddings`` waited behind every rerank that had started (51.8 s behind six 1,000-document reranks) while
``queued_texts`` read 0, with no 429/503 and no 499. Since the fix a rerank's pairs go through the same queue in
micro-batches of one forward pass that take turns with embedding batches.

Each round starts ``robustir serve`` on 127.0.0.1 (a free port; nothing else is reached) in a subprocess: "before"
runs the source of ``--baseline-ref`` (``git archive`` of that commit into a temporary folder, so the old behaviour
stays reachable without a switch in the product), "after" this checkout's ``src``. The served models are made here
(a random BERT embedding model and a one-label cross-encoder with MiniLM's tokenizer, ``--hidden`` wide,
``--layers`` deep) so the figures depend on sizes, not on downloads. The load is bounded: ``--reranks`` clients each
send ``--rerank-requests`` reranks of ``--documents`` documents (``--words`` words each), and one client sends
1-text embeddings one after another while any rerank runs (at most ``--max-embeddings``). The rounds alternate
before / after. Printed: per round the embedding latency (median, p99, max), the embeddings served, the reranks'
pairs per second and the status codes; then the median and range over the rounds of each side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing

import httpx  # noqa: E402

WORDS = ("heart blood sleep memory coffee bone calcium protein cell gene study trial patient dose risk effect "
         "cancer brain muscle vitamin").split()


def make_models(folder: Path, hidden: int, layers: int) -> tuple[str, str]:
    """A random BERT embedding model (mean pooling) and a one-label cross-encoder, with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    from robustir.resources import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = dict(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden, max_position_embeddings=512)
    torch.manual_seed(0)
    embedder, reranker = folder / "embedder", folder / "cross-encoder"
    BertModel(BertConfig(**config)).save_pretrained(embedder)
    BertForSequenceClassification(BertConfig(**config, num_labels=1)).save_pretrained(reranker)
    for out in (embedder, reranker):
        tokenizer.save_pretrained(out)
    return str(embedder), str(reranker)


def baseline_source(ref: str, folder: Path) -> Path:
    """``src`` of commit ``ref``, extracted with ``git archive`` (no worktree, nothing changed in the repository)."""
    archive = folder / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), ref, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "baseline", filter="data")
    return folder / "baseline" / "src"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(src: Path, embedder: str, reranker: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "robustir.cli.main", "serve", "--model", embedder, "--rerank-model", reranker,
               "--host", "127.0.0.1", "--port", str(port), "--precision", "fp32", "--pooling", "mean"]
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, server: subprocess.Popen, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {seconds:.0f} s")


async def load(url: str, args: argparse.Namespace) -> dict:
    documents = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(args.words))
                 for i in range(args.documents)]
    embed_ms: list[float] = []
    statuses: dict[str, dict[int, int]] = {"embed": {}, "rerank": {}}
    reranks_running = asyncio.Event()
    remaining = [args.reranks]
    pairs_done = [0]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        await client.post("/v1/embeddings", json={"input": "warm up"})
        await client.post("/v1/rerank", json={"query": "warm up", "documents": documents[:4]})

        async def reranker(k: int) -> None:
            try:
                for r in range(args.rerank_requests):
                    reranks_running.set()
                    reply = await client.post("/v1/rerank", json={"query": f"{WORDS[k]} {WORDS[r]} study",
                                                                  "documents": documents})
                    statuses["rerank"][reply.status_code] = statuses["rerank"].get(reply.status_code, 0) + 1
                    if reply.status_code == 200:
                        pairs_done[0] += len(documents)
            finally:
                remaining[0] -= 1

        async def embedder() -> None:
            await reranks_running.wait()
            for i in range(args.max_embeddings):
                if remaining[0] == 0:
                    break
                started = time.perf_counter()
                reply = await client.post("/v1/embeddings", json={"input": f"{WORDS[i % len(WORDS)]} query {i}",
                                                                  "input_type": "query"})
                embed_ms.append((time.perf_counter() - started) * 1000)
                statuses["embed"][reply.status_code] = statuses["embed"].get(reply.status_code, 0) + 1

        started = time.perf_counter()
        await asyncio.gather(embedder(), *(reranker(k) for k in range(args.reranks)))
        seconds = time.perf_counter() - started
    ordered = sorted(embed_ms)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")
    return {"embed_median_ms": statistics.median(ordered) if ordered else float("nan"), "embed_p99_ms": p99,
            "embed_max_ms": ordered[-1] if ordered else float("nan"), "embeddings": len(ordered),
            "rerank_pairs_per_s": pairs_done[0] / seconds, "seconds": seconds, "statuses": statuses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-ref", default="d3f3afd", help="commit before the fix (default: d3f3afd)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternated (default 3)")
    parser.add_argument("--reranks", type=int, default=6, help="concurrent rerank clients (default 6)")
    parser.add_argument("--rerank-requests", type=int, default=2, help="reranks each client sends (default 2)")
    parser.add_argument("--documents", type=int, default=200, help="documents per rerank (default 200)")
    parser.add_argument("--words", type=int, default=60, help="words per document (default 60)")
    parser.add_argument("--max-embeddings", type=int, default=2000, help="embeddings sent at most per round")
    parser.add_argument("--hidden", type=int, default=256, help="width of the made models (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the made models (default 4)")
    parser.add_argument("--output", default=None, help="append one JSON line per round here")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="rerank-load-") as tmp:
        work = Path(tmp)
        embedder, reranker = make_models(work, args.hidden, args.layers)
        sources = {"before": baseline_source(args.baseline_ref, work), "after": ROOT / "src"}
        for round_ in range(args.rounds):
            for side in ("before", "after"):
                port = free_port()
                log = work / f"server-{side}-{round_}.log"
                server = start_server(sources[side], embedder, reranker, port, log)
                result = served_round(server, port, log, lambda url: load(url, args))
                row = {"side": side, "round": round_, **result}
                rows.append(row)
                print(f"round {round_} {side:6s}: embedding median {result['embed_median_ms']:8.1f} ms, p99 "
                      f"{result['embed_p99_ms']:8.1f} ms, max {result['embed_max_ms']:8.1f} ms over "
                      f"{result['embeddings']:4d}; reranks {result['rerank_pairs_per_s']:6.0f} pairs/s; statuses "
                      f"{result['statuses']}", flush=True)
    print_sides(rows, {key: (lambda r, key=key: r[key]) for key in ("embed_median_ms", "embed_p99_ms",
                                                                     "rerank_pairs_per_s")})
    append_rows(args, rows)
    return 0


def served_round(server: subprocess.Popen, port: int, log: Path, run) -> dict:
    """``run(url)`` (a coroutine) against ``server`` once it answers /health; the server is stopped after (its log's
    tail printed when the round fails)."""
    try:
        wait_ready(f"http://127.0.0.1:{port}", server)
        return asyncio.run(run(f"http://127.0.0.1:{port}"))
    except Exception:
        print(log.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def print_sides(rows: list[dict], columns: dict) -> None:
    """Per side (before, after) and column (``{name: row -> value}``): the median and range over the rounds."""
    print()
    for side in ("before", "after"):
        mine = [r for r in rows if r["side"] == side]
        for name, get in columns.items():
            values = [get(r) for r in mine]
            print(f"{side:6s} {name:20s} median {statistics.median(values):9.2f}  range {min(values):9.2f} - "
                  f"{max(values):9.2f}")


def append_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    """One JSON line per round, with the machine and the settings, appended to ``args.output`` (if given)."""
    if args.output:
        meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "settings": {k: v for k, v in vars(args).items() if k != "output"}}
        with open(args.output, "a", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
