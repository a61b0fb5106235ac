"""``robustir noise-bench``: the planted-noise benchmark (see docs/robustness.md).

    robustir noise-bench --preset cpu                                   # 1 kind x 2 rates x 4 methods, < 1 h on 2 cores
    robustir noise-bench --kinds chunk-fn fp-random --rates 0 0.2 0.4 --methods infonce peg teacher-peg st --seeds 1 2 3
    robustir noise-bench --config bench.yaml budget.epochs=2 llm.base_url=http://localhost:8000/v1 llm.model=Qwen2.5-7B-Instruct

Every finished run is a line of ``<output>/results.jsonl`` and is never redone; re-run the same command to
resume. ``results.md`` (table) and ``results.png`` (NDCG@10 against noise rate, a panel per kind) are
rewritten after each call.
"""

from __future__ import annotations

from typing import Annotated

from ..robustness.bench import NoiseBenchConfig
from .common import CONFIG, ConfigFile, Overrides, stage_config


def command(*overrides: Overrides, config_file: ConfigFile = None,
            config: Annotated[NoiseBenchConfig | None, CONFIG] = None) -> int:
    """Planted-noise benchmark: each method's NDCG@10 against noise kind and rate.

    Every field is a flag, a --config key or a trailing key=value override (budget.epochs=2 per_query=2).
    """
    return run(overrides, config_file)


def build_config(overrides=(), config_file: str | None = None) -> NoiseBenchConfig:
    return stage_config(NoiseBenchConfig, config_file, overrides)


def run(overrides=(), config_file: str | None = None) -> int:
    from ..robustness.bench import run_noise_bench, write_table

    config = build_config(overrides, config_file)

    def progress(row: dict) -> None:
        print(f"noise-bench: {row['kind']} {100 * row['rate']:.0f}% {row['method']} seed {row['seed']}: "
              f"NDCG@10 {100 * row['metrics']['ndcg@10']:.2f} ({row['seconds']:.0f} s)", flush=True)

    rows = run_noise_bench(config, progress)
    resolved = config.resolved()
    from pathlib import Path

    print(write_table(rows, Path(resolved.output) / "results.md", resolved.kinds))
    print(f"noise-bench: results in {resolved.output}/results.jsonl, table results.md, plot results.png")
    return 0
