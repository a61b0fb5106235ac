"""Encoding throughput: robustir's Encoder.encode vs SentenceTransformer.encode.

Same model, same texts, same max length, same batch size and thread count. Prints passages/s for
each side in fp32 and bf16 and the ratios, plus cosine agreement with sentence-transformers fp32.
Runs alternate (ours, theirs, ours, ...) so a busy machine slows both sides alike.

    python bench/encode.py [--n 1000] [--max-length 256] [--threads 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled all-MiniLM-L6-v2")
    parser.add_argument("--data", default=None, help="BEIR folder (default: bundled SciFact)")
    parser.add_argument("--n", type=int, default=1000, help="passages to encode")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from robustir.data.beir import load_corpus
    from robustir.models.encoder import Encoder
    from robustir.resources import dataset_path, default_model_path

    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    data = Path(args.data) if args.data else dataset_path("scifact")
    corpus_file = data / "corpus.jsonl" if (data / "corpus.jsonl").exists() else data / "corpus.jsonl.gz"
    corpus, _ = load_corpus(corpus_file)
    rng = np.random.default_rng(0)
    texts = [corpus.texts_for_encoding()[i] for i in rng.choice(len(corpus), size=min(args.n, len(corpus)), replace=False)]

    ours = Encoder.from_pretrained(model_path, passage_max_length=args.max_length)
    theirs = SentenceTransformer(str(model_path), device="cpu")
    theirs.max_seq_length = args.max_length

    def run_ours(bf16: bool) -> np.ndarray:
        return ours.encode(texts, "passage", batch_size=args.batch_size, bf16=bf16, show_progress=False)

    def run_theirs(bf16: bool) -> np.ndarray:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            return theirs.encode(texts, batch_size=args.batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)

    run_ours(False)[:1], run_theirs(False)[:1]  # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {k: [] for k in ("ours_fp32", "st_fp32", "ours_bf16", "st_bf16")}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, fn, bf16 in (("ours_fp32", run_ours, False), ("st_fp32", run_theirs, False),
                               ("ours_bf16", run_ours, True), ("st_bf16", run_theirs, True)):
            start = time.perf_counter()
            outputs[name] = fn(bf16)
            times[name].append(time.perf_counter() - start)
    rate = {k: len(texts) / min(v) for k, v in times.items()}  # best of repeats: least disturbed run
    reference = outputs["st_fp32"]
    cosine = {k: float((v * reference).sum(1).min()) for k, v in outputs.items()}
    print(f"model {args.model or 'all-MiniLM-L6-v2 (bundled)'}, {len(texts)} passages, max_length {args.max_length}, "
          f"batch {args.batch_size}, threads {args.threads}")
    print(f"{'run':12s}{'passages/s':>12s}{'min cos vs ST fp32':>22s}")
    for name in times:
        print(f"{name:12s}{rate[name]:12.1f}{cosine[name]:22.5f}")
    print(f"ratio robustir/ST fp32: {rate['ours_fp32'] / rate['st_fp32']:.2f}x")
    print(f"ratio robustir bf16 / ST fp32 (default ST.encode): {rate['ours_bf16'] / rate['st_fp32']:.2f}x "
          f"at cosine >= {cosine['ours_bf16']:.4f}")
    print(f"ratio robustir bf16 / ST under bf16 autocast: {rate['ours_bf16'] / rate['st_bf16']:.2f}x")


if __name__ == "__main__":
    main()
