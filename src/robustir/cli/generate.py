"""``robustir generate``: write queries for passages with an LLM (PEG data construction).

Examples::

    robustir generate --input corpus.jsonl --output train.jsonl \\
        --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-7B-Instruct --num-queries 3
    robustir generate --input passages.jsonl --output out/q.jsonl --backend hf --model ./my-local-llm
    robustir generate --config gen.yaml --shard 2/8 llm.temperature=0.3 llm.on_failure=skip

Re-running the same command resumes: finished passages are skipped, failed ones (``OUT.failed.jsonl``) retried,
and replies already paid for come from the cache (``OUT.llm-cache.sqlite``). A finished ``OUT`` stays in place
while failures are retried and is replaced only when the re-run finishes. Generated queries that are refusals,
chat boilerplate or answers are rejected (counted per reason in the summary); when more than
``--max-failure-rate`` of the passages fail the command stops with an error (exit 2) instead of finishing. An output
made with another model, temperature, prompt template (its content) or option is refused, naming what differs
(``--overwrite`` redoes it); operational options (concurrency, timeouts, retries, the key) reuse it.
"""

from __future__ import annotations

import logging
from typing import Annotated

from ..errors import ConfigError
from ..queries.generate import GenerateConfig, run_generate
from .common import CONFIG, ConfigFile, Overrides, stage_config

logger = logging.getLogger(__name__)


def command(*overrides: Overrides, config_file: ConfigFile = None,
            config: Annotated[GenerateConfig | None, CONFIG] = None) -> int:
    """Generate queries for passages with an LLM.

    The llm: section's fields are flags of their own (--base-url, --model); trailing key=value overrides set any
    option, e.g. llm.top_p=0.9 llm.extra_body.seed=1.
    """
    return run(overrides, config_file)


def build_config(overrides=(), config_file: str | None = None) -> GenerateConfig:
    return stage_config(GenerateConfig, config_file, overrides)


def run(overrides=(), config_file: str | None = None) -> int:
    config = build_config(overrides, config_file)
    if not config.input or not config.output:
        raise ConfigError("give --input PASSAGES.jsonl and --output OUT.jsonl (or input:/output: in --config)")
    report = run_generate(config, say=print)
    print(f"robustir generate: {report.summary()}")
    if report.failed:
        print(f"robustir generate: {report.failed} passage(s) failed, listed in {report.failed_path}; "
              f"re-run the same command to retry them")
    return 0
