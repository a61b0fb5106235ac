"""``robustir mine``: mine hard negatives with BM25 or a dense model.

Examples::

    robustir mine --data ../shared/data/scifact --split train --method bm25 --output runs/mined.jsonl
    robustir mine --input train.jsonl --corpus corpus.jsonl --method dense --cache-dir runs/cache \\
        --num-negatives 15 --range-min 3 --relative-margin 0.05 --output runs/mined.jsonl
    robustir mine --input pairs.jsonl --output mined.jsonl --shard 2/4     # then: robustir merge --output mined.jsonl
    # a corpus of millions: embeddings cached on disk and searched 100k rows at a time (docs/scale.md)
    robustir mine --input train.jsonl --corpus corpus.jsonl --method dense --cache-dir runs/cache \\
        --corpus-chunk 100000 --output runs/mined.jsonl

Without ``--corpus`` a training JSONL is mined against every ``pos``/``neg`` text in the file (FlagEmbedding
convention). Positives -- by id and by identical text -- and the query itself are never returned.
A re-run resumes; a complete output is left alone (``--overwrite`` to redo).
"""

from __future__ import annotations

import time
from typing import Annotated

from ..negatives.mining import MiningConfig
from .common import (CONFIG, EncoderOverrides, Model, Overwrite, Shard, encoder_options, model_or_default,
                     stage_config)


def command(*, output: str, data: str | None = None, split: str = "train", input: str | None = None,
            corpus: str | None = None, shard: Shard = None, overwrite: Overwrite = False, model: Model = None,
            encoder: Annotated[EncoderOverrides | None, CONFIG] = None,
            config: Annotated[MiningConfig | None, CONFIG] = None) -> int:
    """Mine hard negatives with BM25 or a dense model.

    Parameters
    ----------
    output
        training JSONL to write
    data
        input, one of: a BEIR folder: mine for the queries of --split against its corpus
    split
        qrels split of --data
    input
        input, one of: a training JSONL (query/pos[/neg]) to mine negatives for
    corpus
        with --input: candidate documents (BEIR corpus.jsonl); default: every pos/neg text of the input
    """
    from ..negatives.mining import MINE
    from ..runs import Job, execute

    config = mining_config()
    settings: dict = {"split": split if data else None}
    inputs = {"data": data, "input": input, "corpus": corpus}
    if config.method == "dense":  # the model by its content: one retrained in place is a changed input
        settings.update(encoder_options())
        inputs["model"] = model_or_default(model)
    started = time.perf_counter()
    result = execute(MINE, config, Job(output, inputs, shard, settings), overwrite=overwrite)
    if not result.skipped:
        report, elapsed = result.report, max(time.perf_counter() - started, 1e-9)
        print(report.format())
        print(f"robustir mine: {report.queries} queries in {elapsed:.1f}s ({report.queries / elapsed:.1f} "
              f"queries/s); wrote {result.artifact.path} and {result.artifact.path.name}.report.json")
    return 0


def mining_config() -> MiningConfig:
    """The :class:`MiningConfig` the flags describe (validated)."""
    config = stage_config(MiningConfig)
    config.validate()
    return config
