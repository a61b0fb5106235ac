"""CLI flags from the stage configs' pydantic fields, built by cyclopts (robustir.cli.common), and the layers."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal, Optional

import pytest
from cyclopts import App, Parameter

from robustir.cli.common import CONFIG, ConfigFile, Overrides, given, record_flags, stage_config
from robustir.cli.main import build_app, main, parse
from robustir.errors import ConfigError
from robustir.validation import cli, config_dataclass


@config_dataclass
class Inner:
    base_url: str = "http://localhost:8000/v1"
    """Where the server listens."""
    retries: Annotated[int, cli("tries")] = 3
    """Tries after a failure."""


@config_dataclass
class Small:
    lr: float = 2e-5
    """Learning rate."""
    steps: Optional[int] = None
    """Stop after
    this many steps."""
    mode: Literal["fast", "slow"] = "fast"
    bf16: bool = False
    """bf16 autocast; 100% optional."""
    names: list[str] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    """Shares, e.g. 0 0.5."""
    inner: Annotated[Inner, cli(flatten=True)] = field(default_factory=Inner)
    options: dict = field(default_factory=dict)
    plain: str = ""
    """A plain string."""


@config_dataclass
class Derived(Small):
    extra: int = 0
    """A field of the subclass."""


def _small_app(cls: type = Small) -> App:
    app = App(name="t", version_flags=[], help_format="plaintext", result_action="return_value", config=[record_flags],
              default_parameter=Parameter(consume_multiple=True, negative_iterable=()))

    def small(*overrides: Overrides, config_file: ConfigFile = None,
              config: Annotated[Small | None, CONFIG] = None):
        assert config is None  # the flags are taken out of the parse into the flags layer
        return stage_config(cls, config_file, overrides)

    small.__annotations__["config"] = Annotated[cls | None, CONFIG]  # the class under test
    app.default(small)

    return app


def _run_small(argv: list[str]) -> Small:
    return _small_app()(argv, exit_on_error=False, print_error=False)


def test_every_field_is_a_flag_from_its_type_and_metadata():
    config = _run_small(["--lr", "0.1", "--steps", "3", "--mode", "slow", "--bf16", "--names", "a", "b", "--rates",
                         "0", "0.5", "--base-url", "http://h/v1", "--tries", "7", "--options.k", "0.25", "--plain", "x"])
    assert (config.lr, config.steps, config.mode, config.bf16, config.names, config.rates) == \
        (0.1, 3, "slow", True, ["a", "b"], [0.0, 0.5])
    assert (config.inner.base_url, config.inner.retries) == ("http://h/v1", 7)  # flattened, renamed
    assert config.options == {"k": 0.25} and config.plain == "x"  # a mapping's value is read as in key=value
    assert _run_small(["--no-bf16"]).bf16 is False


@pytest.mark.parametrize("argv, message", [
    (["--mode", "medium"], "mode: 'medium' is not one of ['fast', 'slow']"),
    (["--steps", "1.5"], "steps: expected an integer"),
    (["--lr", "x"], "lr: expected a number"),
    (["--retries", "1"], "Unknown option: --retries"),  # renamed to --tries
    (["--base-url"], "requires an argument"),
    (["--mdoe", "slow"], "Did you mean --mode"),
])
def test_bad_values_old_names_and_typos_are_refused_naming_the_flag(argv, message):
    import cyclopts

    with pytest.raises((ConfigError, cyclopts.CycloptsError)) as info:
        _run_small(argv)
    assert message in " ".join(str(info.value).split())


def test_help_from_field_docstrings_and_defaults(capsys):
    _small_app()(["--help"], exit_on_error=False, print_error=False)
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for part in ("--lr", "Learning rate.", "[default: 2e-05]", "--steps", "Stop after this many steps.", "--mode",
                 "[choices: fast, slow]", "--bf16 --no-bf16", "100% optional", "--base-url",
                 "Where the server listens.", "--tries", "--rates", "Shares, e.g. 0 0.5"):
        assert part in text, part
    assert "--retries" not in text and "--inner.base-url" not in text and "--empty-names" not in text
    _small_app(Derived)(["--help"], exit_on_error=False, print_error=False)  # a subclass: its own and its bases' help
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "--extra" in text and "A field of the subclass." in text and "Learning rate." in text


def test_precedence_defaults_file_flags_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.1\nsteps: 5\nmode: slow\nbf16: true\ninner:\n  retries: 9\n  base_url: http://file/v1\n")
    config = _run_small(["--config", str(cfg), "--lr", "0.2", "--tries", "1", "--no-bf16", "steps=6",
                         "inner.retries=2"])
    assert config.lr == 0.2  # flag over file
    assert config.steps == 6  # key=value over file
    assert config.inner.retries == 2  # key=value over flag over file
    assert config.inner.base_url == "http://file/v1" and config.mode == "slow"  # file over default (no flag given)
    assert config.bf16 is False  # --no-bf16 over the file's true
    assert config.plain == ""  # default
    assert given() == {"lr": "0.2", "inner": {"retries": "1"}, "bf16": False}  # the flags layer, as given


# ------------------------------------------------------------------------------------------ every converted CLI

HELP_FLAGS = {
    "train": ["--config", "--model", "--train-data", "--eval-data", "--loss", "[choices: infonce, peg, ccr, auto]",
              "--audit", "--filter-positives --no-filter-positives", "--batch-size", "--chunk-size", "--epochs",
              "--max-steps", "--lr", "--seed", "--num-negatives", "--mine", "[choices: bm25, dense, none]",
              "--query-max-length", "--passage-max-length", "--precision", "--gradient-checkpointing", "--device",
              "--loss-options"],
    "pretrain": ["--mode", "[choices: retromae, gur]", "--model", "--data", "--data-format", "--output",
                 "--resume-heads", "--max-length", "--batch-size", "--epochs", "--max-steps", "--lr", "--seed",
                 "--save-steps", "--precision", "--gradient-checkpointing", "--device"],
    "generate": ["--input", "--output", "--base-url", "--model", "--api-key-env", "--backend", "--num-queries",
                 "--prompt-template", "--prompt-template-zh", "--language", "--concurrency", "--rpm", "--temperature",
                 "--max-tokens", "--timeout", "--max-retries", "--on-failure", "--cache", "--shard", "--beir-dir",
                 "--overwrite --no-overwrite", "--progress --no-progress", "--preflight --no-preflight"],
    "filter llm": ["--input", "--output", "--model", "--removed --no-removed", "--shard", "--overwrite",
                   "--no-progress", "--base-url", "--api-key-env", "--concurrency", "--prompt-template", "--cache"],
    "filter teacher": ["--input", "--output", "--model", "--teacher-kind", "[choices: auto, embedding, cross-encoder]",
                       "--absolute-margin", "--relative-margin", "--suspect-positive-share", "--max-length",
                       "--batch-size", "--precision", "--device", "--removed --no-removed"],
    "filter sieve": ["--input", "--output", "--num-negatives", "--train --no-train", "--strict --no-strict",
                     "--variant", "[choices: authors_code, paper]", "--beta", "--temperature", "--lr", "--max-steps",
                     "--work-dir", "--batch-size", "--precision", "--device"],
    "mine": ["--data", "--split", "--input", "--corpus", "--method", "[choices: bm25, dense]", "--num-negatives",
             "--range-min", "--range-max", "--max-score", "--min-score", "--absolute-margin", "--relative-margin",
             "--sampling", "--seed", "--cache-dir", "--corpus-chunk", "--index", "[choices: flat, ivf, hnsw]",
             "--query-batch-size", "--shard", "--overwrite", "--batch-size", "--precision", "--device", "--pooling"],
    "pairs": ["--format", "--text-unit", "--seed", "--repeat", "--window", "--min-weight", "--title --no-title",
              "--lcs --no-lcs", "--shard", "--overwrite"],
    "noise-bench": ["--data", "--model", "--preset", "[choices: cpu, cpu-long, gpu]", "--kinds", "--rates",
                    "--methods", "--seeds", "--output", "--eval-split", "--dev", "--jobs", "--keep-steps --no-keep-steps"],
    "eval": ["--data", "--split", "--output", "--top-k", "--index", "--nprobe",
             "--ignore-identical-ids --no-ignore-identical-ids", "--cache-dir", "--batch-size", "--precision",
             "--device", "--storage-option", "--pooling"],
    "chunk": ["--format", "--text-unit", "--max-tokens", "--overlap", "--min-tokens", "--tokenizer", "--shard"],
    "index": ["--corpus", "--add", "--upsert", "--delete", "--delete-id", "--compact", "--check", "--output",
              "--ann", "--ann-threshold", "--chunk-size", "--storage-option", "--pooling"],
    "serve": ["--model", "--index", "--host", "--port", "--api-key", "--pooling", "--query-instruction",
              "--precision", "--storage-option"],
    "run": ["CONFIG", "--work-dir", "--force", "--until", "--device"],
}


@pytest.mark.parametrize("stage", sorted(HELP_FLAGS))
def test_cli_help_lists_the_flags_with_their_defaults(stage, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main([*stage.split(), "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    missing = [flag for flag in HELP_FLAGS[stage] if flag not in text]
    assert not missing, f"robustir {stage} --help lacks {missing}"
    assert "[default: " in text


def test_help_of_a_multi_line_field_docstring_is_one_paragraph(capsys, monkeypatch):
    """The continuation lines of an attribute docstring are indented in the source: the help joins them into the
    paragraph (not an indented block of their own)."""
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "base_weight x the starting model's (robustir.models.interpolate); 0 = the fine-tuned weights." in out


def _parsed(argv: list[str]) -> tuple[tuple, dict]:
    """The positional arguments (key=value overrides) and keywords of a command line; the flags layer recorded."""
    _, bound = parse(argv)
    return tuple(bound.args), dict(bound.kwargs)


def test_train_flags_reach_the_config(tmp_path):
    from robustir.cli.train import build_config

    cfg = tmp_path / "t.yaml"
    cfg.write_text("bf16: true\nlr: 1.0e-5\nmine: dense\n")
    overrides, kw = _parsed(["train", "--config", str(cfg), "--lr", "3e-5", "--no-mine", "--chunk-size", "4"])
    config = build_config(overrides, kw["config_file"])
    assert (config.lr, config.mine, config.chunk_size, config.precision) == (3e-5, "none", 4, "bf16")  # bf16: true
    overrides, kw = _parsed(["train", "--config", str(cfg), "--no-bf16", "--mine", "bm25", "lr=4e-5",
                             "--loss-options.temperature", "0.02"])
    config = build_config(overrides, kw["config_file"])
    assert (config.precision, config.mine, config.lr) == ("fp32", "bm25", 4e-5)  # --no-bf16
    assert config.loss_options == {"temperature": 0.02}


def test_pretrain_flags_reach_the_config():
    from robustir.cli.pretrain import build_config

    overrides, kw = _parsed(["pretrain", "--mode", "gur", "--resume-heads", "h", "--gradient-checkpointing",
                             "--max-length", "64", "temperature=0.05"])
    config = build_config(overrides, kw.get("config_file"))
    assert (config.mode, config.heads, config.gradient_checkpointing, config.max_length, config.temperature) == \
        ("gur", "h", True, 64, 0.05)


def test_generate_flags_reach_the_config(tmp_path):
    from robustir.cli.generate import build_config

    cfg = tmp_path / "g.yaml"
    cfg.write_text("num_queries: 5\nllm:\n  temperature: 0.1\n  model: from-file\n")
    overrides, kw = _parsed(["generate", "--config", str(cfg), "--model", "m", "--rpm", "30", "--timeout", "5",
                             "--cache", "none", "--no-preflight", "--temperature", "0.3", "llm.temperature=0.5"])
    config = build_config(overrides, kw["config_file"])
    assert (config.llm.model, config.llm.requests_per_minute, config.llm.timeout_s, config.llm.cache_path) == \
        ("m", 30.0, 5.0, "none")
    assert config.preflight is False and config.progress is True and config.num_queries == 5
    assert config.llm.temperature == 0.5  # key=value over flag over file


@pytest.mark.parametrize("spelling", ["method-flag", "sub-command"])
def test_filter_flags_reach_each_methods_config(spelling):
    from robustir.cli.filter import build_config
    from robustir.filtering.llm_judge import JudgeConfig
    from robustir.filtering.sieve import SieveConfig
    from robustir.filtering.teacher import TeacherFilterConfig

    def method(name: str) -> list[str]:
        return ["filter", "--method", name] if spelling == "method-flag" else ["filter", name]

    io = ["--input", "in.jsonl", "--output", "out.jsonl"]
    overrides, _ = _parsed([*method("llm"), *io, "--model", "m", "--base-url", "http://h/v1", "--cache", "c.sqlite",
                            "--no-removed", "--shard", "1/2"])
    config = build_config("llm", overrides)
    assert isinstance(config, JudgeConfig)
    assert (config.input, config.output) == ("in.jsonl", "out.jsonl")
    assert (config.llm.model, config.llm.base_url, config.llm.cache_path) == ("m", "http://h/v1", "c.sqlite")
    assert (config.keep_removed, config.shard) == (False, "1/2")
    overrides, kw = _parsed([*method("teacher"), *io, "--model", "t", "--teacher-kind", "cross-encoder",
                             "--relative-margin", "0.1", "--bf16", "--batch-size", "8"])
    config = build_config("teacher", overrides)
    assert isinstance(config, TeacherFilterConfig) and (kw["input"], kw["output"]) == ("in.jsonl", "out.jsonl")
    assert (config.model, config.kind, config.relative_margin, config.precision, config.batch_size) == \
        ("t", "cross-encoder", 0.1, "bf16", 8)
    overrides, _ = _parsed([*method("sieve"), *io, "--no-train", "--strict", "--num-negatives", "3", "--lr", "1e-6",
                            "--no-progress", "beta=0.5"])
    config = build_config("sieve", overrides)
    assert isinstance(config, SieveConfig)
    assert (config.train, config.strict, config.num_negatives, config.lr, config.progress, config.beta) == \
        (False, True, 3, 1e-6, False, 0.5)


def test_a_flag_given_twice_takes_the_last_value_and_a_list_flag_collects():
    from robustir.cli.mine import mining_config
    from robustir.cli.noise_bench import build_config

    _parsed(["mine", "--output", "o", "--num-negatives", "3", "--index", "ivf", "--num-negatives", "5"])
    assert (mining_config().num_negatives, mining_config().index.kind) == (5, "ivf")
    overrides, _ = _parsed(["noise-bench", "--seeds", "1", "--seeds", "2", "3"])
    assert build_config(overrides).seeds == [1, 2, 3]


def test_filter_names_the_method_of_another_methods_flag_and_suggests_for_a_typo(capsys):
    assert main(["filter", "--method", "teacher", "--input", "i", "--output", "o", "--beta", "0.5"]) == 2
    assert "--method teacher does not use --beta (an option of --method sieve)" in capsys.readouterr().err
    assert main(["filter", "sieve", "--input", "i", "--output", "o", "--bta", "0.5"]) == 2
    assert "Unknown option: --bta. Did you mean --beta?" in capsys.readouterr().err


def test_mine_flags_reach_the_config():
    from robustir.cli.mine import mining_config

    _parsed(["mine", "--data", "d", "--output", "o", "--index", "hnsw", "--num-negatives", "5", "--relative-margin",
             "0.05", "--batch-size", "8", "--bf16"])
    config = mining_config()
    assert (config.index.kind, config.num_negatives, config.relative_margin) == ("hnsw", 5, 0.05)
    assert (config.encode_batch_size, config.precision, config.method, config.range_max) == (8, "bf16", "bm25", 100)


def test_pairs_flags_reach_the_config():
    from robustir.cli.pairs import build_config

    overrides, kw = _parsed(["pairs", "--input", "i", "--output", "o", "--no-title", "--no-lcs", "--min-weight", "2.5",
                             "max_candidates=50"])
    config = build_config(overrides, kw.get("config_file"))
    assert (config.use_title, config.require_lcs, config.min_weight, config.max_candidates) == (False, False, 2.5, 50)
    _parsed(["pairs", "--input", "i", "--output", "o"])
    assert build_config().use_title is True


def test_noise_bench_flags_reach_the_config():
    from robustir.cli.noise_bench import build_config

    overrides, _ = _parsed(["noise-bench", "budget.epochs=2", "--preset", "gpu", "--kinds", "chunk-fn", "fp-hard",
                            "--rates", "0", "0.2", "--seeds", "1", "2", "--methods", "peg"])
    config = build_config(overrides)
    assert (config.preset, config.kinds, config.rates, config.seeds, config.methods, config.budget) == \
        ("gpu", ["chunk-fn", "fp-hard"], [0.0, 0.2], [1, 2], ["peg"], {"epochs": 2})
    overrides, _ = _parsed(["noise-bench", "--kinds", "no-such-kind"])
    with pytest.raises(ConfigError, match="no-such-kind"):
        build_config(overrides)


def test_eval_and_chunk_flags_reach_the_config():
    from robustir.cli.chunk import build_config as chunk_config
    from robustir.cli.evaluate import build_config as eval_config

    _parsed(["eval", "--top-k", "10", "--index", "ivf", "--nprobe", "4", "--ignore-identical-ids", "--batch-size", "16"])
    config = eval_config()
    assert (config.top_k, config.index.kind, config.index.nprobe, config.ignore_identical_ids, config.batch_size,
            config.precision) == (10, "ivf", 4, True, 16, "auto")
    _parsed(["eval", "--precision", "fp16"])
    assert eval_config().precision == "fp16"
    _parsed(["chunk", "--input", "i", "--output", "o", "--max-tokens", "10", "--tokenizer", "tok"])
    config = chunk_config()
    assert (config.max_tokens, config.overlap, config.min_tokens, config.tokenizer) == (10, 1, 32, "tok")


COMMAND_CONFIGS = {  # command -> its config class (module, name)
    "train": ("robustir.training.arguments", "TrainConfig"),
    "pretrain": ("robustir.pretraining.pretrain", "PretrainConfig"),
    "generate": ("robustir.queries.generate", "GenerateConfig"),
    "mine": ("robustir.negatives.mining", "MiningConfig"),
    "eval": ("robustir.evaluation.retrieval", "EvalConfig"),
    "index": ("robustir.index.store", "IndexConfig"),
    "serve": ("robustir.serving.config", "ServeConfig"),
    "noise-bench": ("robustir.robustness.bench", "NoiseBenchConfig"),
    "classify": ("robustir.evaluation.classify", "ClassifyConfig"),
    "pairs": ("robustir.queries.pairs", "PairMiningConfig"),
    "chunk": ("robustir.data.chunking", "ChunkConfig"),
    "audit": ("robustir.audit.run", "AuditConfig"),
    "filter llm": ("robustir.filtering.llm_judge", "JudgeConfig"),
    "filter teacher": ("robustir.filtering.teacher", "TeacherFilterConfig"),
    "filter sieve": ("robustir.filtering.sieve", "SieveConfig"),
}


def _field_paths(cls: type, prefix: str = "") -> set[str]:
    """Every field of config ``cls`` by its path, a section's fields in its place."""
    import dataclasses
    import typing

    from robustir.cli.common import _section

    paths: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _section(hints[f.name])
        paths |= _field_paths(section, f"{prefix}{f.name}.") if section else {prefix + f.name}
    return paths


