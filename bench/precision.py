"""Precision on the CPU it runs on: ``robustir demo`` / ``robustir eval`` by default (precision auto) against fp32,
bf16 and sentence-transformers' fp32 encode of the same corpus (issue 21).

Every arm is its own process, run one after the other on the same machine (nothing else should run), each timed
whole (wall seconds, model load included), and the encode-only seconds where the arm reports them:

* ``demo``: ``robustir demo`` (BM25 + the bundled MiniLM on SciFact test, default precision = auto), fresh output;
* ``eval-auto`` / ``eval-fp32`` / ``eval-bf16``: ``robustir eval`` on SciFact test with that ``--precision``;
* ``st-fp32`` / ``st-bf16``: ``SentenceTransformer.encode`` of the same 5,183 abstracts (title + text, 256 tokens,
  batch 64, normalised), in fp32 or on a bfloat16 copy of the weights;
* ``sample-fp32`` / ``sample-bf16``: robustir's encode of the first ``--sample`` abstracts only, for a precision too
  slow to run on the whole corpus (emulated bf16).

``--isa avx2`` caps PyTorch and oneDNN at AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) in every arm:
an AVX512-BF16 CPU then runs bf16 emulated, like an AVX2-only laptop or cloud VM (robustir's detection sees the cap,
so ``auto`` picks fp32 there too).

    python bench/precision.py --arms demo,eval-auto,eval-fp32,st-fp32,st-bf16
    python bench/precision.py --isa avx2 --arms demo,st-fp32,sample-fp32,sample-bf16 --sample 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ENCODE = r"""
import json, sys, time, torch
side, precision, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
from robustir.data.beir import load_beir
from robustir.resources import dataset_path, default_model_path
texts = load_beir(dataset_path("scifact"), "test").corpus.texts_for_encoding()
texts = texts[:limit] if limit > 0 else texts
if side == "st":
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 256
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.encode(texts[:8], batch_size=64)
    start = time.perf_counter()
    emb = model.encode(texts, batch_size=64, normalize_embeddings=True)
else:
    from robustir.models.encoder import Encoder
    model = Encoder.from_pretrained(default_model_path(), passage_max_length=256)
    model.encode(texts[:8], "passage", precision=precision)
    start = time.perf_counter()
    emb = model.encode(texts, "passage", batch_size=64, precision=precision)
seconds = time.perf_counter() - start
print(json.dumps({"texts": len(texts), "encode_s": seconds, "threads": torch.get_num_threads()}))
"""


def machine() -> dict:
    from robustir.hardware import available_cpus, cpu_bf16_report, cpu_flags

    flags = cpu_flags("/proc/cpuinfo") or set()
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "?")
    except OSError:
        model = "?"
    return {"cpu": model, "cpus_available": available_cpus(), "native_bf16": cpu_bf16_report()[0],
            "flags": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile",
                                                       "avx512_vnni", "avx_vnni"})}


def run_arm(arm: str, env: dict, work: Path, sample: int, data: str) -> dict:
    robustir = [sys.executable, "-m", "robustir.cli.main"]
    if arm == "demo":
        command = robustir + ["demo", "--output", str(work / "demo")]
    elif arm.startswith("eval-"):
        command = robustir + ["eval", "--data", data, "--split", "test", "--output", str(work / arm),
                              "--precision", arm.split("-", 1)[1]]
    elif arm.startswith("st-"):
        command = [sys.executable, "-c", ENCODE, "st", arm.split("-", 1)[1], "0"]
    elif arm.startswith("sample-"):
        command = [sys.executable, "-c", ENCODE, "robustir", arm.split("-", 1)[1], str(sample)]
    else:
        raise SystemExit(f"unknown arm {arm!r}")
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row: dict = {"arm": arm, "wall_s": round(wall, 1)}
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if last.startswith("{"):
        row.update(json.loads(last))
    metrics = work / arm / "metrics.json"
    if metrics.exists():
        row["ndcg@10"] = round(json.loads(metrics.read_text())["ndcg@10"] * 100, 2)
    if arm == "demo":
        minilm = work / "demo" / "minilm" / "metrics.json"
        if minilm.exists():
            row["ndcg@10"] = round(json.loads(minilm.read_text())["ndcg@10"] * 100, 2)
    precision_line = [line for line in done.stderr.splitlines() if "emulated" in line]
    if precision_line:
        row["warning"] = precision_line[0][-160:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="demo,eval-auto,eval-fp32,st-fp32")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    parser.add_argument("--sample", type=int, default=256, help="abstracts for the sample-* arms")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"))
    parser.add_argument("--output", default="runs/bench-precision.jsonl", help="rows appended here (JSON lines)")
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ROBUSTIR_CPU_BF16", None)
    if args.isa == "avx2":
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    info = machine()
    probe = subprocess.run([sys.executable, "-c", "from robustir.hardware import cpu_bf16_report as r; "
                            "from robustir.precision import resolve_precision as p; print(r()[1], '->', p('auto'))"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    info["isa"] = args.isa
    info["auto"] = probe.stdout.strip()
    print(json.dumps(info))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arm in [a for a in args.arms.split(",") if a]:
            row = run_arm(arm, env, Path(tmp), args.sample, args.data)
            row.update(isa=args.isa, cpu=info["cpu"], native_bf16=info["native_bf16"] and args.isa == "native")
            if "texts" in row:
                row["texts_per_s"] = round(row["texts"] / row["encode_s"], 1)
            print(json.dumps(row), flush=True)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
