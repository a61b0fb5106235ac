"""Where one request's time goes in ``robustir serve``: a sequential client against a fresh server.

Starts ``robustir serve`` (fp32, bundled model, 127.0.0.1) in a subprocess, sends 80 requests of the same 4 SciFact
queries one after another (the first 10 are warm-up) and prints the medians of the client's round trip and of the
server's own headers: ``X-Total-Time`` (first byte to answer headers), ``X-Queue-Time`` (wait for a model worker) and
``X-Inference-Time`` (the batch's forward pass). A client round trip far above ``X-Total-Time`` means time lost in
the network stack (e.g. TCP delayed ACKs), not in the app.

    python bench/serve_rtt.py [extra robustir serve flags]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

TEXTS = ["0-dimensional biomaterials show inductive properties.", "1 in 5 million in UK have abnormal PrP positivity.",
         "1/2000 in UK have abnormal PrP positivity.", "5% of perinatal mortality is due to low birth weight."]


def main() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "robustir.cli.main", "serve", "--port", str(port), "--precision",
                             "fp32", *sys.argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        rows = []
        with httpx.Client(base_url=url) as client:
            for _ in range(80):
                start = time.perf_counter()
                reply = client.post("/v1/embeddings", json={"input": TEXTS})
                took = (time.perf_counter() - start) * 1000
                h = reply.headers
                rows.append((took, float(h["x-total-time"]), float(h["x-queue-time"]), float(h["x-inference-time"])))
    finally:
        proc.terminate()
        proc.wait()
    median = np.median(np.array(rows[10:]), axis=0)
    print("p50 ms: client round trip %.2f, server total %.2f, queue %.2f, inference %.2f" % tuple(median))


if __name__ == "__main__":
    main()