@pytest.mark.parametrize("command", sorted(COMMAND_CONFIGS))
def test_every_field_of_a_stage_config_has_a_flag(command):
    """No command keeps a field list: a field added to a config is a flag of its command at once."""
    import importlib

    module, name = COMMAND_CONFIGS[command]
    cls = getattr(importlib.import_module(module), name)
    app = build_app()
    for part in command.split():
        app = app[part]
    root = next(a for a in app.assemble_argument_collection() if not a.keys and a.field_info.name == "config")
    flagged = {".".join(a.keys) for a in root.children_recursive if a.parse and a.name}
    assert _field_paths(cls) - flagged == set()


def test_bm25s_keeps_the_log_level_set_before_it_is_imported():
    """bm25s sets its logger to DEBUG on import, after the CLI has quietened it (issue 34): the level set first stays."""
    import subprocess
    import sys

    code = ("import logging; logging.getLogger('bm25s').setLevel(logging.WARNING); "
            "from robustir.index.bm25 import import_bm25s; import_bm25s(); print(logging.getLogger('bm25s').level)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(30)


def test_yaml_merge_keys_are_defaults_that_the_mapping_overrides(tmp_path):
    """Issue 35 ('unclear'): ``<<: *defaults`` was refused with a parser message. A key given twice among the
    mapping's own keys is still an error."""
    from robustir.config import read_config_file
    from robustir.errors import ConfigError

    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &base\n  lr: 0.001\n  epochs: 1\ntrain:\n  <<: *base\n  epochs: 2\n")
    assert read_config_file(merged)["train"] == {"lr": 0.001, "epochs": 2}
    twice = tmp_path / "twice.yaml"
    twice.write_text("base: &base\n  lr: 0.001\ntrain:\n  <<: *base\n  epochs: 2\n  epochs: 3\n")
    with pytest.raises(ConfigError, match="option 'epochs' is given twice \\(line 6\\)"):
        read_config_file(twice)


def test_bundled_data_is_a_path_for_every_command(capsys):
    """Issue 34: ``--data bundled:scifact`` was refused ('not a folder') by every command but run and pretrain."""
    from robustir.cli.main import _bundled, main
    from robustir.resources import dataset_path

    folder = str(dataset_path("scifact"))
    assert _bundled("bundled:scifact") == folder
    assert _bundled("--data=bundled:scifact") == f"--data={folder}"
    assert _bundled("eval.data=bundled:scifact") == f"eval.data={folder}"
    assert _bundled("a bundled:scifact text") == "a bundled:scifact text"
    assert main(["eval", "--data", "bundled:nope", "--output", "x"]) == 2
    assert "no bundled dataset 'nope'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ issue 52 (items 7-9)

ALL_STAGES = ["demo", "eval", "rerank-eval", "classify", "encode", "chunk", "generate", "pairs", "mine", "filter llm",
              "filter teacher", "filter sieve", "merge", "train", "pretrain", "run", "audit", "noise-bench", "index",
              "serve"]


def _flag_tokens(text: str) -> set[str]:
    import re

    return set(re.findall(r"--[A-Za-z][\w.-]*", text.replace("│", " ")))


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_help_never_cuts_a_flag_name_at_80_columns(stage, capsys, monkeypatch):
    """Issue 52, item 9: at 80 columns cyclopts' flag column (35 %) cut ``--no-gradient-checkpointing`` into
    ``--no-gradient-checkpointin`` / ``g``. Every flag name shown at 80 and 60 columns is one shown whole at 250."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main([*stage.split(), "--help"]) == 0
    wide = _flag_tokens(capsys.readouterr().out)
    for columns in ("80", "60"):
        monkeypatch.setenv("COLUMNS", columns)
        assert main([*stage.split(), "--help"]) == 0
        cut = _flag_tokens(capsys.readouterr().out) - wide
        assert not cut, f"robustir {stage} --help at {columns} columns cuts {sorted(cut)}"


@pytest.mark.parametrize("stage", ["serve", "index", "encode", "eval", "rerank-eval", "mine"])
def test_help_of_a_command_that_loads_a_model_shows_the_models_own_encoder_settings(stage, capsys, monkeypatch):
    """Issue 52, item 9: ``serve`` and ``index`` help showed EncoderConfig's defaults for a new model (pooling cls,
    64 / 256 tokens), which a loaded model does not use: its own settings stand unless a flag is given."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main([*stage.split(), "--help"]) == 0
    rows = [line.replace("│", " ").split() for line in capsys.readouterr().out.splitlines()]
    lines = {words[0]: " ".join(words) for words in rows if words and words[0].startswith("--")}
    for flag in ("--pooling", "--query-max-length", "--passage-max-length", "--query-instruction",
                 "--passage-instruction", "--normalize"):
        line = lines[flag]
        assert "[default: the model's own]" in line, line
        assert "[default: cls]" not in line and "[default: 64]" not in line and "[default: 256]" not in line


