"""``robustir chunk``: split raw documents into passages (a BEIR corpus.jsonl) that fit a token budget."""

from __future__ import annotations

import time
from typing import Annotated

from ..data.chunking import ChunkConfig
from .common import CONFIG, DocumentFormat, Overwrite, Shard, TextUnit, stage_config


def command(*, input: str, output: str, format: DocumentFormat = "auto", text_unit: TextUnit = "block",
            shard: Shard = None, overwrite: Overwrite = False,
            config: Annotated[ChunkConfig | None, CONFIG] = None) -> int:
    """Split raw documents into passages that fit a token budget.

    Parameters
    ----------
    input
        JSONL/BEIR corpus.jsonl file, BEIR folder, or plain text
    output
        passages JSONL
    """
    from ..data.chunking import CHUNK
    from ..runs import Job, execute

    job = Job(output, {"input": input}, shard, {"format": format, "text_unit": text_unit})
    started = time.perf_counter()
    result = execute(CHUNK, build_config(), job, overwrite=overwrite)
    if not result.skipped:
        print(f"robustir chunk: {result.report.summary()} in {time.perf_counter() - started:.1f}s; wrote "
              f"{result.artifact.path}")
    return 0


def build_config() -> ChunkConfig:
    return stage_config(ChunkConfig)
