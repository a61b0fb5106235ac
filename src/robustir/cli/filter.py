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
from dataclasses import replace

from ..config import load_config
from ..errors import ConfigError
from ..filtering.llm_judge import JudgeConfig
from ..filtering.sieve import SieveConfig
from ..filtering.teacher import TeacherFilterConfig
from .common import add_method_flags, add_precision_arg, flags_from_args

CONFIGS = {"llm": JudgeConfig, "teacher": TeacherFilterConfig, "sieve": SieveConfig}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, choices=["llm", "teacher", "sieve"])
    parser.add_argument("--input", required=True, help="training JSONL with query/pos/neg (e.g. from robustir mine)")
    parser.add_argument("--output", required=True, help="new JSONL to write (never the input)")
    parser.add_argument("--config", help="YAML/JSON file with the method's options")
    # a flag for every field of the three configs: shared ones in the main group, the others by method
    keys = add_method_flags(parser, CONFIGS)
    add_precision_arg(parser, generated=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. beta=0.5")
    parser.set_defaults(_flag_keys=keys)  # method -> {dest: config key}


def build_config(args: argparse.Namespace) -> JudgeConfig | TeacherFilterConfig | SieveConfig:
    """The method's config: defaults < --config file < flags < key=value overrides."""
    own = args._flag_keys[args.method]
    foreign = sorted({dest for keys in args._flag_keys.values() for dest in keys if dest not in own
                      and getattr(args, dest, None) is not None})
    if foreign:  # a flag of another method would be silently ignored
        owners = {dest: "/".join(m for m, keys in args._flag_keys.items() if dest in keys) for dest in foreign}
        raise ConfigError(f"--method {args.method} does not use {', '.join('--' + d.replace('_', '-') for d in foreign)} "
                          f"(an option of --method {', '.join(sorted(set(owners.values())))}); remove it or change "
                          "--method")
    flags = flags_from_args(args, own)
    return load_config(CONFIGS[args.method], args.config, args.overrides, flags)


def run(args: argparse.Namespace) -> int:
    from ..runs import Job, execute
    from ..steps import get_step

    config = build_config(args)  # checked first: a bad option is an error even when the output is complete
    if args.method == "llm":  # the judge's output is complete only when no judgement failed (those are retried)
        return _run_llm(args, config)
    # the teacher / sieve model by its content (a model retrained in place is a changed input), not by its path
    result = execute(get_step(f"filter {args.method}"), config, Job(args.output, {"input": args.input}, config.shard),
                     overwrite=bool(args.overwrite))
    if not result.skipped:
        print(f"robustir filter: {result.report.summary()}")
        print(f"robustir filter: report {result.artifact.path}.report.json")
    return 0


def _run_llm(args: argparse.Namespace, config: JudgeConfig) -> int:
    from ..filtering.llm_judge import run_judge

    if not config.llm.model:
        raise ConfigError("--method llm needs --model (the model name the server serves) and --base-url")
    report = run_judge(replace(config, overwrite=bool(args.overwrite) or config.overwrite), args.input, args.output,
                       say=print)
    print(f"robustir filter: {report.summary()}")
    if report.failed_path:
        print(f"robustir filter: {report.failed_records} record(s) with failed judgements (negatives kept for now), "
              f"listed in {report.failed_path}; re-run the same command to judge them again")
    return 0
