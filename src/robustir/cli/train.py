"""``robustir train``: contrastive fine-tuning from a config file, flags and key=value overrides.

    robustir train --model M --train-data ../shared/data/scifact --loss peg --output out
    robustir train --config configs/scifact-peg.yaml lr=1e-5 loss_options.beta=0.2
"""

from __future__ import annotations

import argparse

from ..config import load_config
from ..evaluation.metrics import format_table
from ..training.arguments import TrainConfig
from .common import flags_from_args

FLAGS = {  # flag -> config key; only flags given on the command line override the file
    "model": "model", "train_data": "train_data", "eval_data": "eval_data", "loss": "loss", "output": "output",
    "batch_size": "batch_size", "chunk_size": "chunk_size", "epochs": "epochs", "max_steps": "max_steps",
    "lr": "lr", "seed": "seed", "num_negatives": "num_negatives", "mine": "mine",
    "query_max_length": "query_max_length", "passage_max_length": "passage_max_length",
}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON file with TrainConfig fields")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=1e-5 loss_options.beta=0.2")
    parser.add_argument("--model", help="model folder or hub id (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--train-data", help="training JSONL (file/folder) or BEIR folder with a train split")
    parser.add_argument("--eval-data", help="BEIR folder evaluated after training (test split)")
    parser.add_argument("--loss", choices=["infonce", "peg", "ccr"])
    parser.add_argument("--output")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--chunk-size", type=int, help="GradCache chunk (rows per forward); enables huge batches")
    parser.add_argument("--epochs", type=float)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--num-negatives", type=int, help="hard negatives per query per step")
    parser.add_argument("--mine", choices=["bm25", "dense", "none"],
                        help="mine negatives when the data has none (default bm25; none = in-batch only)")
    parser.add_argument("--no-mine", dest="mine", action="store_const", const="none")
    parser.add_argument("--query-max-length", type=int)
    parser.add_argument("--passage-max-length", type=int)
    parser.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast for training")
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None)


def build_config(args: argparse.Namespace) -> TrainConfig:
    # store_true switches default to None, so an absent switch leaves the config file's value
    switches = {"bf16": "bf16", "gradient_checkpointing": "gradient_checkpointing"}
    return load_config(TrainConfig, args.config, args.overrides, flags=flags_from_args(args, {**FLAGS, **switches}))


def run(args: argparse.Namespace) -> int:
    from ..training.trainer import train

    import os

    config = build_config(args)
    result = train(config)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun only the main process reports
    print(f"model saved to {result.model_path} after {result.steps} steps ({result.seconds / 60:.1f} min)")
    if result.metrics:
        rows = {"base": result.base_metrics} if result.base_metrics else {}
        rows["trained"] = result.metrics
        print(format_table(rows, title=f"{config.eval_data} / {config.eval_split}"))
    return 0
