"""Idle connections against the HTTP server (issue 35's hang): plain uvicorn against robustir's guarded server.

Each side serves a trivial FastAPI app in a child process whose open-file limit is ``--limit`` (soft = hard, so the
guard cannot raise it); the client opens ``--idle`` connections that never send a byte, then makes one real request
and reports whether it was answered and in how long, and how many tracebacks the server logged. Both sides run in
the same call, alternated ``--rounds`` times.

    python bench/idle_connections.py --limit 256 --idle 300 --rounds 3
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SERVER = r'''
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), int(sys.argv[3])))
from fastapi import FastAPI
app = FastAPI()
@app.get("/ping")
def ping():
    return {"ok": True}
if sys.argv[1] == "uvicorn":
    import uvicorn
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="info")
else:
    from robustir.serving.connections import GuardedServer, guarded_config
    GuardedServer(guarded_config(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="info")).run()
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one(side: str, limit: int, idle: int, settle: float) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as handle:
            server = subprocess.Popen([sys.executable, "-c", SERVER, side, str(port), str(limit)], stdout=handle,
                                      stderr=subprocess.STDOUT)
        try:
            for _ in range(200):  # until it listens
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            socks = []
            for _ in range(idle):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                except OSError:
                    break
            started = time.perf_counter()
            try:
                answered = urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10).status == 200
            except Exception:  # noqa: BLE001 - a hang or a refusal is the measurement
                answered = False
            seconds = time.perf_counter() - started
            time.sleep(settle)  # what the server logs while the idle sockets stay open
            for sock in socks:
                sock.close()
        finally:
            server.kill()
            server.wait()
        text = log.read_bytes()
    return {"side": side, "opened": len(socks), "answered": answered, "seconds": seconds,
            "tracebacks": text.count(b"Traceback"), "log_bytes": len(text)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=256, help="open-file limit of the server process")
    parser.add_argument("--idle", type=int, default=300, help="idle connections opened before the real request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds the idle sockets stay open afterwards")
    args = parser.parse_args()
    rows = []
    for round_ in range(args.rounds):
        for side in (("uvicorn", "guarded") if round_ % 2 == 0 else ("guarded", "uvicorn")):
            row = one(side, args.limit, args.idle, args.settle)
            rows.append(row)
            print(row, flush=True)
    print(f"\n{args.idle} idle connections, open-file limit {args.limit}, {args.rounds} alternated rounds "
          "(median [min-max]):")
    for side in ("uvicorn", "guarded"):
        mine = [r for r in rows if r["side"] == side]
        secs = [r["seconds"] for r in mine]
        tbs = [r["tracebacks"] for r in mine]
        print(f"  {side:8s} answered {sum(r['answered'] for r in mine)}/{len(mine)}, request "
              f"{statistics.median(secs):.2f} s [{min(secs):.2f}-{max(secs):.2f}], tracebacks logged "
              f"{statistics.median(tbs):.0f} [{min(tbs)}-{max(tbs)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
