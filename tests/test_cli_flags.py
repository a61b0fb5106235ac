"""CLI flags generated from the stage configs' pydantic field info (robustir.cli.common.add_config_flags)."""

from __future__ import annotations

import argparse
from dataclasses import field
from typing import Literal, Optional

import pytest

from robustir.cli.common import _argparse_kind, add_config_flags, config_flags, flags_from_args
from robustir.cli.main import build_parser, main
from robustir.config import load_config
from robustir.validation import cli, config_dataclass, field_help


@config_dataclass
class Inner:
    base_url: str = "http://localhost:8000/v1"
    """Where the server listens."""
    retries: int = field(default=3, metadata=cli("tries"))
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
    inner: Inner = field(default_factory=Inner, metadata=cli(flatten=True))
    options: dict = field(default_factory=dict)
    internal: int = field(default=1, metadata=cli(hidden=True))
    plain: str = ""
    """A plain string."""


@config_dataclass
class Derived(Small):
    extra: int = 0
    """A field of the subclass."""


def _small_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config")
    return parser, add_config_flags(parser, Small)


def test_generator_gives_every_field_a_flag_from_its_type_and_metadata():
    parser, keys = _small_parser()
    # no field list anywhere: every field that can be a flag is one; the section's fields under their own names,
    # a renamed one under its new name; the mapping and the hidden field have none
    assert keys == {"lr": "lr", "steps": "steps", "mode": "mode", "bf16": "bf16", "names": "names", "rates": "rates",
                    "base_url": "inner.base_url", "tries": "inner.retries", "plain": "plain"}
    args = parser.parse_args(["--lr", "0.5", "--steps", "7", "--mode", "slow", "--bf16", "--names", "a", "b",
                              "--rates", "0", "0.5", "--base-url", "http://h/v1", "--tries", "4", "--plain", "p"])
    assert (args.lr, args.steps, args.mode, args.bf16, args.names, args.rates) == (0.5, 7, "slow", True, ["a", "b"],
                                                                                     [0.0, 0.5])
    assert type(args.steps) is int and type(args.lr) is float
    assert flags_from_args(args, keys) == {"lr": 0.5, "steps": 7, "mode": "slow", "bf16": True, "names": ["a", "b"],
                                           "rates": [0.0, 0.5], "inner": {"base_url": "http://h/v1", "retries": 4},
                                           "plain": "p"}
    assert parser.parse_args(["--no-bf16"]).bf16 is False
    # every flag defaults to None: nothing given, nothing overrides a config file
    absent = parser.parse_args([])
    assert all(getattr(absent, dest) is None for dest in keys) and flags_from_args(absent, keys) == {}


def test_a_subclass_gets_its_bases_flags_and_help():
    parser = argparse.ArgumentParser()
    keys = add_config_flags(parser, Derived)
    assert keys["extra"] == "extra" and keys["lr"] == "lr"
    assert field_help(Derived, "lr") == "Learning rate."  # pydantic documents a field in the class declaring it
    assert field_help(Derived, "extra") == "A field of the subclass."


@pytest.mark.parametrize("argv", [["--mode", "medium"], ["--steps", "1.5"], ["--lr", "x"], ["--retries", "1"],
                                  ["--options", "{}"], ["--internal", "2"]])
def test_generator_rejects_bad_values_old_names_and_fields_without_a_flag(argv):
    parser, _ = _small_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


def test_generator_help_from_field_docstrings_and_defaults():
    assert field_help(Small, "lr") == "Learning rate."
    assert field_help(Small, "steps") == "Stop after this many steps."  # attribute docstring, one line
    assert field_help(Inner, "retries") == "Tries after a failure."
    assert field_help(Small, "mode") == ""
    parser, _ = _small_parser()
    text = " ".join(parser.format_help().split())
    assert "--lr LR Learning rate (default: 2e-05)" in text
    assert "--steps STEPS Stop after this many steps (default: None)" in text
    assert "--mode {fast,slow} default: fast" in text
    assert "--bf16, --no-bf16 bf16 autocast; 100% optional (default: False)" in text  # % survives argparse
    assert "--base-url BASE_URL Where the server listens (default: http://localhost:8000/v1)" in text
    assert "--rates RATES [RATES ...] Shares, e.g. 0 0.5 (default: [])" in text
    assert "--plain PLAIN A plain string (default: '')" in text


def test_a_flag_the_command_defines_itself_is_left_to_it():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=str, help="the command's own")
    keys = add_config_flags(parser, Small)
    assert "lr" not in keys and parser.parse_args(["--lr", "x"]).lr == "x"


