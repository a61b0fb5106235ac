"""robustir: train robust dense text-retrieval embedding models on noisy data (PEG, CCR, GUR).

The public API, importable from the top level (loaded lazily, so ``import robustir`` stays fast)::

    from robustir import Encoder, evaluate, load_beir, TrainConfig, train, get_loss
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Encoder": "robustir.models.encoder",
    "EncoderConfig": "robustir.models.encoder",
    "load_beir": "robustir.data.beir",
    "load_training_data": "robustir.data.training_data",
    "TrainingExample": "robustir.data.training_data",
    "evaluate": "robustir.evaluation.retrieval",
    "EvalConfig": "robustir.evaluation.retrieval",
    "compute_metrics": "robustir.evaluation.metrics",
    "get_loss": "robustir.losses",
    "ContrastiveBatch": "robustir.losses",
    "BatchEngine": "robustir.training.batch_engine",
    "TrainConfig": "robustir.training.arguments",
    "train": "robustir.training.trainer",
    "MiningConfig": "robustir.negatives.mining",
    "mine_beir": "robustir.negatives.mining",
    "PretrainConfig": "robustir.pretraining.pretrain",
    "pretrain": "robustir.pretraining.pretrain",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'robustir' has no attribute {name!r}")
