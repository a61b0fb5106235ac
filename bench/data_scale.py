"""The trainer's input side against the number of training pairs: the list-based path robustir had before issue 14
vs the memory-mapped Arrow path, side by side (peak RSS and examples/s; no model forward).

Synthetic FlagEmbedding pairs are made from the shared corpora (``../shared/data/*/corpus.jsonl``): a passage (its
first 300 characters), a query of 8 of its words, one negative drawn from the other passages. For each size, each
path runs in its own subprocess (fresh memory accounting):

* ``list``  -- ``load_training_data`` (every example a Python object) + the pre-issue-14 ``GroupSampler`` (its items
  and its pool of every passage are Python lists; copied below, unchanged, as the reference);
* ``arrow`` -- ``convert_training_files`` (the one-time conversion, cache emptied first) + ``GroupSampler`` on the
  memory-mapped rows;
* ``arrow-cached`` -- the same with the conversion already cached: what every later run (and a resume) pays.

Then ``--steps`` steps of ``sampler.batch`` + ``Collator`` (the trainer's tokenisation, bundled MiniLM tokenizer,
query/passage max length 64/256) on one thread. Reported: seconds to load or convert, the steps' examples (queries)
per second, peak RSS (``VmHWM``: it includes the file pages of the memory-mapped Arrow data that the steps touched)
and the anonymous (heap) RSS at the end (``RssAnon``).

    python bench/data_scale.py --pairs 10000 100000 1000000            # both paths
    python bench/data_scale.py --pairs 3000000 --sides arrow arrow-cached  # larger, Arrow only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
PASSAGE_CHARS = 300


# ---------------------------------------------------------------------------- synthetic data

def corpus_passages(limit_chars: int = PASSAGE_CHARS) -> list[str]:
    passages = []
    for corpus in sorted(SHARED.glob("*/corpus.jsonl")):
        with open(corpus, encoding="utf-8") as handle:
            for line in handle:
                doc = json.loads(line)
                text = " ".join(x for x in (doc.get("title"), doc.get("text")) if x).strip()
                if len(text.split()) >= 8:
                    passages.append(text[:limit_chars])
    return passages


def make_pairs(path: Path, n: int, seed: int = 0) -> None:
    """``n`` pairs into ``path`` (kept for later runs: the name holds ``n`` and the seed)."""
    if path.exists():
        return
    passages = corpus_passages()
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for i in range(n):
            p = rng.randrange(len(passages))
            words = passages[p].split()
            start = rng.randrange(max(1, len(words) - 8))
            query = " ".join(words[start:start + 8]) + f" ({i})"
            negative = passages[rng.randrange(len(passages))]
            handle.write(json.dumps({"query": query, "pos": [passages[p]], "neg": [negative]}, ensure_ascii=False)
                         + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the list-based sampler (reference)

class ListGroupSampler:
    """robustir's GroupSampler before issue 14 (items and pool as Python lists), for comparison only."""

    def __init__(self, examples, num_negatives, batch_size, world_size, seed, epoch_unit="pairs"):
        self.examples = examples
        self.items = ([(i, j) for i, e in enumerate(examples) for j in range(len(e.pos))] if epoch_unit == "pairs"
                      else [(i, -1) for i in range(len(examples))])
        self.k, self.batch_size, self.seed = num_negatives, batch_size, seed
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(self.items) // self.global_batch
        self._pool = [p for e in examples for p in e.pos] + [n for e in examples for n in e.neg]
        distinct = set(self._pool)  # the construction-time check built this set too
        del distinct

    def permutation(self, epoch):
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def group(self, item, epoch):
        from robustir.training.data import Group

        index, which = self.items[item]
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{epoch}:{index}" if which < 0 else f"{self.seed}:{epoch}:{index}:{which}")
        positive = rng.choice(example.pos) if which < 0 else example.pos[which]
        negatives = []
        if self.k:
            if len(example.neg) >= self.k:
                negatives = rng.sample(example.neg, self.k)
            elif example.neg:
                negatives = list(example.neg) + [rng.choice(example.neg) for _ in range(self.k - len(example.neg))]
            else:
                while len(negatives) < self.k:
                    candidate = rng.choice(self._pool)
                    if candidate not in example.pos:
                        negatives.append(candidate)
        return Group(example.query, example.prompt, [positive, *negatives], tuple(example.pos))

    def batch(self, step, rank):
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.permutation(epoch)  # as before issue 14: drawn again at every step
        start = within * self.global_batch + rank * self.batch_size
        return [self.group(int(i), epoch) for i in order[start:start + self.batch_size]]