def test_precedence_defaults_file_flags_overrides(tmp_path):
    parser, keys = _small_parser()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.1\nsteps: 5\nmode: slow\nbf16: true\ninner:\n  retries: 9\n  base_url: http://file/v1\n")
    args = parser.parse_args(["--config", str(cfg), "--lr", "0.2", "--tries", "1", "--no-bf16", "steps=6",
                              "inner.retries=2"])
    config = load_config(Small, args.config, args.overrides, flags_from_args(args, keys))
    assert config.lr == 0.2  # flag over file
    assert config.steps == 6  # key=value over file
    assert config.inner.retries == 2  # key=value over flag over file
    assert config.inner.base_url == "http://file/v1" and config.mode == "slow"  # file over default (no flag given)
    assert config.bf16 is False  # --no-bf16 over the file's true
    assert config.plain == ""  # default


# ------------------------------------------------------------------------------------------ every converted CLI

HELP_FLAGS = {
    "train": ["--model", "--train-data", "--eval-data", "--loss {infonce,peg,ccr,auto}", "--audit AUDIT",
              "--filter-positives, --no-filter-positives",
              "--batch-size", "--chunk-size",
              "--epochs", "--max-steps", "--lr", "--seed", "--num-negatives", "--mine {bm25,dense,none}", "--no-mine",
              "--query-max-length", "--passage-max-length", "--precision {auto,fp32,bf16,fp16}", "--bf16", "--no-bf16", "--gradient-checkpointing",
              "--device"],
    "pretrain": ["--mode {retromae,gur}", "--model", "--data", "--data-format", "--output", "--resume-heads",
                 "--max-length", "--batch-size", "--epochs", "--max-steps", "--lr", "--seed", "--save-steps",
                 "--precision {auto,fp32,bf16,fp16}", "--bf16", "--no-bf16", "--gradient-checkpointing", "--device"],
    "generate": ["--input", "--output", "--base-url", "--model", "--api-key-env", "--backend {openai,hf}",
                 "--num-queries", "--prompt-template", "--prompt-template-zh", "--language {auto,en,zh}",
                 "--concurrency", "--rpm", "--temperature", "--max-tokens", "--timeout", "--max-retries",
                 "--on-failure {raise,skip}", "--cache", "--shard", "--beir-dir", "--overwrite, --no-overwrite",
                 "--progress, --no-progress", "--preflight, --no-preflight"],
    "filter": ["--method", "--model", "--removed, --no-removed", "--shard", "--overwrite", "--no-progress",
               "--base-url", "--api-key-env", "--concurrency", "--prompt-template", "--cache",
               "--teacher-kind {auto,embedding,cross-encoder}", "--absolute-margin", "--relative-margin",
               "--suspect-positive-share", "--max-length", "--num-negatives", "--train, --no-train",
               "--strict, --no-strict", "--variant {authors_code,paper}", "--beta", "--temperature", "--lr",
               "--max-steps", "--work-dir", "--batch-size", "--precision {auto,fp32,bf16,fp16}", "--bf16", "--no-bf16", "--device"],
    "mine": ["--data", "--split", "--input", "--corpus", "--method {bm25,dense}", "--num-negatives", "--range-min",
             "--range-max", "--max-score", "--min-score", "--absolute-margin", "--relative-margin",
             "--sampling {top,random}", "--seed", "--cache-dir", "--corpus-chunk", "--index {flat,ivf,hnsw}",
             "--query-batch-size",
             "--shard", "--overwrite", "--batch-size", "--precision {auto,fp32,bf16,fp16}", "--bf16", "--no-bf16", "--device"],
    "pairs": ["--format", "--text-unit", "--seed", "--repeat", "--window", "--min-weight", "--title, --no-title",
              "--lcs, --no-lcs", "--shard", "--overwrite"],
    "noise-bench": ["--data", "--model", "--preset {cpu,cpu-long,gpu}", "--kinds {chunk-fn,", "--rates RATES [RATES ...]",
                    "--methods {infonce,", "--seeds SEEDS [SEEDS ...]", "--output", "--eval-split", "--dev", "--jobs",
                    "--keep-steps, --no-keep-steps"],
    "eval": ["--data", "--split", "--output", "--top-k", "--index {flat,ivf,hnsw}", "--nprobe",
             "--ignore-identical-ids, --no-ignore-identical-ids", "--cache-dir", "--batch-size", "--precision {auto,fp32,bf16,fp16}", "--bf16", "--no-bf16", "--device"],
    "chunk": ["--format", "--text-unit", "--max-tokens", "--overlap", "--min-tokens", "--tokenizer", "--shard"],
}


