"""``robustir generate``: write queries for passages with an LLM (PEG data construction).

Examples::

    robustir generate --input corpus.jsonl --output train.jsonl \\
        --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-7B-Instruct --num-queries 3
    robustir generate --input passages.jsonl --output out/q.jsonl --backend hf --model ./my-local-llm
    robustir generate --config gen.yaml --shard 2/8 llm.temperature=0.3 llm.on_failure=skip

Re-running the same command resumes: finished passages are skipped, failed ones (``OUT.failed.jsonl``) retried,
and replies already paid for come from the cache (``OUT.llm-cache.sqlite``).
"""

from __future__ import annotations

import argparse
import logging

from ..config import load_config
from ..errors import ConfigError
from ..queries.generate import GenerateConfig, run_generate
from .common import flags_from_args

logger = logging.getLogger(__name__)

# command-line flag (argparse dest) -> dotted config key
_FLAG_KEYS = {
    "input": "input", "output": "output", "num_queries": "num_queries", "prompt_template": "prompt_template",
    "prompt_template_zh": "prompt_template_zh", "language": "language", "shard": "shard", "beir_dir": "beir_dir",
    "base_url": "llm.base_url", "model": "llm.model", "api_key_env": "llm.api_key_env", "backend": "llm.backend",
    "concurrency": "llm.concurrency", "rpm": "llm.requests_per_minute", "temperature": "llm.temperature",
    "max_tokens": "llm.max_tokens", "timeout": "llm.timeout_s", "max_retries": "llm.max_retries",
    "on_failure": "llm.on_failure", "cache": "llm.cache_path",
}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", help="passages JSONL with _id, title, text (BEIR corpus.jsonl or chunk output)")
    parser.add_argument("--output", help="training JSONL to write (query/pos/neg, one line per query)")
    parser.add_argument("--config", help="YAML/JSON file with GenerateConfig fields (an llm: section for the LLM)")
    parser.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://localhost:8000/v1 (vLLM), "
                                           "http://localhost:11434/v1 (Ollama)")
    parser.add_argument("--model", help="model name the server serves (backend hf: a local model folder)")
    parser.add_argument("--api-key-env", help="environment variable holding the API key (default OPENAI_API_KEY)")
    parser.add_argument("--backend", choices=["openai", "hf"], help="HTTP endpoint (default) or local transformers")
    parser.add_argument("--num-queries", type=int, help="questions per passage (default 3)")
    parser.add_argument("--prompt-template", help="template file with {title}, {text}, {n} for every passage")
    parser.add_argument("--prompt-template-zh", help="template file for Chinese passages (language auto)")
    parser.add_argument("--language", choices=["auto", "en", "zh"], help="prompt language (default: auto by CJK share)")
    parser.add_argument("--concurrency", type=int, help="parallel requests (default 8)")
    parser.add_argument("--rpm", type=float, help="max requests per minute, 0 = unlimited (default 0)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--timeout", type=float, help="seconds per request (default 120)")
    parser.add_argument("--max-retries", type=int)
    parser.add_argument("--on-failure", choices=["raise", "skip"],
                        help="after retries: stop with an error, or record the passage as failed and go on")
    parser.add_argument("--cache", help="reply cache file (default OUT.llm-cache.sqlite; 'none' disables)")
    parser.add_argument("--shard", help="I/N: process shard I of N (output gets a .shard-I-of-N suffix)")
    parser.add_argument("--beir-dir", help="also write queries.jsonl + qrels/train.tsv here")
    parser.add_argument("--overwrite", action="store_true", default=None, help="start afresh instead of resuming")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    parser.add_argument("--no-preflight", dest="preflight", action="store_false", default=None,
                        help="skip the GET /models check before starting")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. llm.top_p=0.9 llm.extra_body.seed=1")


def _flags(args: argparse.Namespace) -> dict:
    flags = flags_from_args(args, _FLAG_KEYS)
    for dest in ("overwrite", "progress", "preflight"):
        if getattr(args, dest, None) is not None:
            flags[dest] = getattr(args, dest)
    return flags


def run(args: argparse.Namespace) -> int:
    config = load_config(GenerateConfig, args.config, args.overrides, _flags(args))
    if not config.input or not config.output:
        raise ConfigError("give --input PASSAGES.jsonl and --output OUT.jsonl (or input:/output: in --config)")
    report = run_generate(config)
    print(f"robustir generate: {report.summary()}")
    if report.failed:
        print(f"robustir generate: {report.failed} passage(s) failed, listed in {report.failed_path}; "
              f"re-run the same command to retry them")
    return 0
