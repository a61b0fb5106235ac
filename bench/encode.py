"""Encoding throughput: robustir's Encoder.encode vs SentenceTransformer.encode, or (``--null-model``) the input path.

Same model, same texts, same max length, same batch size and thread count. Prints passages/s for
each side in fp32 and bf16 and the ratios, plus cosine agreement with sentence-transformers fp32.
Runs alternate (ours, theirs, ours, ...) so a busy machine slows both sides alike.

    python bench/encode.py [--n 1000] [--max-length 256] [--threads 2] [--repeats 2]

``--null-model`` (issue 54): the transformer and the pooling are replaced by zeros -- what an infinitely fast
accelerator leaves -- and the texts/s of the input path before issue 54 (a copy of it below, from commit d3f3afd),
of the new one, and of the raw batched fast tokenizer (``tokenizer(batch, padding=True, truncation=True,
max_length=..., return_tensors="pt")`` on the same batches of ``--batch-size`` texts) are measured at each thread
count (torch threads, the tokenizer's parallelism, the new path's tokenizing threads), in alternated rounds
(the order rotates each round); the median and range of the rounds are printed, never the best round.

    python bench/encode.py --null-model [--n 2000] [--max-length 128] [--batch-size 64] [--rounds 7]
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
    parser.add_argument("--null-model", action="store_true", help="input path only: old vs new vs raw tokenizer")
    parser.add_argument("--rounds", type=int, default=7, help="--null-model: alternated rounds")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2], help="--null-model: thread counts")
    args = parser.parse_args()
    if args.null_model:
        return null_model_bench(args)

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


# ---------------------------------------------------------------------------------------------- --null-model


class NullTransformer(torch.nn.Module):
    """The forward replaced by zeros: hidden states of the right shape, no work (a broadcast view)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.zero = torch.zeros(1, 1, dim)

    def forward(self, input_ids, attention_mask=None, **_):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.zero.expand(input_ids.shape[0], input_ids.shape[1], -1))


def null_encoder(encoder):
    """``encoder`` with its transformer and its pooling replaced by zeros (both paths call these two)."""
    null = NullTransformer(encoder.dim)
    encoder._inference_transformer = lambda precision: null
    encoder.pool = lambda hidden, mask: hidden[:, 0]  # a view of the zeros: no (b, L, d) product
    return encoder


# The input path before issue 54, copied from src/robustir/models/encoder.py at commit d3f3afd (Encoder.encode,
# token_ids, encode_ids), unchanged except that ``self`` is an argument and the progress bar is gone.

def old_encode(self, texts, kind="passage", *, batch_size=64, precision="fp32", bf16=None, max_length=None,
               instruction=None):
    from robustir.models.encoder import ENCODE_BLOCK

    n = len(texts)
    out = np.zeros((n, self.dim), dtype=np.float32)
    if n == 0:
        return out
    limit = max_length or self.config.max_length(kind)
    block = ENCODE_BLOCK  # bound tokenizer memory on very large inputs
    for start in range(0, n, block):
        ids = old_token_ids(self, texts[start:start + block], kind, max_length=limit, instruction=instruction)
        out[start:start + len(ids)] = old_encode_ids(self, ids, batch_size=batch_size, precision=precision, bf16=bf16)
    return out


def old_token_ids(self, texts, kind="passage", *, max_length=None, instruction=None, tokenizer=None):
    from robustir.models.tokens import head_texts  # a long text is cut before it is tokenized (memory): same ids

    limit = max_length or self.config.max_length(kind)
    tokenizer = tokenizer or self.tokenizer
    texts = head_texts(tokenizer, self.config.with_instruction(texts, kind, instruction), limit)
    return tokenizer(texts, truncation=True, max_length=limit, padding=False, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


@torch.inference_mode()
def old_encode_ids(self, ids, *, batch_size=64, precision="fp32", bf16=None, on_batch=None, pad_to_multiple_of=None):
    out = np.zeros((len(ids), self.dim), dtype=np.float32)
    if not len(ids):
        return out
    was_training = self.training
    self.eval()
    device = self.device
    transformer = self._inference_transformer(self.resolve_precision(precision, bf16))
    order = np.argsort([-len(x) for x in ids], kind="stable")
    try:
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt",
                                       pad_to_multiple_of=pad_to_multiple_of)
            features = {k: v.to(device) for k, v in batch.items()}
            hidden = transformer(**features).last_hidden_state
            emb = self.pool(hidden.float(), features["attention_mask"])
            if self.config.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
            out[rows] = emb.cpu().numpy()
            if on_batch is not None:
                on_batch()
    finally:
        self.train(was_training)
    return out


