"""Contrastive losses as pure functions of embeddings, and :func:`get_loss` to build one by name."""

from __future__ import annotations

from robustir.errors import ConfigError
from robustir.losses.base import AuxLoss, ContrastiveBatch, ContrastiveLoss, LossOutput
from robustir.losses.ccr import CCRLoss, sieve_keep_mask
from robustir.losses.infonce import InfoNCELoss
from robustir.losses.peg import PEGLoss

#: name (as in configs and ``--loss``) -> loss class
LOSSES: dict[str, type[ContrastiveLoss]] = {cls.name: cls for cls in (InfoNCELoss, PEGLoss, CCRLoss)}


def get_loss(name: str, **kwargs) -> ContrastiveLoss:
    """Build the loss registered as ``name`` with keyword hyper-parameters, e.g. ``get_loss("peg", beta=0.2)``."""
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; valid: {', '.join(sorted(LOSSES))}.")
    return LOSSES[name](**kwargs)  # checked against the loss's options model (losses/options.py), key by key


__all__ = ["AuxLoss", "CCRLoss", "ContrastiveBatch", "ContrastiveLoss", "InfoNCELoss", "LOSSES", "LossOutput",
           "PEGLoss", "get_loss", "sieve_keep_mask"]
