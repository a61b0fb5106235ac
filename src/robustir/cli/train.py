"""``robustir train``: contrastive fine-tuning from a config file, flags and key=value overrides.

    robustir train --model M --train-data ../shared/data/scifact --loss peg --output out
    robustir train --config configs/scifact-peg.yaml lr=1e-5 loss_options.beta=0.2
"""

from __future__ import annotations

import argparse

from ..config import load_config
from ..evaluation.metrics import format_table
from ..training.arguments import TrainConfig
from .common import add_config_flags, add_precision_arg, flags_from_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON file with TrainConfig fields")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=1e-5 loss_options.beta=0.2")
    keys = add_config_flags(parser, TrainConfig)  # a flag per field; any field can also be set in --config / key=value
    add_precision_arg(parser, generated=True)
    parser.add_argument("--no-mine", dest="mine", action="store_const", const="none", help="same as --mine none")
    parser.set_defaults(_flag_keys=keys)


def build_config(args: argparse.Namespace) -> TrainConfig:
    # every generated flag defaults to None, so an absent flag leaves the config file's value
    return load_config(TrainConfig, args.config, args.overrides, flags=flags_from_args(args, args._flag_keys))


def run(args: argparse.Namespace) -> int:
    import os

    from ..runs import Job, execute
    from ..training.trainer import TRAIN, resolve_recipe

    config = resolve_recipe(build_config(args))
    if config.audit:  # loss auto takes the audit's recipe: say which
        print(f"audit {config.audit}: training with loss {config.loss}"
              + (" and filter_positives" if config.filter_positives else ""), flush=True)
    result = execute(TRAIN, config, Job(config.output), say=None).report
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun only the main process reports
    if result.already_complete:
        print(f"{config.output} already holds this run (same settings and inputs), complete after {result.steps} "
              f"steps: nothing to do; the model is {result.model_path} (resume=false to train it again)")
    else:
        print(f"model saved to {result.model_path} after {result.steps} steps ({result.seconds / 60:.1f} min)")
    if result.metrics:
        rows = {"base": result.base_metrics} if result.base_metrics else {}
        rows["trained"] = result.metrics
        print(format_table(rows, title=f"{config.eval_data} / {config.eval_split}"))
    return 0
