"""Flags shared by several stages, so each means the same everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..resources import dataset_path, default_model_path


def add_encoder_args(parser: argparse.ArgumentParser, model_required: bool = False) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=model_required, default=None,
                       help="model folder or Hugging Face hub id (default: the bundled all-MiniLM-L6-v2)")
    group.add_argument("--pooling", choices=["cls", "mean"], default=None,
                       help="override the pooling read from the model folder")
    group.add_argument("--query-instruction", default=None, help="prefix added to every query (BGE style)")
    group.add_argument("--passage-instruction", default=None, help="prefix added to every passage")
    group.add_argument("--query-max-length", type=int, default=None)
    group.add_argument("--passage-max-length", type=int, default=None)
    group.add_argument("--batch-size", type=int, default=64, help="encoding batch size")
    group.add_argument("--bf16", action="store_true", help="bfloat16 autocast (fast on CPUs with AMX and on GPUs)")


def encoder_options(args: argparse.Namespace) -> dict:
    return {
        "pooling": args.pooling,
        "query_instruction": args.query_instruction,
        "passage_instruction": args.passage_instruction,
        "query_max_length": args.query_max_length,
        "passage_max_length": args.passage_max_length,
    }


def model_or_default(value: str | None) -> str:
    return value if value else default_model_path()


def data_or_default(value: str | None) -> Path:
    return Path(value) if value else dataset_path("scifact")


def flags_from_args(args: argparse.Namespace, names: dict[str, str]) -> dict:
    """Config values from the flags that were given: ``{dest: "a.b"}`` → ``{"a": {"b": value}}``.

    Flags left at ``None`` are omitted, so a config file's value stands unless the flag is given.
    """
    flags: dict = {}
    for dest, key in names.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = flags
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return flags
