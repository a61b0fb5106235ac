"""Memory-bounded losses: peak memory and time of one loss forward+backward, whole batch vs row blocks.

For each batch size (queries; passages = queries x group: 1 positive + group-1 hard negatives, all in-batch),
each loss (InfoNCE, PEG in training mode, CCR) and each mode -- ``whole`` (block_rows = all rows: the
(queries x passages) score matrix and its softmax intermediates exist at once) and ``blocked`` (block_rows =
--block-rows, the checkpointed blocks of robustir.losses.base.blocked_sum) -- a fresh subprocess builds random
float32 CPU embeddings and runs the loss's forward and backward. Reported: the increase of the process's peak
RSS over its RSS just before the loss (one run in its own process, VmHWM reset through /proc/self/clear_refs
where allowed, glibc's mmap threshold pinned at 64 KiB so that freed tensors leave the RSS), the wall time
(another process, default allocator: one full-size warm-up run, then the best of --repeats), and blocked /
whole ratios. The two modes' loss values are checked to agree. A whole-batch run whose estimated peak exceeds
--max-gb is skipped (and its ratios with it).

    python bench/loss_memory.py [--sizes 1024,4096] [--group 6] [--dim 384] [--block-rows 256] [--threads 1]

16,384 queries x 6 is a 1.6e9-score matrix (6.4 GB per float32 copy): the whole batch does not fit in 8 GB,
the blocked run does but takes minutes on a CPU (--sizes 16384).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
#: float32 (queries x passages) matrices alive at the whole-batch peak, for the --max-gb skip (measured: 6-9)
WHOLE_MATRICES = 10


def _rss_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


def child(what: str, queries: int, group: int, dim: int, loss_name: str, block_rows: int, threads: int,
          repeats: int) -> None:
    """One measurement (``what``: "memory" or "time") in this fresh process; prints one JSON line."""
    import torch

    sys.path.insert(0, str(SRC))
    from robustir.losses import ContrastiveBatch, get_loss

    torch.set_num_threads(threads)

    def inputs(b: int, block: int) -> ContrastiveBatch:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, dim, generator=g)
        p = q + torch.randn(b, dim, generator=g)  # positives near their query
        n = q.unsqueeze(1) + 1.2 * torch.randn(b, group - 1, dim, generator=g)
        batch = ContrastiveBatch.from_groups(*(x.requires_grad_() for x in (q, p, n)))
        batch.block_rows = block
        return batch

    def run(batch: ContrastiveBatch) -> tuple[float, float]:
        loss = get_loss(loss_name).train()
        start = time.perf_counter()
        out = loss(batch)
        out.loss.backward()
        return time.perf_counter() - start, float(out.loss.detach())

    run(inputs(64, 16))  # warm-up: thread pool, lazy imports
    batch = inputs(queries, block_rows)
    if what == "time":
        run(batch)  # full-size warm-up (allocator)
        seconds, value = min(run(inputs(queries, block_rows)) for _ in range(max(repeats, 1)))
        print(json.dumps({"seconds": seconds, "loss": value}))
        return
    rss_before = _rss_bytes("VmRSS") or 0
    reset = _reset_peak()
    seconds, value = run(batch)
    peak = _rss_bytes("VmHWM") if reset else None
    if peak is None:  # no VmHWM reset: the process-lifetime maximum (an upper bound)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_increase": max(peak - rss_before, 0), "loss": value, "peak_reset": reset}))


def _child_run(args: argparse.Namespace, what: str, queries: int, loss_name: str, block_rows: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if what == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "--child", what, str(queries), str(args.group), str(args.dim), loss_name,
           str(block_rows), str(args.threads), str(args.repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, queries: int, loss_name: str, block_rows: int) -> dict:
    memory = _child_run(args, "memory", queries, loss_name, block_rows)
    timing = _child_run(args, "time", queries, loss_name, block_rows)
    return {**memory, "seconds": timing["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096", help="comma-separated numbers of queries")
    parser.add_argument("--group", type=int, default=6, help="passages per query (1 positive + hard negatives)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--losses", default="infonce,peg,ccr")
    parser.add_argument("--block-rows", type=int, default=256, help="rows per block in the blocked mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (the box is shared)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up (best is kept)")
    parser.add_argument("--max-gb", type=float, default=8.0, help="skip whole-batch runs estimated above this")
    parser.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, q, g, d, name, block, threads, repeats = args.child
        child(what, int(q), int(g), int(d), name, int(block), int(threads), int(repeats))
        return

    sys.path.insert(0, str(SRC))
    from robustir.losses.base import resolve_block_rows

    mb = 1 << 20
    print(f"loss forward+backward, CPU float32, dim {args.dim}, {args.group} passages per query (all in-batch), "
          f"{args.threads} thread(s); blocked = block_rows {args.block_rows}")
    header = (f"{'queries':>8} {'passages':>9} {'loss':>8} {'auto rows':>9} {'whole MB':>9} {'blocked MB':>10} "
              f"{'mem ratio':>9} {'whole s':>8} {'blocked s':>9} {'time ratio':>10}")
    print(header)
    print("-" * len(header))
    for queries in (int(s) for s in args.sizes.split(",")):
        passages = queries * args.group
        whole_gb = WHOLE_MATRICES * 4 * queries * passages / 1e9
        for name in args.losses.split(","):
            blocked = measure(args, queries, name, args.block_rows)
            whole = measure(args, queries, name, queries) if whole_gb <= args.max_gb else None
            if whole is not None:
                rel = abs(whole["loss"] - blocked["loss"]) / max(abs(whole["loss"]), 1e-12)
                assert rel < 1e-5, f"{name} at {queries}: whole {whole['loss']} != blocked {blocked['loss']}"

            def fmt(value, spec):
                return "skipped" if value is None else format(value, spec)

            w_mb = None if whole is None else whole["peak_increase"] / mb
            b_mb = blocked["peak_increase"] / mb
            w_s = None if whole is None else whole["seconds"]
            print(f"{queries:>8} {passages:>9} {name:>8} {resolve_block_rows(queries, passages):>9} "
                  f"{fmt(w_mb, '9.0f'):>9} {b_mb:>10.0f} "
                  f"{fmt(None if w_mb is None else b_mb / max(w_mb, 1e-9), '9.3f'):>9} "
                  f"{fmt(w_s, '8.2f'):>8} {blocked['seconds']:>9.2f} "
                  f"{fmt(None if w_s is None else blocked['seconds'] / w_s, '10.2f'):>10}", flush=True)
    print(f"(whole runs estimated above {args.max_gb:g} GB are skipped: ~{WHOLE_MATRICES} float32 "
          "queries x passages matrices)")


if __name__ == "__main__":
    main()
