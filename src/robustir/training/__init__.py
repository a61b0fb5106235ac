"""Fine-tuning: the batch engine (in-batch + hard negatives, GradCache, cross-process gather), the trainer and the
training loop it shares with pre-training (:mod:`robustir.training.loop`)."""

from .arguments import TrainConfig
from .batch_engine import BatchEngine

__all__ = ["BatchEngine", "TrainConfig", "train"]


def train(config: TrainConfig):
    """Fine-tune a model; see :func:`robustir.training.trainer.train`."""
    from .trainer import train as _train

    return _train(config)
