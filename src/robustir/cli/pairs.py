"""``robustir pairs``: mine GUR (sentence, sentence) pairs by weighted longest common substring."""

from __future__ import annotations

import time
from typing import Annotated

from ..queries.pairs import PairMiningConfig
from .common import CONFIG, ConfigFile, DocumentFormat, Overrides, Overwrite, Shard, TextUnit, stage_config


def command(*overrides: Overrides, input: str, output: str, format: DocumentFormat = "auto",
            text_unit: TextUnit = "block", shard: Shard = None, overwrite: Overwrite = False,
            config_file: ConfigFile = None, config: Annotated[PairMiningConfig | None, CONFIG] = None) -> int:
    """Mine (sentence, sentence) pairs by longest common substring (GUR).

    Parameters
    ----------
    input
        raw documents: JSONL, BEIR folder/corpus.jsonl, or text
    output
        FlagEmbedding JSONL
    """
    from ..queries.pairs import PAIRS
    from ..runs import Job, execute

    job = Job(output, {"input": input}, shard, {"format": format, "text_unit": text_unit})
    started = time.perf_counter()
    result = execute(PAIRS, build_config(overrides, config_file), job, overwrite=overwrite)
    if not result.skipped:
        stats, elapsed = result.report, max(time.perf_counter() - started, 1e-9)
        print(f"robustir pairs: {stats.summary()} in {elapsed:.1f}s = {stats.pairs / elapsed:.0f} pairs/s, "
              f"{stats.documents / elapsed:.0f} documents/s; wrote {result.artifact.path}")
    return 0


def build_config(overrides=(), config_file: str | None = None) -> PairMiningConfig:
    return stage_config(PairMiningConfig, config_file, overrides)
