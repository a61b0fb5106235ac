"""Load test: ``robustir serve`` against a naive FastAPI server that calls ``SentenceTransformer.encode`` per request.

Both servers are started by this script on 127.0.0.1 (separate processes, the same model on the CPU, each with its
own default threading); a bounded load -- ``--clients`` concurrent clients sending ``--requests`` requests of ``--texts``
short texts each (SciFact queries) -- goes to one server at a time, alternating rounds (robustir, baseline,
robustir, ...) so a busy machine slows both alike. Prints throughput (texts/s) and p50/p99 request latency per side
and the ratios, texts per CPU-second of each server process (its own CPU time, which other jobs on a shared machine
disturb far less than wall time), and checks that both return the same vectors (cosine).

The baseline is what a first attempt looks like: a ``def`` endpoint (FastAPI runs it in its thread pool, so
concurrent requests run ``encode`` side by side) that encodes the request's texts with ``normalize_embeddings=True``.

    python bench/serve.py [--clients 32] [--requests 160] [--texts 4] [--rounds 4] [--robustir-args=--bf16]
    python bench/serve.py --robustir-args="--workers 1" --vs-robustir-args="--workers 2"   # two robustir settings

With ``--vs-robustir-args`` the "baseline" side is a second ``robustir serve`` with those flags instead of the naive
server (the same alternating rounds), to compare two settings of robustir under the same load.
    python bench/serve.py --baseline-server --port 8001 --model M     # (used by the script itself)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


# ------------------------------------------------------------------------------------------------ the baseline

def baseline_server(model: str, port: int) -> None:
    """The naive server: FastAPI + SentenceTransformer.encode per request, in FastAPI's thread pool."""
    import uvicorn
    from fastapi import Body, FastAPI
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(body: dict = Body(...)):
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = st.encode(texts, normalize_embeddings=True)
        return {"object": "list", "model": body.get("model"),
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ------------------------------------------------------------------------------------------------ the load

def http_client():
    """The HTTP client the installed openai package uses: httpx2 (openai >= 3) or httpx."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    httpx = http_client()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server for {url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server {url} did not start in {timeout:.0f} s")


async def load(url: str, batches: list[list[str]], clients: int) -> dict:
    """Send every batch once with ``clients`` concurrent clients; latency per request, wall time overall."""
    httpx = http_client()

    queue: asyncio.Queue = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client) -> None:
        nonlocal errors
        while True:
            try:
                batch = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            reply = await client.post("/v1/embeddings", json={"input": batch, "model": "m", "encoding_format": "float"})
            latencies.append(time.perf_counter() - start)
            if reply.status_code != 200 and reply.status_code != 404:
                errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    texts = sum(len(b) for b in batches)
    latencies.sort()
    return {"wall_s": wall, "texts_per_s": texts / wall, "requests_per_s": len(batches) / wall,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))],
            "errors": errors}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vectors(url: str, texts: list[str], model: str):
    """The embeddings a server returns for ``texts`` (float32 rows)."""
    httpx = http_client()
    import numpy as np

    reply = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "model": model, "encoding_format": "float"},
                       timeout=120).json()
    return np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=160, help="requests per round")
    parser.add_argument("--texts", type=int, default=4, help="texts per request")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side (alternating)")
    parser.add_argument("--robustir-args", default="",
                        help="extra flags for robustir serve, e.g. --robustir-args=--bf16 (with '=': the value starts "
                             "with -)")
    parser.add_argument("--vs-robustir-args", default=None,
                        help="make the baseline a second robustir serve with these flags, e.g. "
                             "--vs-robustir-args='--workers 2'")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from robustir.resources import dataset_path, default_model_path

    model = args.model or default_model_path()
    if args.baseline_server:
        baseline_server(model, args.port)
        return

    import numpy as np

    from robustir.data.beir import load_queries

    queries, _ = load_queries(dataset_path("scifact") / "queries.jsonl")
    pool = list(queries.values())
    rng = np.random.default_rng(0)
    batches = [[pool[i] for i in rng.choice(len(pool), size=args.texts, replace=False)] for _ in range(args.requests)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ports = {"robustir": free_port(), "baseline": free_port()}
    commands = {
        "robustir": [sys.executable, "-m", "robustir.cli.main", "serve", "--model", model, "--device", "cpu",
                     "--port", str(ports["robustir"]), "--served-model-name", "m", *shlex.split(args.robustir_args)],
        "baseline": [sys.executable, __file__, "--baseline-server", "--model", model, "--port", str(ports["baseline"])],
    }
    if args.vs_robustir_args is not None:
        commands["baseline"] = [sys.executable, "-m", "robustir.cli.main", "serve", "--model", model, "--device", "cpu",
                                "--port", str(ports["baseline"]), "--served-model-name", "m",
                                *shlex.split(args.vs_robustir_args)]
    processes = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for name, cmd in commands.items()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    results: dict[str, list[dict]] = {"robustir": [], "baseline": []}
    try:
        for name in processes:
            wait_ready(urls[name], processes[name])
        probe = pool[:8]
        ours, theirs = vectors(urls["robustir"], probe, "m"), vectors(urls["baseline"], probe, "m")
        cosine = float(((ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)).min())
        warm = batches[: args.clients]
        for name in results:  # warm-up: first requests pay for lazy initialisation
            asyncio.run(load(urls[name], warm, args.clients))
        for round_ in range(args.rounds):
            for name in ("robustir", "baseline") if round_ % 2 == 0 else ("baseline", "robustir"):
                cpu = cpu_seconds(processes[name].pid)
                figures = asyncio.run(load(urls[name], batches, args.clients))
                figures["server_cpu_s"] = cpu_seconds(processes[name].pid) - cpu
                figures["texts_per_cpu_s"] = len(batches) * args.texts / max(figures["server_cpu_s"], 1e-9)
                figures["load_average"] = os.getloadavg()[0]
                results[name].append(figures)
                print(f"round {round_ + 1} {name:9s} {figures['texts_per_s']:8.1f} texts/s  p50 "
                      f"{figures['p50_ms']:7.0f} ms  p99 {figures['p99_ms']:7.0f} ms  ({figures['wall_s']:.1f} s, "
                      f"server CPU {figures['server_cpu_s']:.1f} s = {figures['texts_per_cpu_s']:.1f} texts/CPU-s, "
                      f"load {figures['load_average']:.1f}, {figures['errors']} errors)", flush=True)
        httpx = http_client()

        batching = httpx.get(f"{urls['robustir']}/health").json()["batching"]
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    best = {name: max(rows, key=lambda r: r["texts_per_s"]) for name, rows in results.items()}
    ratio = best["robustir"]["texts_per_s"] / best["baseline"]["texts_per_s"]
    p99_ratio = best["robustir"]["p99_ms"] / best["baseline"]["p99_ms"]
    print()
    print(f"{args.clients} clients x {args.requests} requests x {args.texts} texts, best of {args.rounds} rounds; "
          f"robustir serve {' '.join(commands['robustir'][5:])}; baseline: "
          f"{' '.join(commands['baseline'][5:]) if args.vs_robustir_args is not None else 'naive FastAPI + ST'}")
    efficiency = {name: statistics.median(r["texts_per_cpu_s"] for r in rows) for name, rows in results.items()}
    print(f"{'server':10s} {'texts/s':>9s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'texts/CPU-s':>12s}")
    for name, row in best.items():
        print(f"{name:10s} {row['texts_per_s']:9.1f} {row['requests_per_s']:8.1f} {row['p50_ms']:8.0f} "
              f"{row['p99_ms']:8.0f} {efficiency[name]:12.1f}")
    print(f"throughput robustir / baseline = {ratio:.2f}x; p99 robustir / baseline = {p99_ratio:.2f}x; "
          f"texts per server CPU-second (median) robustir / baseline = "
          f"{efficiency['robustir'] / efficiency['baseline']:.2f}x; min cosine robustir vs baseline = {cosine:.6f}")
    print(f"robustir batching: {batching}")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results, "best": best,
                                                 "throughput_ratio": ratio, "p99_ratio": p99_ratio,
                                                 "texts_per_cpu_s": efficiency,
                                                 "min_cosine": cosine, "batching": batching}, indent=2))


if __name__ == "__main__":
    main()
