"""CCR's passage sieve with its brief training: the step ``robustir filter --method sieve`` runs.

The sieve's rule and its pass over a file are in :mod:`robustir.filtering.sieve`; what sits here is the part that
trains (CCR loss, one short run, resumable, reused while its settings and input are the same), because the
training loop sits above the filters (it filters with :mod:`robustir.filtering.teacher` itself).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..filtering.sieve import SieveConfig
from ..filtering.sieve import sieve_negatives as sieve_with_trainer
from ..filtering.teacher import FilterReport
from ..outputs import StageOutput, stage_step
from ..runs import Job, execute
from .arguments import TrainConfig
from .trainer import TRAIN

__all__ = ["SIEVE", "sieve_negatives", "train_sieve_model"]

logger = logging.getLogger(__name__)


def train_sieve_model(input_path: str | Path, config: SieveConfig, work_dir: Path) -> tuple[str, dict]:
    """Brief CCR training on the noisy data (resumable); returns ``(model folder, run summary)``."""
    train_config = TrainConfig(
        model=config.model, train_data=str(input_path), mine="none", num_negatives=config.train_negatives,
        loss="ccr", loss_options={"variant": config.variant, "beta": config.beta, "temperature": config.temperature},
        lr=config.lr, epochs=config.epochs, max_steps=config.max_steps, batch_size=config.train_batch_size,
        warmup_ratio=config.warmup_ratio, query_max_length=config.query_max_length,
        passage_max_length=config.passage_max_length, precision=config.train_precision, seed=config.seed,
        output=str(work_dir / "train"), report=False, save_total_limit=1, device=config.device)
    # the work model is reused only when trained with these settings on this input (the training run's own
    # fingerprint: settings + the input's and the model's content); another beta, lr, seed ... or an edited input
    # trains it again in the same folder
    result = execute(TRAIN, train_config, Job(train_config.output), on_change="redo", say=None).report
    if result.already_complete:
        logger.info("sieve: reusing the briefly trained model in %s", result.model_path)
    summary = {"model": str(result.model_path), "steps": result.steps, "seconds": round(result.seconds, 1),
               "loss": train_config.loss_options, "lr": config.lr}
    return str(result.model_path), summary


def sieve_negatives(input_path: str | Path, output_path: str | Path, config: SieveConfig | None = None,
                    encoder=None) -> FilterReport:
    """The passage sieve on a training JSONL, trained first when ``config.train``
    (:func:`robustir.filtering.sieve.sieve_negatives` with :func:`train_sieve_model`)."""
    return sieve_with_trainer(input_path, output_path, config, encoder=encoder, trainer=train_sieve_model)


SIEVE = stage_step("filter sieve", SieveConfig,
                   lambda config, job: sieve_negatives(job.inputs["input"],
                                                       StageOutput(job.output, job.shard, reports=True).path, config),
                   reports=True, inputs=lambda config, job: {"model": config.model})
"""CCR's passage sieve as a :class:`~robustir.runs.Step`: its work model (``model``) by its content."""