@pytest.mark.parametrize("stage", sorted(HELP_FLAGS))
def test_cli_help_lists_the_flags_with_their_defaults(stage, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as info:
        main([stage, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    missing = [flag for flag in HELP_FLAGS[stage] if flag not in text]
    assert not missing, f"robustir {stage} --help lacks {missing}"
    assert "(default: " in text


def _args(argv: list[str]) -> argparse.Namespace:
    return build_parser(only=argv[0]).parse_args(argv)


def test_train_flags_reach_the_config(tmp_path):
    from robustir.cli.train import build_config

    cfg = tmp_path / "t.yaml"
    cfg.write_text("bf16: true\nlr: 1.0e-5\nmine: dense\n")
    config = build_config(_args(["train", "--config", str(cfg), "--lr", "3e-5", "--no-mine", "--chunk-size", "4"]))
    assert (config.lr, config.mine, config.chunk_size, config.precision) == (3e-5, "none", 4, "bf16")  # bf16: true
    config = build_config(_args(["train", "--config", str(cfg), "--no-bf16", "--mine", "bm25", "lr=4e-5"]))
    assert (config.precision, config.mine, config.lr) == ("fp32", "bm25", 4e-5)  # --no-bf16


def test_pretrain_flags_reach_the_config():
    from robustir.cli.pretrain import build_config

    config = build_config(_args(["pretrain", "--mode", "gur", "--resume-heads", "h", "--gradient-checkpointing",
                                 "--max-length", "64", "temperature=0.05"]))
    assert (config.mode, config.heads, config.gradient_checkpointing, config.max_length, config.temperature) == \
        ("gur", "h", True, 64, 0.05)


def test_generate_flags_reach_the_config(tmp_path):
    from robustir.cli.generate import build_config

    cfg = tmp_path / "g.yaml"
    cfg.write_text("num_queries: 5\nllm:\n  temperature: 0.1\n  model: from-file\n")
    config = build_config(_args(["generate", "--config", str(cfg), "--model", "m", "--rpm", "30", "--timeout", "5",
                                 "--cache", "none", "--no-preflight", "--temperature", "0.3", "llm.temperature=0.5"]))
    assert (config.llm.model, config.llm.requests_per_minute, config.llm.timeout_s, config.llm.cache_path) == \
        ("m", 30.0, 5.0, "none")
    assert config.preflight is False and config.progress is True and config.num_queries == 5
    assert config.llm.temperature == 0.5  # key=value over flag over file


def test_filter_flags_reach_each_methods_config(tmp_path):
    from robustir.cli.filter import build_config
    from robustir.filtering.llm_judge import JudgeConfig
    from robustir.filtering.sieve import SieveConfig
    from robustir.filtering.teacher import TeacherFilterConfig

    io = ["--input", "in.jsonl", "--output", "out.jsonl"]
    config = build_config(_args(["filter", "--method", "llm", *io, "--model", "m", "--base-url", "http://h/v1",
                                 "--cache", "c.sqlite", "--no-removed", "--shard", "1/2"]))
    assert isinstance(config, JudgeConfig)
    assert (config.llm.model, config.llm.base_url, config.llm.cache_path) == ("m", "http://h/v1", "c.sqlite")
    assert (config.keep_removed, config.shard) == (False, "1/2")
    config = build_config(_args(["filter", "--method", "teacher", *io, "--model", "t", "--teacher-kind",
                                 "cross-encoder", "--relative-margin", "0.1", "--bf16", "--batch-size", "8"]))
    assert isinstance(config, TeacherFilterConfig)
    assert (config.model, config.kind, config.relative_margin, config.precision, config.batch_size) == \
        ("t", "cross-encoder", 0.1, "bf16", 8)
    config = build_config(_args(["filter", "--method", "sieve", *io, "--no-train", "--strict", "--num-negatives", "3",
                                 "--lr", "1e-6", "--no-progress", "beta=0.5"]))
    assert isinstance(config, SieveConfig)
    assert (config.train, config.strict, config.num_negatives, config.lr, config.progress, config.beta) == \
        (False, True, 3, 1e-6, False, 0.5)


def test_mine_flags_reach_the_config():
    from robustir.cli.mine import mining_config

    config = mining_config(_args(["mine", "--data", "d", "--output", "o", "--index", "hnsw", "--num-negatives", "5",
                                  "--relative-margin", "0.05", "--batch-size", "8", "--bf16"]))
    assert (config.index.kind, config.num_negatives, config.relative_margin) == ("hnsw", 5, 0.05)
    assert (config.encode_batch_size, config.precision, config.method, config.range_max) == (8, "bf16", "bm25", 100)


def test_pairs_flags_reach_the_config():
    from robustir.cli.pairs import build_config

    config = build_config(_args(["pairs", "--input", "i", "--output", "o", "--no-title", "--no-lcs",
                                 "--min-weight", "2.5", "max_candidates=50"]))
    assert (config.use_title, config.require_lcs, config.min_weight, config.max_candidates) == (False, False, 2.5, 50)
    assert build_config(_args(["pairs", "--input", "i", "--output", "o"])).use_title is True


def test_noise_bench_flags_reach_the_config(capsys):
    from robustir.cli.noise_bench import build_config

    config = build_config(_args(["noise-bench", "budget.epochs=2", "--preset", "gpu", "--kinds", "chunk-fn", "fp-hard",
                                 "--rates", "0", "0.2", "--seeds", "1", "2", "--methods", "peg"]))
    assert (config.preset, config.kinds, config.rates, config.seeds, config.methods, config.budget) == \
        ("gpu", ["chunk-fn", "fp-hard"], [0.0, 0.2], [1, 2], ["peg"], {"epochs": 2})
    with pytest.raises(SystemExit):
        _args(["noise-bench", "--kinds", "no-such-kind"])
    capsys.readouterr()


def test_eval_and_chunk_flags_reach_the_config():
    from robustir.cli.chunk import build_config as chunk_config
    from robustir.cli.evaluate import build_config as eval_config

    config = eval_config(_args(["eval", "--top-k", "10", "--index", "ivf", "--nprobe", "4", "--ignore-identical-ids",
                                "--batch-size", "16"]))
    assert (config.top_k, config.index.kind, config.index.nprobe, config.ignore_identical_ids, config.batch_size,
            config.precision) == (10, "ivf", 4, True, 16, "auto")
    assert eval_config(_args(["eval", "--precision", "fp16"])).precision == "fp16"
    config = chunk_config(_args(["chunk", "--input", "i", "--output", "o", "--max-tokens", "10", "--tokenizer", "tok"]))
    assert (config.max_tokens, config.overlap, config.min_tokens, config.tokenizer) == (10, 1, 32, "tok")


COMMAND_CONFIGS = {  # command -> its config class (module, name)
    "train": ("robustir.training.arguments", "TrainConfig"),
    "pretrain": ("robustir.pretraining.pretrain", "PretrainConfig"),
    "generate": ("robustir.queries.generate", "GenerateConfig"),
    "mine": ("robustir.negatives.mining", "MiningConfig"),
    "eval": ("robustir.evaluation.retrieval", "EvalConfig"),
    "index": ("robustir.serving.index", "IndexConfig"),
    "serve": ("robustir.serving.config", "ServeConfig"),
    "noise-bench": ("robustir.robustness.bench", "NoiseBenchConfig"),
    "classify": ("robustir.evaluation.classify", "ClassifyConfig"),
    "pairs": ("robustir.queries.pairs", "PairMiningConfig"),
    "chunk": ("robustir.data.chunking", "ChunkConfig"),
}


@pytest.mark.parametrize("command", sorted(COMMAND_CONFIGS))
def test_every_field_of_a_stage_config_has_a_flag(command):
    """No command keeps a field list: a field added to a config is a flag of its command at once."""
    import importlib

    module, name = COMMAND_CONFIGS[command]
    cls = getattr(importlib.import_module(module), name)
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    keys = sub.get_default("_flag_keys")
    wanted = {path for path, _, _, hint, _, _ in config_flags(cls) if _argparse_kind(hint) is not None}
    taken = {path for path, _, _, hint, _, flag in config_flags(cls)
             if _argparse_kind(hint) is not None and path not in keys.values()}
    # the only fields without a generated flag are those whose flag the command defines itself (--input, --output)
    assert all(f"--{dict((p, f) for p, *_, f in config_flags(cls))[path]}" in sub._option_string_actions
               for path in taken), taken
    assert wanted - taken == set(keys.values())


def test_filter_exposes_every_field_of_the_three_methods():
    from robustir.cli.filter import CONFIGS

    parser = build_parser(only="filter")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["filter"]
    keys = sub.get_default("_flag_keys")
    for method, cls in CONFIGS.items():
        wanted = {path for path, _, _, hint, _, flag in config_flags(cls)
                  if _argparse_kind(hint) is not None and flag not in ("input", "output")}
        assert wanted == set(keys[method].values()), method


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