def test_encoder_flags_of_serve_still_reach_the_options():
    from robustir.cli.common import encoder_options

    from robustir.models.encoder import EncoderConfig

    _parsed(["serve", "--pooling", "mean", "--query-max-length", "32", "--no-normalize"])
    options = encoder_options()
    assert options["passage_max_length"] is None and options["query_instruction"] is None  # the model's own
    given = EncoderConfig(**{k: v for k, v in options.items() if v is not None})
    assert given.pooling == "mean" and given.query_max_length == 32 and given.normalize is False


SEEDED = {  # every stage config with a seed: (module, class, field, other required fields)
    "train": ("robustir.training.arguments", "TrainConfig", "seed", {}),
    "pretrain": ("robustir.pretraining.pretrain", "PretrainConfig", "seed", {}),
    "mine": ("robustir.negatives.mining", "MiningConfig", "seed", {}),
    "filter teacher": ("robustir.filtering.teacher", "TeacherFilterConfig", "seed", {}),
    "filter sieve": ("robustir.filtering.sieve", "SieveConfig", "seed", {}),
    "pairs": ("robustir.queries.pairs", "PairMiningConfig", "seed", {}),
    "classify": ("robustir.evaluation.classify", "ClassifyConfig", "seed", {}),
    "audit": ("robustir.audit.run", "AuditConfig", "seed", {"data": "d.jsonl", "output": "out"}),
    "run": ("robustir.pipeline", "QueriesStage", "seed", {}),
    "generate": ("robustir.llm.config", "LLMConfig", "seed", {}),
}


