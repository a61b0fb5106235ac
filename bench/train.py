"""Training throughput and GradCache memory.

1. pairs/s of robustir's training step (batch engine + AdamW) vs sentence-transformers'
   MultipleNegativesRankingLoss step with the same model, batch, hard negatives, max lengths and
   threads; and the overhead of the PEG and CCR losses over InfoNCE. Steps alternate between the
   systems so machine noise hits both alike; the median step time is used.
2. Peak memory (max RSS of a fresh process) of a GradCache step at batch 64 vs batch 4096 (same chunk
   size), printed as a ratio.

    python bench/train.py [--batch 32] [--query-length 64] [--passage-length 256] [--steps 3]
    python bench/train.py --memory-only --memory-batches 64 4096 --chunk 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch


def load_groups(n: int, seed: int = 0):
    """(query, positive, negative) triples from SciFact train with BM25 negatives, cycled to n."""
    import random

    from robustir.data.training_data import examples_from_beir
    from robustir.resources import dataset_path

    examples = examples_from_beir(dataset_path("scifact"), "train")
    rng = random.Random(seed)
    pool = [p for e in examples for p in e.pos]
    triples = [(e.query, e.pos[0], rng.choice(pool)) for e in examples]
    return [triples[i % len(triples)] for i in range(n)]


def robustir_step_fn(model_path: str, loss_name: str, args, chunk: int | None = None):
    from robustir.losses import get_loss
    from robustir.models.encoder import Encoder
    from robustir.training.batch_engine import BatchEngine
    from robustir.training.data import Group, collate

    encoder = Encoder.from_pretrained(model_path, query_max_length=args.query_length,
                                      passage_max_length=args.passage_length)
    encoder.train()
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=2e-5)
    options = {"temperature": 0.05} if loss_name != "peg" else {}
    engine = BatchEngine(get_loss(loss_name, **options), chunk_size=chunk)

    def step(triples):
        groups = [Group(q, None, [p, n]) for q, p, n in triples]
        q, p, ids, _ = collate(groups, encoder, args.query_length, args.passage_length)
        engine.step(encoder, q, p, 1, passage_ids=ids)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def st_step_fn(model_path: str, args):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(str(model_path), device="cpu")
    model.train()
    loss = MultipleNegativesRankingLoss(model)  # scale 20 = temperature 0.05
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

    def tokenize(texts, length):
        model.max_seq_length = length
        return model.tokenize(texts)

    def step(triples):
        features = [tokenize([t[0] for t in triples], args.query_length),
                    tokenize([t[1] for t in triples], args.passage_length),
                    tokenize([t[2] for t in triples], args.passage_length)]
        value = loss(features, None)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def throughput(args) -> None:
    from robustir.resources import default_model_path

    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    data = load_groups(args.batch * (args.steps + 1))
    batches = [data[i * args.batch:(i + 1) * args.batch] for i in range(args.steps + 1)]
    systems = {"robustir-infonce": robustir_step_fn(model_path, "infonce", args),
               "robustir-peg": robustir_step_fn(model_path, "peg", args),
               "robustir-ccr": robustir_step_fn(model_path, "ccr", args),
               "st-mnrl": st_step_fn(model_path, args)}
    for fn in systems.values():
        fn(batches[0])  # warm-up
    times = {name: [] for name in systems}
    for batch in batches[1:]:
        for name, fn in systems.items():
            start = time.perf_counter()
            fn(batch)
            times[name].append(time.perf_counter() - start)
    rate = {name: args.batch / statistics.median(t) for name, t in times.items()}
    print(f"batch {args.batch} pairs + 1 hard negative, lengths {args.query_length}/{args.passage_length}, "
          f"threads {args.threads}, {args.steps} timed steps each (median)")
    for name, r in rate.items():
        print(f"  {name:18s} {r:8.2f} pairs/s")
    print(f"ratio robustir(InfoNCE)/ST(MNRL): {rate['robustir-infonce'] / rate['st-mnrl']:.2f}x")
    loss_cost(args, statistics.median(times["robustir-infonce"]))
    print(f"PEG overhead over InfoNCE: {100 * (rate['robustir-infonce'] / rate['robustir-peg'] - 1):+.1f}%   "
          f"CCR overhead: {100 * (rate['robustir-infonce'] / rate['robustir-ccr'] - 1):+.1f}%")


def loss_cost(args, step_seconds: float) -> None:
    """The exact cost of each loss: forward + backward on embeddings of this batch shape (no encoder)."""
    from robustir.losses import ContrastiveBatch, get_loss

    torch.manual_seed(0)
    d = 384
    q = torch.randn(args.batch, d, requires_grad=True)
    p = torch.randn(args.batch, d, requires_grad=True)
    n = torch.randn(args.batch, d, requires_grad=True)
    for name in ("infonce", "peg", "ccr"):
        loss = get_loss(name)
        loss(ContrastiveBatch.from_groups(q, p, n)).loss.backward()  # warm-up
        start = time.perf_counter()
        for _ in range(20):
            loss(ContrastiveBatch.from_groups(q, p, n)).loss.backward()
        ms = (time.perf_counter() - start) / 20 * 1000
        print(f"  loss {name:8s} forward+backward {ms:7.3f} ms = {100 * ms / 1000 / step_seconds:.3f}% of a step")


def memory_child(args) -> None:
    """One GradCache step at args.batch in this (fresh) process; prints peak RSS in MiB."""
    import resource

    from robustir.resources import default_model_path

    torch.set_num_threads(args.threads)
    step = robustir_step_fn(args.model or default_model_path(), "infonce", args, chunk=args.chunk)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    step(load_groups(args.batch))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"batch": args.batch, "peak_mib": peak, "before_step_mib": baseline,
                      "seconds": time.perf_counter() - start}))


def memory(args) -> None:
    results = []
    for batch in args.memory_batches:
        cmd = [sys.executable, __file__, "--memory-child", "--batch", str(batch), "--chunk", str(args.chunk),
               "--query-length", str(args.query_length), "--passage-length", str(args.passage_length),
               "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(out))
        print(f"  batch {batch:5d} (GradCache chunk {args.chunk}): peak RSS {results[-1]['peak_mib']:.0f} MiB "
              f"(model loaded: {results[-1]['before_step_mib']:.0f} MiB), step {results[-1]['seconds']:.0f} s")
    print(f"peak memory ratio batch {args.memory_batches[-1]} / batch {args.memory_batches[0]}: "
          f"{results[-1]['peak_mib'] / results[0]['peak_mib']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--query-length", type=int, default=64)
    parser.add_argument("--passage-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-batches", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args)
        return
    if not args.memory_only:
        throughput(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
