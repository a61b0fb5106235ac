"""``robustir pretrain``: retrieval-oriented pre-training (RetroMAE or GUR) from a config, flags and overrides.

    robustir pretrain --mode retromae --data corpus.jsonl --output runs/retromae --max-steps 20000
    robustir pretrain --mode gur --data pairs.jsonl --config configs/pretrain-gur.yaml temperature=0.05
    robustir pretrain --mode retromae --data more.txt --model runs/retromae/model --resume-heads runs/retromae

Multi-GPU: ``torchrun --nproc_per_node 8 -m robustir.cli.main pretrain ...`` (every process streams its own
round-robin share of the data). The result's ``model/`` folder is what ``robustir train --model`` takes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from ..pretraining.pretrain import PretrainConfig
from .common import CONFIG, ConfigFile, Overrides, stage_config


def command(*overrides: Overrides, config_file: ConfigFile = None,
            config: Annotated[PretrainConfig | None, CONFIG] = None) -> int:
    """Retrieval-oriented pre-training (RetroMAE, GUR).

    Every field is a flag, a --config key or a trailing key=value override (lr=5e-5 temperature=0.05).
    """
    return run(overrides, config_file)


def build_config(overrides=(), config_file: str | None = None) -> PretrainConfig:
    # a flag left out leaves the config file's value
    return stage_config(PretrainConfig, config_file, overrides)


def run(overrides=(), config_file: str | None = None) -> int:
    from ..pretraining.pretrain import PRETRAIN
    from ..runs import Job, execute

    config = build_config(overrides, config_file)
    result = execute(PRETRAIN, config, Job(config.output), say=None).report
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, one summary is enough
        return 0
    losses = ", ".join(f"{k} {v:.4f}" for k, v in result.last_losses.items())
    if result.already_complete:
        print(f"{config.output} already holds this run (same settings and inputs), complete after {result.steps} "
              f"steps: nothing to do (resume=false to train it again)")
    else:
        print(f"pre-trained encoder saved to {result.model_path} (heads: {result.heads_path}) after {result.steps} "
              f"steps ({result.seconds / 60:.1f} min){'; last ' + losses if losses else ''}")
    full = Path(result.model_path).parent / "full"
    if full.is_dir():  # T5 GUR: the encoder-decoder, to continue pre-training
        print(f"the whole encoder-decoder is in {full}: continue pre-training with --model {full} "
              f"--resume-heads {Path(result.model_path).parent}")
    print(f"next: robustir train --model {result.model_path} --train-data ...")
    return 0
