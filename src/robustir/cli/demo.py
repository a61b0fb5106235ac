"""``robustir demo``: the default job — the bundled model and BM25 on the bundled SciFact test split."""

from __future__ import annotations

from pathlib import Path

from ..evaluation.metrics import format_table
from ..evaluation.retrieval import EvalConfig, evaluate
from ..resources import dataset_path, default_model_path
from .common import Device, Precision


def command(*, output: str = "runs/demo", precision: Precision = None, device: Device = None) -> int:
    """Evaluate the bundled model and BM25 on the bundled dataset.

    Parameters
    ----------
    output
        folder for metrics and runs
    """
    data = dataset_path("scifact")
    out = Path(output)
    rows = {}
    config = EvalConfig(precision=precision or "auto", cache_dir=str(out / "cache"), show_progress=True,
                        device=device or "auto")
    print("BM25 (bm25s, Lucene k1=1.5 b=0.75, English stop words + Snowball stemmer) ...", flush=True)
    bm25 = evaluate("bm25", data, "test", config, output=out / "bm25")
    rows["BM25"] = bm25.metrics
    print(format_table({"BM25": bm25.metrics}, title=f"BM25 on SciFact test ({bm25.seconds:.0f} s)"), "\n")
    from ..device import resolve_device
    from ..precision import resolve_precision

    resolved = resolve_device(config.device)
    print(f"all-MiniLM-L6-v2 (bundled), mean pooling, cosine, FAISS exact search, {resolved.type} "
          f"{resolve_precision(config.precision, resolved)} ...", flush=True)
    dense = evaluate(default_model_path(), data, "test", config, output=out / "minilm")
    rows["all-MiniLM-L6-v2"] = dense.metrics
    print(format_table({"all-MiniLM-L6-v2": dense.metrics},
                       title=f"all-MiniLM-L6-v2 on SciFact test ({dense.seconds:.0f} s)"), "\n")
    print(format_table(rows, title="SciFact test (published NDCG@10: BM25 68.7 [bm25s 68.6], MiniLM 64.5)"))
    print(f"\nmetrics and TREC runs in {out}/")
    return 0
