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

from typing import Annotated

from cyclopts import App, Parameter

from ..errors import ConfigError
from ..filtering.llm_judge import JudgeConfig
from ..filtering.sieve import SieveConfig
from ..filtering.teacher import TeacherFilterConfig
from .common import CONFIG, ConfigFile, Overrides, stage_config

CONFIGS = {"llm": JudgeConfig, "teacher": TeacherFilterConfig, "sieve": SieveConfig}
Input = Annotated[str, Parameter(help="training JSONL with query/pos/neg (e.g. from robustir mine)")]
Output = Annotated[str, Parameter(help="new JSONL to write (never the input)")]

command = App(name="filter", help="Remove false negatives from a training JSONL into a new file: robustir filter "
                                  "llm|teacher|sieve --input IN --output OUT (--method NAME is the same).")


@command.command(name="llm")
def llm(*overrides: Overrides, config_file: ConfigFile = None,
        config: Annotated[JudgeConfig | None, CONFIG] = None) -> int:
    """PEG: ask an LLM whether each negative (--judge-positives: each positive too) is relevant to its query (--input, --output, --base-url, --model)."""
    return run("llm", overrides, config_file)


@command.command(name="teacher")
def teacher(*overrides: Overrides, input: Input, output: Output, config_file: ConfigFile = None,
            config: Annotated[TeacherFilterConfig | None, CONFIG] = None) -> int:
    """NV-Retriever: drop negatives a teacher scores close to the positive (embedding model or cross-encoder)."""
    return run("teacher", overrides, config_file, input, output)


@command.command(name="sieve")
def sieve(*overrides: Overrides, input: Input, output: Output, config_file: ConfigFile = None,
          config: Annotated[SieveConfig | None, CONFIG] = None) -> int:
    """CCR passage sieve: brief CCR training, then drop negatives above the mean cosine of their pool."""
    return run("sieve", overrides, config_file, input, output)


def flag_owners(flag: str) -> list[str]:
    """The methods that have ``flag`` (``--beta``: sieve), for the error about a flag another method takes."""
    owners = []
    for method in CONFIGS:
        arguments = command[method].assemble_argument_collection()
        if any(flag in argument.names for argument in arguments):
            owners.append(method)
    return owners


def build_config(method: str, overrides=(), config_file: str | None = None):
    """The method's config: defaults < --config file < flags < key=value overrides."""
    return stage_config(CONFIGS[method], config_file, overrides)


def run(method: str, overrides=(), config_file: str | None = None, input: str | None = None,
        output: str | None = None) -> int:
    from ..runs import Job, execute
    from ..steps import get_step

    config = build_config(method, overrides, config_file)  # a bad option is an error even when the output is complete
    if method == "llm":  # the judge's output is complete only when no judgement failed (those are retried)
        return _run_llm(config)
    # the teacher / sieve model by its content (a model retrained in place is a changed input), not by its path
    result = execute(get_step(f"filter {method}"), config, Job(output, {"input": input}, config.shard),
                     overwrite=config.overwrite)
    if not result.skipped:
        print(f"robustir filter: {result.report.summary()}")
        print(f"robustir filter: report {result.artifact.path}.report.json")
    return 0


def _run_llm(config: JudgeConfig) -> int:
    from ..filtering.llm_judge import run_judge

    if not config.input or not config.output:
        raise ConfigError("filter llm needs --input (the training JSONL) and --output (a new JSONL), or input: / "
                          "output: in --config")
    if not config.llm.model:
        raise ConfigError("--method llm needs --model (the model name the server serves) and --base-url")
    report = run_judge(config, config.input, config.output, say=print)
    print(f"robustir filter: {report.summary()}")
    if report.failed_path:
        print(f"robustir filter: {report.failed_records} record(s) with failed judgements (negatives kept for now), "
              f"listed in {report.failed_path}; re-run the same command to judge them again")
    return 0
