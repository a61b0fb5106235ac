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

import argparse
import logging

from ..config import load_config
from ..errors import ConfigError
from ..queries.generate import GenerateConfig, run_generate
from .common import add_config_flags, flags_from_args

logger = logging.getLogger(__name__)



def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML/JSON file with GenerateConfig fields (an llm: section for the LLM)")
    keys = add_config_flags(parser, GenerateConfig)  # the llm: section's fields too (--base-url)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. llm.top_p=0.9 llm.extra_body.seed=1")
    parser.set_defaults(_flag_keys=keys)


def build_config(args: argparse.Namespace) -> GenerateConfig:
    return load_config(GenerateConfig, args.config, args.overrides, flags_from_args(args, args._flag_keys))


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    if not config.input or not config.output:
        raise ConfigError("give --input PASSAGES.jsonl and --output OUT.jsonl (or input:/output: in --config)")
    report = run_generate(config, say=print)
    print(f"robustir generate: {report.summary()}")
    if report.failed:
        print(f"robustir generate: {report.failed} passage(s) failed, listed in {report.failed_path}; "
              f"re-run the same command to retry them")
    return 0
