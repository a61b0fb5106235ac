"""``robustir eval``: retrieval metrics of a model, BM25, or both fused, on a BEIR folder.

    robustir eval --data ../shared/data/scifact                      # dense, the bundled all-MiniLM-L6-v2
    robustir eval --data ../shared/data/scifact --mode lexical       # BM25 (same as --model bm25)
    robustir eval --data ../shared/data/scifact --mode hybrid        # reciprocal rank fusion of both lists
    robustir eval --data ../shared/data/scifact --search-index runs/index --mode hybrid   # as /search ranks
"""

from __future__ import annotations

from typing import Annotated

from ..errors import ConfigError
from ..evaluation.metrics import format_table
from ..evaluation.retrieval import EvalConfig, evaluate
from .common import (CONFIG, EncoderOverrides, Model, StorageOption, data_or_default, encoder_options, model_or_default,
                     stage_config, storage_options)


def command(*, model: Model = None, data: str | None = None, split: str = "test", output: str | None = None,
            storage_option: StorageOption = (), encoder: Annotated[EncoderOverrides | None, CONFIG] = None,
            config: Annotated[EvalConfig | None, CONFIG] = None) -> int:
    """Evaluate a model (or bm25: --model bm25 or --mode lexical) on a BEIR folder.

    Parameters
    ----------
    data
        BEIR folder (default: the bundled SciFact)
    split
        qrels split to evaluate on
    output
        folder for metrics.json and run.trec
    """
    config = build_config()
    if config.search_index is not None and not model:
        chosen = None  # the index's model
    else:
        chosen = model if model and model.lower() == "bm25" else model_or_default(model)
    folder = data_or_default(data)
    lexical = chosen == "bm25" or config.mode == "lexical"
    options = {} if lexical else encoder_options()
    if config.search_index is not None and any(v is not None for v in options.values()):
        raise ConfigError("encoder options come from the index's manifest with --search-index: leave them out")
    storage = storage_options(storage_option)
    if storage and config.search_index is None:
        raise ConfigError("--storage-option goes with --search-index s3://...")
    result = evaluate("bm25" if lexical else chosen, folder, split, config, output=output,
                      storage_options=storage, **options)
    if config.search_index is not None:
        name = result.system
    else:
        name = "bm25" if lexical else (model or "all-MiniLM-L6-v2 (bundled)")
        name += " + bm25 (rrf)" if config.mode == "hybrid" and not lexical else ""
    print(format_table({name: result.metrics}, title=f"{folder.name} / {split}  ({result.seconds:.0f} s)"))
    if output:
        print(f"wrote {output}/metrics.json and {output}/run.trec")
    else:
        print("nothing saved: add --output FOLDER to keep metrics.json and the ranking (run.trec)")
    return 0


def build_config() -> EvalConfig:
    return stage_config(EvalConfig)