@pytest.mark.parametrize("stage", sorted(SEEDED))
@pytest.mark.parametrize("seed", [99999999999999999999999, 2**32, -1])
def test_a_seed_outside_numpys_range_is_refused_naming_the_range(stage, seed):
    """Issue 52, item 7: ``train --seed 99999999999999999999999`` was numpy's traceback (seeds are 0 .. 2**32 - 1);
    every stage with a seed refuses it when its config is built, naming the range."""
    import importlib

    module, name, key, required = SEEDED[stage]
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(ConfigError, match=r"seed = .* is out of range: it must be >= 0 and <= 4294967295 \(numpy"):
        cls(**required, **{key: seed})
    cls(**required, **{key: 2**32 - 1})  # the top of the range is a seed


def test_noise_bench_seeds_outside_numpys_range_are_refused():
    from robustir.robustness.bench import NoiseBenchConfig

    with pytest.raises(ConfigError, match=r"seeds\[1\] = 4294967296 is out of range.*numpy"):
        NoiseBenchConfig(seeds=[1, 2**32])


def test_a_comma_separated_list_flag_is_split(capsys):
    """``--seeds 1,2`` reaches the config as ``["1,2"]`` from cyclopts: split like a ``key=value`` override, so the
    range check names the item (it said ``seeds[0]: expected an integer, got '1,4294967296'``)."""
    from robustir.robustness.bench import NoiseBenchConfig

    assert NoiseBenchConfig(seeds=["1,2"], rates=["0,0.2"]).seeds == [1, 2]
    assert main(["noise-bench", "--data", "d", "--output", "o", "--seeds", "1,4294967296"]) == 2
    assert "seeds[1] = 4294967296 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "--seed", "99999999999999999999999"], "seed = 99999999999999999999999 is out of range"),
    (["train", "--epochs", "1e308"], "epochs = 1e308 is out of range: it must be > 0 and <= 1000000"),
    (["train", "--max-steps", "1e12"], "max_steps"),
    (["pretrain", "--epochs", "1e308"], "epochs = 1e308 is out of range"),
    (["filter", "sieve", "--epochs", "1e308", "--input", "x.jsonl", "--output", "y.jsonl"], "epochs = 1e308"),
    (["audit", "--data", "x.jsonl", "--output", "out", "--bootstrap", "0"], "bootstrap = 0 is out of range: it must "
                                                                            "be >= 40"),
    (["serve", "--rerank-model", ""], "rerank_model is empty"),
    (["train", "--model", " "], "model is empty"),
])
def test_issue_52_bad_values_are_clear_errors(argv, message, capsys, tmp_path, monkeypatch):
    """Issue 52, items 7 and 8: each is refused with exit status 2 and a one-line message, before any work."""
    monkeypatch.chdir(tmp_path)  # the relative outputs, had a command run
    assert main(argv) == 2
    assert not list(tmp_path.iterdir())  # nothing written
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_epochs_times_steps_per_epoch_over_the_bound_is_a_clear_error():
    """Within its own range, epochs x steps per epoch can still be over what a run takes (tqdm's OverflowError at
    1e308): the step count is checked where it is computed."""
    from robustir.training.loop import steps_for_epochs
    from robustir.validation import MAX_STEPS

    assert steps_for_epochs(1.5, 10) == 15 and steps_for_epochs(0.01, 10) == 1
    with pytest.raises(ConfigError, match="epochs = 1e\\+06 x 10000 steps per epoch = 1e\\+10 optimizer steps; a run "
                                          f"takes at most {MAX_STEPS:,}: lower epochs, or set max_steps"):
        steps_for_epochs(1e6, 10_000)