def set_threads(threads: int) -> None:
    """torch's threads and the tokenizer's parallelism (read by the Rust tokenizer at each call)."""
    torch.set_num_threads(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def input_path_runs(encoder, texts: list[str], args) -> dict:
    """name -> (threads -> run): the three input paths, and the old and new ``encode_ids`` on ids made beforehand
    (what ``robustir serve`` runs on a shared batch: padding, copies, no tokenizing)."""
    batches = [texts[i:i + args.batch_size] for i in range(0, len(texts), args.batch_size)]

    def raw(threads):
        for batch in batches:
            encoder.tokenizer(batch, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")

    ids = encoder.token_ids(texts)  # the server's input: each request tokenized before it joins a batch
    return {"old": lambda threads: old_encode(encoder, texts, batch_size=args.batch_size),
            "new": lambda threads: encoder.encode(texts, batch_size=args.batch_size, show_progress=False,
                                                  tokenize_threads=threads),
            "raw tokenizer": raw,
            "old ids (serve)": lambda threads: old_encode_ids(encoder, ids, batch_size=args.batch_size),
            "new ids (serve)": lambda threads: encoder.encode_ids(ids, batch_size=args.batch_size)}


def null_model_bench(args) -> None:
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path

    texts = bench_texts(args)
    encoder = null_encoder(Encoder.from_pretrained(args.model or default_model_path(),
                                                   passage_max_length=args.max_length))
    np.testing.assert_array_equal(old_encode(encoder, texts[:300]), encoder.encode(texts[:300]))  # same output
    runs = input_path_runs(encoder, texts, args)
    cells = [(name, t) for t in args.thread_counts for name in runs]
    for name, threads in cells:  # warm-up: allocator, tokenizer caches, thread pools
        set_threads(threads)
        runs[name](threads)
    rates: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    for r in range(args.rounds):
        for name, threads in cells[r % len(cells):] + cells[:r % len(cells)]:  # alternated: the order rotates
            set_threads(threads)
            start = time.perf_counter()
            runs[name](threads)
            rates[name, threads].append(len(texts) / (time.perf_counter() - start))
    print_null_model_table(args, texts, rates)
    share = float(np.median([tokenizer_share(encoder, texts, args) for _ in range(3)]))
    print(f"new path at 1 thread: {share:.1%} of the time inside the Rust tokenizer calls (the part threads share; "
          f"the rest holds the GIL): Amdahl's bound at 2 threads {1 / ((1 - share) + share / 2):.2f}x")


class _Timed:
    """A tokenizer backend whose ``encode_batch_fast`` calls add their wall time to ``spent``."""

    def __init__(self, real, spent: list[float]) -> None:
        self.real, self.spent = real, spent

    def encode_batch_fast(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.real.encode_batch_fast(*args, **kwargs)
        finally:
            self.spent[0] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.real, name)


def tokenizer_share(encoder, texts: list[str], args) -> float:
    """The share of the new path's time (1 thread) spent inside the fast tokenizer's Rust calls (no GIL held)."""
    fast = encoder._fast_tokens[(id(encoder.tokenizer), args.max_length)][1]
    real, spent = (fast.backend, fast.counter), [0.0]
    fast.backend, fast.counter = _Timed(real[0], spent), _Timed(real[1], spent)
    set_threads(1)
    try:
        start = time.perf_counter()
        encoder.encode(texts, batch_size=args.batch_size, show_progress=False, tokenize_threads=1)
        return spent[0] / (time.perf_counter() - start)
    finally:
        fast.backend, fast.counter = real


def bench_texts(args) -> list[str]:
    from robustir.data.beir import load_corpus
    from robustir.resources import dataset_path

    data = Path(args.data) if args.data else dataset_path("scifact")
    corpus_file = data / "corpus.jsonl" if (data / "corpus.jsonl").exists() else data / "corpus.jsonl.gz"
    corpus, _ = load_corpus(corpus_file)
    return corpus.texts_for_encoding()[:args.n]


def print_null_model_table(args, texts: list[str], rates: dict) -> None:
    import platform

    median = {cell: float(np.median(v)) for cell, v in rates.items()}
    print(f"null model, {len(texts)} passages, max_length {args.max_length}, batch {args.batch_size}, "
          f"{args.rounds} alternated rounds, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus")
    print(f"{'path':18s}{'threads':>8s}{'texts/s median':>16s}{'range':>20s}{'x raw':>8s}{'x 1 thread':>12s}")
    for (name, threads), values in rates.items():
        raw = median["raw tokenizer", threads]
        one = median.get((name, min(args.thread_counts)), median[name, threads])
        print(f"{name:18s}{threads:8d}{median[name, threads]:16.0f}{min(values):10.0f} - {max(values):<8.0f}"
              f"{median[name, threads] / raw:8.2f}{median[name, threads] / one:12.2f}")
    print(f"load average after the run: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
