"""``robustir filter``: remove false negatives from a training JSONL into a NEW file (plus ``OUT.report.json``).

Methods::

    # PEG: ask an LLM whether each negative is relevant to its query
    robustir filter --method llm --input mined.jsonl --output clean.jsonl \\
        --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-7B-Instruct
    # NV-Retriever: drop negatives a teacher scores within 5% of the positive (embedding model or cross-encoder)
    robustir filter --method teacher --input mined.jsonl --output clean.jsonl [--model TEACHER] --relative-margin 0.05
    # CCR passage sieve: brief CCR training, then drop negatives above the mean cosine of their pool
    robustir filter --method sieve --input mined.jsonl --output clean.jsonl --num-negatives 7 [--no-train] [--strict]

``--config FILE`` (YAML/JSON) and trailing ``key=value`` overrides set any option of the method's config
(:class:`~robustir.filtering.llm_judge.JudgeConfig`, :class:`~robustir.filtering.teacher.TeacherFilterConfig`,
:class:`~robustir.filtering.sieve.SieveConfig`). The input is never overwritten; a complete output is left alone
(``--overwrite`` redoes it); an interrupted run resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import load_config
from ..outputs import StageOutput
from ..errors import ConfigError
from ..io import Shard
from .common import flags_from_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=["llm", "teacher", "sieve"])
    parser.add_argument("--input", required=True, help="training JSONL with query/pos/neg (e.g. from robustir mine)")
    parser.add_argument("--output", required=True, help="new JSONL to write (never the input)")
    parser.add_argument("--config", help="YAML/JSON file with the method's options")
    parser.add_argument("--model", help="llm: model name on the server; teacher: teacher folder; sieve: starting "
                                        "model (teacher/sieve default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--no-removed", dest="keep_removed", action="store_false", default=None,
                        help="do not add the 'removed' list (text + reason) to each record")
    parser.add_argument("--shard", help="I/N: filter shard I of N of the records (output gets a shard suffix)")
    parser.add_argument("--overwrite", action="store_true", default=None, help="redo a complete output")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    llm = parser.add_argument_group("llm")
    llm.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://localhost:8000/v1")
    llm.add_argument("--api-key-env", help="environment variable holding the API key")
    llm.add_argument("--concurrency", type=int)
    llm.add_argument("--prompt-template", help="template file with {query} and {passage}")
    llm.add_argument("--cache", help="reply cache file (default OUT.llm-cache.sqlite; 'none' disables)")
    teacher = parser.add_argument_group("teacher")
    teacher.add_argument("--teacher-kind", choices=["auto", "embedding", "cross-encoder"])
    teacher.add_argument("--absolute-margin", type=float, help="remove if score > positive - margin")
    teacher.add_argument("--relative-margin", type=float,
                         help="remove if score > positive * (1 - margin) (default 0.05; 'none' via override)")
    teacher.add_argument("--suspect-positive-share", type=float,
                         help="also remove a positive when more than this share of its negatives score above it "
                              "(false positives; e.g. 0.5; default off)")
    teacher.add_argument("--max-length", type=int, help="teacher token limit")
    sieve = parser.add_argument_group("sieve")
    sieve.add_argument("--num-negatives", type=int, help="negatives wanted per query (pool = 2x; default 15)")
    sieve.add_argument("--no-train", dest="train", action="store_false", default=None,
                       help="skip the brief CCR training; sieve with the model as it is")
    sieve.add_argument("--strict", action="store_true", default=None, help="remove ties with the mean (authors)")
    sieve.add_argument("--variant", choices=["authors_code", "paper"], help="CCR loss variant (default authors_code)")
    sieve.add_argument("--beta", type=float)
    sieve.add_argument("--temperature", type=float)
    sieve.add_argument("--lr", type=float, help="brief-training learning rate (default 1e-5; paper 1e-7)")
    sieve.add_argument("--max-steps", type=int, help="cap the brief training (default: 1 epoch)")
    sieve.add_argument("--work-dir", help="brief-training folder (default OUT.sieve-work)")
    enc = parser.add_argument_group("encoding (teacher, sieve)")
    enc.add_argument("--batch-size", type=int)
    enc.add_argument("--bf16", action="store_true", default=None, help="bfloat16 autocast for encoding")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. beta=0.5")


_COMMON = {"keep_removed": "keep_removed", "overwrite": "overwrite", "progress": "progress"}


def run(args: argparse.Namespace) -> int:
    shard = Shard.parse(args.shard)
    target = StageOutput(args.output, shard, reports=True)
    output = target.path
    if Path(args.input).resolve() == Path(output).resolve():
        raise ConfigError(f"--output {output} is the input file; filters never overwrite their input")
    report_path = target.report
    if target.complete() and not args.overwrite:
        print(f"robustir filter: {output} is complete; nothing to do (--overwrite to redo)")
        return 0
    if args.method == "llm":
        return _run_llm(args)
    if args.method == "teacher":
        from ..filtering.teacher import TeacherFilterConfig, teacher_filter

        flags = flags_from_args(args, {**_COMMON, "model": "model", "teacher_kind": "kind", "absolute_margin": "absolute_margin",
                             "relative_margin": "relative_margin", "max_length": "max_length",
                             "suspect_positive_share": "suspect_positive_share",
                             "batch_size": "batch_size", "bf16": "bf16", "shard": "shard"})
        config = load_config(TeacherFilterConfig, args.config, args.overrides, flags)
        report = teacher_filter(args.input, output, config)
    else:
        from ..filtering.sieve import SieveConfig, sieve_negatives

        flags = flags_from_args(args, {**_COMMON, "model": "model", "num_negatives": "num_negatives", "train": "train",
                             "strict": "strict", "variant": "variant", "beta": "beta", "temperature": "temperature",
                             "lr": "lr", "max_steps": "max_steps", "work_dir": "work_dir",
                             "batch_size": "batch_size", "bf16": "bf16", "shard": "shard"})
        config = load_config(SieveConfig, args.config, args.overrides, flags)
        report = sieve_negatives(args.input, output, config)
    print(f"robustir filter: {report.summary()}")
    print(f"robustir filter: report {report_path}")
    return 0


def _run_llm(args: argparse.Namespace) -> int:
    from ..filtering.llm_judge import JudgeConfig, run_judge

    flags = flags_from_args(args, {**_COMMON, "prompt_template": "prompt_template", "base_url": "llm.base_url",
                         "model": "llm.model", "api_key_env": "llm.api_key_env", "concurrency": "llm.concurrency",
                         "cache": "llm.cache_path", "shard": "shard"})
    config = load_config(JudgeConfig, args.config, args.overrides, flags)
    if not config.llm.model:
        raise ConfigError("--method llm needs --model (the model name the server serves) and --base-url")
    report = run_judge(config, args.input, args.output)
    print(f"robustir filter: {report.summary()}")
    return 0
