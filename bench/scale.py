"""Training at scale: step time, peak memory, the share of the step spent waiting for data, MFU; encode throughput.

For each global batch (queries; each with 1 positive + ``--group - 1`` hard negatives, SciFact train texts) and
each input path, a fresh process runs one warm-up step and ``--steps`` timed training steps (batch engine with
GradCache chunks of ``--chunk`` rows + AdamW, as ``robustir train`` does) and reports:

* ``old``: the path before issue 12: ``collate`` (the transformers tokenizer call, padding and list -> tensor
  conversion) on the main thread, in the step;
* ``fast-sync``: the new :class:`~robustir.training.data.Collator` (one fast-tokenizer call each for queries and
  passages, written straight into padded arrays), still on the main thread (``prefetch_batches: 0``);
* ``pipeline``: the Collator in :class:`~robustir.training.input_pipeline.InputPipeline` (``--prefetch`` batches
  ahead, one background thread, or ``--workers`` DataLoader processes): training's default.

Step time is the median timed step, from asking for the batch to the optimizer step (CUDA synchronised); the data
wait is the time blocked asking for the batch (TrainingLoop's ``data_wait_seconds``), its share of the steps' time;
peak memory is the process's peak RSS (and ``torch.cuda.max_memory_allocated`` on a GPU). MFU: model FLOPs per
step = 6 x non-embedding parameters x the tokens the model processes (padded query + passage tokens; GradCache's
extra forward and attention's quadratic term not counted) over the step time, against the device's peak
(``--peak-tflops``, a table of GPUs, or on a CPU: cores x clock x FLOPs per cycle of its widest FMA, an
assumption printed with the figure). Collate alone: one ``--collate-batch`` batch made on the main thread by
the old ``collate`` and by the Collator. Encode: ``Encoder.encode`` vs ``SentenceTransformer.encode``, same device,
texts, batch size and max length, alternating, best of ``--encode-repeats``.

    python bench/scale.py --device cpu --model tiny --batches 16,64,256,512 --steps 3
    python bench/scale.py --device cuda --model bundled --batches 64,1024,4096,16384 --chunk 1024 --bf16

``--model``: ``tiny`` (random 2-layer, 32-wide BERT with MiniLM's tokenizer: the tokenizer's real cost against a
model a CPU computes quickly, the regime of a large GPU, where the step's compute and the tokenisation take similar
times), ``bundled`` (all-MiniLM-L6-v2) or a model folder. ``--rounds``: every configuration that many times, the
paths alternating, the median of the rounds reported (for a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

PATHS = ("old", "fast-sync", "pipeline")
#: dense bf16 tensor-core peaks (TFLOPS) of known GPUs, by a substring of torch.cuda.get_device_name()
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                   "V100": 125.0, "4090": 165.0}


# ---------------------------------------------------------------------------- set-up

def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return torch.device(spec)


def tiny_model(folder: Path) -> str:
    """A random 2-layer, 32-wide BERT with all-MiniLM-L6-v2's tokenizer (the tests' tiny model), saved once."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from robustir.resources import default_model_path

    if not (folder / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
        config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
        torch.manual_seed(0)
        BertModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def model_path(name: str, work: Path) -> str:
    from robustir.resources import default_model_path

    if name == "tiny":
        return tiny_model(work / "tiny-bert")
    if name == "bundled":
        return str(default_model_path())
    return name


def training_examples(batch: int):
    """SciFact train queries (their positives; negatives drawn from the pool), repeated to one global batch."""
    from robustir.data.training_data import examples_from_beir
    from robustir.resources import dataset_path

    examples = examples_from_beir(dataset_path("scifact"), "train")
    return [examples[i % len(examples)] for i in range(max(batch, len(examples)))]


def non_embedding_parameters(encoder) -> int:
    embeddings = {id(p) for m in encoder.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in encoder.parameters() if id(p) not in embeddings)


def cpu_peak_tflops(threads: int) -> tuple[float, str]:
    """An assumed fp32 peak of this CPU: threads x clock x FLOPs per cycle (2 FMA units of its widest vectors)."""
    flags, mhz = "", 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line
            if line.startswith("cpu MHz"):
                mhz = max(mhz, float(line.split(":")[1]))
    except OSError:
        pass
    ghz = mhz / 1000 if mhz else 2.5
    per_cycle = 64 if " avx512f" in flags else 32 if " avx2" in flags and " fma" in flags else 8
    return threads * ghz * per_cycle / 1000, (f"assumed: {threads} core(s) x {ghz:.2f} GHz x {per_cycle} fp32 "
                                              "FLOPs/cycle")


def peak_tflops(args, device: torch.device) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"{name}: dense bf16 peak"
        return float("nan"), f"{name}: unknown peak (give --peak-tflops)"
    return cpu_peak_tflops(torch.get_num_threads())


# ---------------------------------------------------------------------------- one configuration (child)

def child(args) -> None:
    """``--batch`` queries, input path ``--path``: one warm-up and ``--steps`` timed steps; prints one JSON line."""
    from robustir.losses import get_loss
    from robustir.models.encoder import Encoder
    from robustir.training.batch_engine import BatchEngine
    from robustir.training.data import Collator, GroupSampler, StepBatches, collate
    from robustir.training.input_pipeline import InputPipeline

    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    k = args.group - 1
    encoder = Encoder.from_pretrained(args.model_path, query_max_length=args.query_length,
                                      passage_max_length=args.passage_length).to(device)
    encoder.train()
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=2e-5)
    engine = BatchEngine(get_loss("infonce", temperature=0.05), chunk_size=args.chunk or None)
    sampler = GroupSampler(training_examples(args.batch), k, args.batch, 1, seed=0, epoch_unit="queries")
    steps = args.steps + 1
    if args.path == "old":
        pipeline = InputPipeline(lambda s: collate(sampler.batch(s, 0), encoder, args.query_length,
                                                   args.passage_length), prefetch=0)
    else:
        on_gpu = device.type == "cuda"
        collator = Collator.for_encoder(encoder, args.query_length, args.passage_length,
                                        pad_to_multiple_of=8 if on_gpu else None)
        prefetch = 0 if args.path == "fast-sync" else args.prefetch
        pipeline = InputPipeline(StepBatches(sampler, collator, 0), prefetch=prefetch,
                                 workers=args.workers if prefetch else 0, pin_memory=on_gpu and prefetch > 0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, waits, tokens = [], [], []
    with pipeline.start(0, steps):
        for step in range(steps):
            tick = time.perf_counter()
            q, p, ids, positive_ids = pipeline.get(step)
            waited = time.perf_counter() - tick
            q = {key: v.to(device, non_blocking=True) for key, v in q.items()}
            p = {key: v.to(device, non_blocking=True) for key, v in p.items()}
            with autocast:
                engine.step(encoder, q, p, k, passage_ids=ids, positive_ids=positive_ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:  # the first step warms up (allocations, kernels; the pipeline's first batch)
                times.append(time.perf_counter() - tick)
                waits.append(waited)
                tokens.append(q["input_ids"].numel() + p["input_ids"].numel())
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
    print(json.dumps({"batch": args.batch, "path": args.path, "step_s": statistics.median(times),
                      "wait_share": sum(waits) / sum(times), "wait_s": statistics.median(waits),
                      "tokens": statistics.median(tokens), "params": non_embedding_parameters(encoder),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_before_mib": rss_before, "peak_gpu_mib": peak_gpu}))


def run_child(args, batch: int, path: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--path", path, "--batch", str(batch), "--model-path",
           args.model_path, "--device", args.device, "--group", str(args.group), "--query-length",
           str(args.query_length), "--passage-length", str(args.passage_length), "--steps", str(args.steps),
           "--chunk", str(args.chunk), "--prefetch", str(args.prefetch), "--workers", str(args.workers),
           "--threads", str(args.threads)] + (["--bf16"] if args.bf16 else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- collate alone

def collate_times(args) -> dict[str, float]:
    """Seconds to sample and tokenise one ``--collate-batch`` batch on the main thread: the old ``collate`` vs
    the Collator (best of ``--encode-repeats``, alternating; the same groups)."""
    from robustir.models.encoder import Encoder
    from robustir.training.data import Collator, GroupSampler, collate

    encoder = Encoder.from_pretrained(args.model_path, query_max_length=args.query_length,
                                      passage_max_length=args.passage_length)
    sampler = GroupSampler(training_examples(args.collate_batch), args.group - 1, args.collate_batch, 1, seed=0,
                           epoch_unit="queries")
    groups = sampler.batch(0, 0)
    collator = Collator.for_encoder(encoder, args.query_length, args.passage_length)
    systems = {"old collate": lambda: collate(groups, encoder, args.query_length, args.passage_length),
               "Collator": lambda: collator(groups)}
    best = {name: float("inf") for name in systems}
    for _ in range(args.encode_repeats):
        for name, fn in systems.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


# ---------------------------------------------------------------------------- encode throughput

def encode_throughput(args, device: torch.device) -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path

    path = str(default_model_path()) if args.encode_model == "bundled" else args.encode_model
    texts = [e.pos[0] for e in training_examples(0)][: args.encode_texts]
    texts = [texts[i % len(texts)] for i in range(args.encode_texts)]
    ours = Encoder.from_pretrained(path, passage_max_length=args.passage_length).to(device)
    st = SentenceTransformer(path, device=str(device))
    st.max_seq_length = args.passage_length
    systems = {"robustir Encoder.encode": lambda: ours.encode(texts, "passage", batch_size=args.encode_batch,
                                                              bf16=args.bf16),
               "SentenceTransformer.encode": lambda: st.encode(texts, batch_size=args.encode_batch,
                                                               show_progress_bar=False)}
    ours.encode(texts[:8], "passage")
    st.encode(texts[:8], show_progress_bar=False)
    best = {name: float("inf") for name in systems}
    for _ in range(args.encode_repeats):
        for name, fn in systems.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: len(texts) / seconds for name, seconds in best.items()}


# ---------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--model", default="tiny", help="tiny, bundled or a model folder")
    parser.add_argument("--batches", default="16,64,256,512", help="global batches (queries), comma-separated")
    parser.add_argument("--group", type=int, default=6, help="passages per query: 1 positive + group-1 negatives")
    parser.add_argument("--query-length", type=int, default=64)
    parser.add_argument("--passage-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each configuration (median reported)")
    parser.add_argument("--chunk", type=int, default=512, help="GradCache rows per chunk (0 = no caching)")
    parser.add_argument("--prefetch", type=int, default=2, help="the pipeline's prefetch_batches")
    parser.add_argument("--workers", type=int, default=0, help="the pipeline's dataloader_workers (0 = a thread)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--encode-model", default="bundled")
    parser.add_argument("--encode-texts", type=int, default=256)
    parser.add_argument("--encode-batch", type=int, default=64)
    parser.add_argument("--encode-repeats", type=int, default=2)
    parser.add_argument("--skip-encode", action="store_true")
    parser.add_argument("--collate-batch", type=int, default=4096, help="queries of the collate-alone timing (0: skip)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="pipeline", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.gettempdir()) / "robustir-bench-scale"
    work.mkdir(exist_ok=True)
    args.model_path = model_path(args.model, work)
    peak, peak_note = peak_tflops(args, device)
    paths = [p for p in args.paths.split(",") if p]
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"device {device}, model {args.model} ({args.model_path}), {args.group} passages per query, lengths "
          f"{args.query_length}/{args.passage_length}, GradCache chunk {args.chunk or 'off'}, {args.threads} torch "
          f"thread(s), pipeline prefetch {args.prefetch} / workers {args.workers}, {args.steps} timed steps "
          f"(median), {args.rounds} round(s), peak {peak:g} TFLOPS ({peak_note})")
    header = ("| queries × passages | path | step s | data wait s | wait share | tokens/step | TFLOPS | MFU | "
              "peak RSS MiB |" + (" GPU max alloc MiB |" if device.type == "cuda" else "") + " step vs old |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results = {}
    for batch in batches:
        runs = {path: [] for path in paths}
        for _ in range(args.rounds):
            for path in paths:
                runs[path].append(run_child(args, batch, path))
        for path in paths:
            r = results[(batch, path)] = {key: statistics.median(run[key] for run in runs[path])
                                          if isinstance(runs[path][0][key], (int, float)) else runs[path][0][key]
                                          for key in runs[path][0]}
            flops = 6 * r["params"] * r["tokens"]
            tflops = flops / r["step_s"] / 1e12
            old = results.get((batch, "old"))
            ratio = f"{r['step_s'] / old['step_s']:.2f}" if old else "-"
            gpu = f" {r['peak_gpu_mib']:,.0f} |" if device.type == "cuda" else ""
            print(f"| {batch} × {batch * args.group} | {path} | {r['step_s']:.3f} | {r['wait_s']:.3f} | "
                  f"{100 * r['wait_share']:.1f}% | {r['tokens']:,.0f} | {tflops:.4f} | {100 * tflops / peak:.2f}% | "
                  f"{r['peak_rss_mib']:,.0f} |{gpu} {ratio} |", flush=True)
    if args.collate_batch:
        seconds = collate_times(args)
        print(f"\ncollate alone, {args.collate_batch} queries x {args.group} passages, lengths {args.query_length}/"
              f"{args.passage_length}, main thread, best of {args.encode_repeats}: " +
              ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items()) +
              f"; ratio old / Collator {seconds['old collate'] / seconds['Collator']:.2f}x")
    if not args.skip_encode:
        rates = encode_throughput(args, device)
        (ours, ours_rate), (theirs, theirs_rate) = rates.items()
        print(f"\nencode ({args.encode_model}, {args.encode_texts} SciFact passages, batch {args.encode_batch}, max "
              f"length {args.passage_length}, {device}, best of {args.encode_repeats}):")
        for name, rate in rates.items():
            print(f"  {name:28s} {rate:8.1f} texts/s")
        print(f"  ratio robustir / sentence-transformers: {ours_rate / theirs_rate:.2f}x")


if __name__ == "__main__":
    main()
