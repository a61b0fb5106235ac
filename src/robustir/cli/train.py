"""``robustir train``: contrastive fine-tuning from a config file, flags and key=value overrides.

    robustir train --model M --train-data ../shared/data/scifact --loss peg --output out
    robustir train --config configs/scifact-peg.yaml lr=1e-5 loss_options.beta=0.2
"""

from __future__ import annotations

from typing import Annotated

from ..evaluation.metrics import format_table
from ..training.arguments import TrainConfig
from .common import CONFIG, ConfigFile, Overrides, stage_config


def command(*overrides: Overrides, config_file: ConfigFile = None,
            config: Annotated[TrainConfig | None, CONFIG] = None) -> int:
    """Contrastive fine-tuning (InfoNCE, PEG, CCR).

    Every field of the training config is a flag, and can be set in --config or as a trailing key=value override
    (lr=1e-5 loss_options.beta=0.2). --no-mine is --mine none; --bf16 / --no-bf16 are --precision bf16 / fp32.
    """
    return run(overrides, config_file)


def build_config(overrides=(), config_file: str | None = None) -> TrainConfig:
    return stage_config(TrainConfig, config_file, overrides)


def run(overrides=(), config_file: str | None = None) -> int:
    import os

    from ..runs import Job, execute
    from ..training.trainer import TRAIN, resolve_recipe

    config = resolve_recipe(build_config(overrides, config_file))
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
