"""``robustir rerank-eval``: MAP / MRR@10 over given candidate lists (C-MTEB reranking style)."""

from __future__ import annotations

from typing import Annotated

from ..evaluation.metrics import format_table
from ..evaluation.rerank import evaluate_reranking, load_rerank_data
from ..io import write_json
from ..models.encoder import Encoder
from .common import CONFIG, Device, EncoderOverrides, Model, Precision, encoder_options, model_or_default


def command(*, data: str, model: Model = None, output: str | None = None, batch_size: int = 64,
            precision: Precision = None, device: Device = None,
            encoder: Annotated[EncoderOverrides | None, CONFIG] = None) -> int:
    """MAP/MRR over given candidate lists (C-MTEB reranking style).

    Parameters
    ----------
    data
        JSONL: {"query": ..., "positive": [...], "negative": [...]} per line
    output
        folder for metrics.json
    batch_size
        encoding batch size
    """
    loaded = Encoder.from_pretrained(model_or_default(model), device=device or "auto", **encoder_options())
    metrics = evaluate_reranking(loaded, load_rerank_data(data), batch_size, precision or "auto")
    print(format_table({model or "all-MiniLM-L6-v2": metrics}, columns=("map", "mrr@10", "ndcg@10")))
    if output:
        write_json(f"{output}/metrics.json", metrics)
    return 0
