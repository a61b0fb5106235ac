"""``robustir run``: the whole pipeline from one config file (see :mod:`robustir.pipeline`).

    robustir run configs/pipeline-example.yaml
    robustir run configs/pipeline-example.yaml work_dir=runs/try2 pretrain.max_steps=50 train.lr=3e-5
    robustir run configs/pipeline-example.yaml --force train      # redo fine-tuning (and evaluation)
    robustir run configs/peg-recipe.yaml --until filter            # build the training data only

Every stage is cached in ``work_dir``; a re-run skips completed stages and resumes an interrupted one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from cyclopts import Parameter

from ..pipeline import STAGES
from .common import Device, Overrides

Stage = Literal[STAGES]


def command(config: str, *overrides: Overrides, work_dir: str | None = None,
            force: Annotated[tuple[Stage, ...], Parameter(consume_multiple=False)] = (),
            until: Stage | None = None, device: Device = None) -> int:
    """The whole pipeline from one config.

    Parameters
    ----------
    config
        pipeline YAML/JSON (see configs/pipeline-example.yaml); trailing key=value overrides, e.g. work_dir=runs/x
        train.lr=3e-5
    work_dir
        folder for every stage's outputs (overrides work_dir)
    force
        redo this stage even if complete (repeatable)
    until
        stop after this stage, e.g. --until filter builds the training data only
    device
        the config's top-level device: every stage's (a stage section's own, if set, wins)
    """
    from ..pipeline import load_pipeline_config, run_pipeline

    overrides = list(overrides)
    if work_dir:
        overrides.append(f"work_dir={work_dir}")
    if device:
        overrides.append(f"device={device}")
    result = run_pipeline(load_pipeline_config(config, overrides), force=list(force), until=until)
    stages = ", ".join(f"{name} {state}" for name, state in result.stages.items())
    print(f"stages: {stages} ({result.seconds / 60:.1f} min)")
    if until and until != "eval":
        print(f"output of stage {until}: {result.model_path}")
        return 0
    print(f"fine-tuned model: {result.model_path}")
    print(result.table)
    return 0