# ---------------------------------------------------------------------------- one side (subprocess)

def _status() -> dict[str, float]:
    values = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) / 1024  # kB -> MB
    return values


def run_side(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from robustir.data.arrow_store import convert_training_files
    from robustir.data.training_data import load_training_data
    from robustir.resources import default_model_path
    from robustir.training.data import Collator, GroupSampler

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    collator = Collator(tokenizer, 64, 256, query_instruction="", passage_instruction="")
    after_imports = _status()
    anon_peak = after_imports["RssAnon"]
    started = time.perf_counter()
    if args.side == "list":
        examples, _ = load_training_data(args.data)
        loaded = time.perf_counter() - started
        anon_peak = max(anon_peak, _status()["RssAnon"])
        sampler = ListGroupSampler(examples, 1, args.batch_size, 1, seed=0)
    else:
        cache = Path(args.cache)
        if args.side == "arrow" and cache.exists():
            shutil.rmtree(cache)  # the one-time conversion is part of this side
        rows = convert_training_files(args.data, cache)
        loaded = time.perf_counter() - started
        anon_peak = max(anon_peak, _status()["RssAnon"])
        sampler = GroupSampler(rows, 1, args.batch_size, 1, seed=0, epoch_unit="pairs")
    ready = time.perf_counter() - started
    anon_peak = max(anon_peak, _status()["RssAnon"])
    sample_seconds = collate_seconds = 0.0
    for step in range(args.steps):
        tick = time.perf_counter()
        groups = sampler.batch(step, 0)
        tock = time.perf_counter()
        collator(groups)
        sample_seconds += tock - tick
        collate_seconds += time.perf_counter() - tock
        if step % 25 == 0:
            anon_peak = max(anon_peak, _status()["RssAnon"])
    end = _status()
    examples_done = args.steps * args.batch_size
    return {"side": args.side, "pairs": args.pairs[0], "load_s": round(loaded, 2), "ready_s": round(ready, 2),
            "sample_examples_per_s": round(examples_done / sample_seconds, 1),
            "examples_per_s": round(examples_done / (sample_seconds + collate_seconds), 1),
            "rss_after_imports_mb": round(after_imports["VmRSS"]), "peak_rss_mb": round(end["VmHWM"]),
            "anon_peak_mb": round(max(anon_peak, end["RssAnon"])), "file_rss_end_mb": round(end["RssFile"])}


def spawn(args: argparse.Namespace, side: str, data: Path, pairs: int, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--side", side, "--data", str(data), "--cache", str(cache), "--pairs",
           str(pairs), "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{side} at {pairs} pairs failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--sides", nargs="+", default=["list", "arrow", "arrow-cached"],
                        choices=["list", "arrow", "arrow-cached"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--work", default="/tmp/robustir-data-scale", help="where the synthetic files and caches go")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic files and caches")
    parser.add_argument("--out", help="also write the rows as JSON lines here")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'pairs':>10s} {'path':>13s} {'load/convert s':>14s} {'examples/s':>10s} {'sampler ex/s':>12s} "
          f"{'peak RSS MB':>11s} {'heap (anon) MB':>14s} {'file pages MB':>13s}", flush=True)
    for pairs in args.pairs:
        data = work / f"pairs-{pairs}.jsonl"
        started = time.perf_counter()
        make_pairs(data, pairs)
        made = time.perf_counter() - started
        cache = work / f"cache-{pairs}"
        for side in args.sides:
            row = spawn(args, side, data, pairs, cache)
            row["data_mb"] = round(data.stat().st_size / 2 ** 20)
            row["make_s"] = round(made, 1)
            rows.append(row)
            print(f"{pairs:10d} {side:>13s} {row['load_s']:14.1f} {row['examples_per_s']:10.0f} "
                  f"{row['sample_examples_per_s']:12.0f} {row['peak_rss_mb']:11d} {row['anon_peak_mb']:14d} "
                  f"{row['file_rss_end_mb']:13d}", flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
        if not args.keep:
            data.unlink(missing_ok=True)
            shutil.rmtree(cache, ignore_errors=True)
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:8]
    print(f"({len(rows)} rows, {args.steps} steps x batch {args.batch_size} per side; id {digest})")


if __name__ == "__main__":
    main()
