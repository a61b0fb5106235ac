"""Server memory over many requests of varied sizes (issue 35): ``robustir serve`` as it is (each forward pass padded to
a multiple of 16 tokens) against ``--pad-to-multiple-of 1`` (padded to the longest text only, as before), at each
precision.

Each side is a ``robustir serve`` process on 127.0.0.1 with the bundled MiniLM; ``--clients`` threads send ``--requests``
``/v1/embeddings`` requests, each of 1-8 texts of 1-60 words (seeded: every side gets the same requests, queries
and passages alternating), and the server's RSS (``/proc/PID/statm``) is read every tenth of the run. Sides run one
after the other, padded and unpadded alternated. Printed: RSS after the first tenth (warm-up), at the half and at
the end, the growth from warm-up to end, and requests/s.

    python bench/serve_memory.py [--requests 10000] [--precisions fp32,bf16]
    python bench/serve_memory.py --requests 3000 --precisions bf16 --other-pad 8   # 16 against a multiple of 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

WORDS = ("aspirin statins cholesterol vitamin bone sleep exercise coffee caffeine obesity children heart attack risk "
         "study trial patients reduced increased blood pressure cells protein gene expression cancer tumour therapy "
         "dose placebo randomized cohort mortality").split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_side(precision: str, bounded: bool, requests: int, seed: int, clients: int, other_pad: int = 1) -> dict:
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "robustir.cli.main", "serve", "--port", str(port), "--precision", precision]
    if not bounded:
        argv += ["--pad-to-multiple-of", str(other_pad)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            for _ in range(600):
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            else:
                raise RuntimeError("the server did not start")
            rng = random.Random(seed)
            bodies = [{"input": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
                                 for _ in range(rng.randint(1, 8))],
                       "model": "all-MiniLM-L6-v2", "input_type": "query" if i % 2 else "document"}
                      for i in range(requests)]

            def send(body: dict) -> None:
                reply = client.post("/v1/embeddings", json=body)
                if reply.status_code != 200:
                    raise RuntimeError(f"{reply.status_code} {reply.text[:200]}")

            marks = []
            tenth = max(1, requests // 10)
            started = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                for start in range(0, requests, tenth):
                    list(pool.map(send, bodies[start:start + tenth]))
                    marks.append(round(rss_mb(server.pid)))
            seconds = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"precision": precision, "bounded": bounded, "pad": 16 if bounded else other_pad, "rss_mb": marks,
            "requests": requests, "requests_per_s": round(requests / seconds, 1), "clients": clients}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients (threads)")
    parser.add_argument("--out", help="append each side's row to this JSONL file")
    parser.add_argument("--other-pad", type=int, default=1,
                        help="the other side's --pad-to-multiple-of (default 1: the longest text only)")
    args = parser.parse_args()
    rows = []
    for precision in args.precisions.split(","):
        for bounded in (True, False):
            row = run_side(precision, bounded, args.requests, args.seed, args.clients, args.other_pad)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
    print(f"\n{'precision':>9} {'padding':>9} {'warm-up MB':>10} {'half MB':>8} {'end MB':>7} {'growth MB':>9} {'req/s':>6}")
    for row in rows:
        marks = row["rss_mb"]
        padding = "longest" if row["pad"] == 1 else str(row["pad"])
        print(f"{row['precision']:>9} {padding:>9} {marks[0]:>10} {marks[len(marks) // 2 - 1]:>8} "
              f"{marks[-1]:>7} {marks[-1] - marks[0]:>9} {row['requests_per_s']:>6}")


if __name__ == "__main__":
    main()
