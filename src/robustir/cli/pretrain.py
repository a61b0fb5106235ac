"""``robustir pretrain``: retrieval-oriented pre-training (RetroMAE or GUR) from a config, flags and overrides.

    robustir pretrain --mode retromae --data corpus.jsonl --output runs/retromae --max-steps 20000
    robustir pretrain --mode gur --data pairs.jsonl --config configs/pretrain-gur.yaml temperature=0.05
    robustir pretrain --mode retromae --data more.txt --model runs/retromae/model --resume-heads runs/retromae

Multi-GPU: ``torchrun --nproc_per_node 8 -m robustir.cli.main pretrain ...`` (every process streams its own
round-robin share of the data). The result's ``model/`` folder is what ``robustir train --model`` takes.
"""

from __future__ import annotations

import argparse
import os

from ..config import load_config
from ..training.pretrain import PretrainConfig
from .common import flags_from_args

FLAGS = {  # flag -> config key; only flags given on the command line override the file
    "mode": "mode", "model": "model", "data": "data", "data_format": "data_format", "output": "output",
    "resume_heads": "heads", "max_length": "max_length", "batch_size": "batch_size", "epochs": "epochs",
    "max_steps": "max_steps", "lr": "lr", "seed": "seed", "save_steps": "save_steps",
}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON file with PretrainConfig fields")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=5e-5 temperature=0.05")
    parser.add_argument("--mode", choices=["retromae", "gur"], help="pre-training method (default retromae)")
    parser.add_argument("--model", help="model folder or hub id to start from (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--data", help="retromae: raw text (JSONL with 'text', BEIR folder, plain text one document "
                                       "per line; .gz ok); gur: pairs JSONL from `robustir pairs`")
    parser.add_argument("--data-format", choices=["auto", "jsonl", "beir", "text", "pairs"])
    parser.add_argument("--output")
    parser.add_argument("--resume-heads", metavar="PATH",
                        help="continue from saved heads: a decoder_head/projection_head folder or a previous output")
    parser.add_argument("--max-length", type=int, help="tokens per text (default 512 retromae, 128 gur)")
    parser.add_argument("--batch-size", type=int, help="texts (retromae) or pairs (gur) per process per step")
    parser.add_argument("--epochs", type=float)
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (skips counting the data)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--save-steps", type=int, help="checkpoint every N steps (default: at the end)")
    parser.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast")
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None)


def build_config(args: argparse.Namespace) -> PretrainConfig:
    # store_true switches default to None, so an absent switch leaves the config file's value
    switches = {"bf16": "bf16", "gradient_checkpointing": "gradient_checkpointing"}
    return load_config(PretrainConfig, args.config, args.overrides, flags=flags_from_args(args, {**FLAGS, **switches}))


def run(args: argparse.Namespace) -> int:
    from ..training.pretrain import pretrain

    config = build_config(args)
    result = pretrain(config)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, one summary is enough
        return 0
    losses = ", ".join(f"{k} {v:.4f}" for k, v in result.last_losses.items())
    print(f"pre-trained encoder saved to {result.model_path} (heads: {result.heads_path}) after {result.steps} "
          f"steps ({result.seconds / 60:.1f} min){'; last ' + losses if losses else ''}")
    print(f"next: robustir train --model {result.model_path} --train-data ...")
    return 0
