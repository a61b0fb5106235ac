"""Weight-space ensembling with the starting model (WiSE-FT, Wortsman et al. 2022, "Robust fine-tuning of zero-shot
models"): the fine-tuned weights moved back toward the model training started from,

    theta = (1 - w) * theta_fine_tuned + w * theta_base,

which keeps more of what the base model knew about other domains at a small cost (or a gain) in the fine-tuned
domain. ``robustir train`` applies it to the model it saves with ``base_weight`` (TrainConfig); the functions here
do it to a model in memory (:func:`interpolate_weights`) or to a saved folder (:func:`interpolate_folder`), which is
what ``bench/vs_st.py --robustir-base-weight`` uses to score several weights of one training run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["interpolate_folder", "interpolate_weights"]


def interpolate_weights(model: nn.Module, base: nn.Module, base_weight: float) -> int:
    """Move ``model``'s floating-point parameters and buffers to ``(1 - base_weight) * model + base_weight * base``,
    in place, on ``model``'s devices and dtypes; integer buffers (position ids) are left as they are. Returns the
    number of tensors changed. The two models must have the same tensors (names and shapes): anything else is a
    :class:`ConfigError` naming the first difference."""
    if not 0.0 <= base_weight < 1.0:
        raise ConfigError(f"base_weight must be in [0, 1) (the share of the starting model's weights), got {base_weight}")
    ours, theirs = model.state_dict(), base.state_dict()
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        raise ConfigError(f"cannot interpolate with the base model: tensors {(missing or extra)[:3]} are only in "
                          f"{'the fine-tuned' if missing else 'the base'} model; it must be the model training "
                          "started from (same architecture and vocabulary)")
    changed = 0
    with torch.no_grad():
        for name, tensor in ours.items():
            other = theirs[name]
            if tensor.shape != other.shape:
                raise ConfigError(f"cannot interpolate with the base model: {name} has shape {tuple(tensor.shape)} "
                                  f"here and {tuple(other.shape)} in the base model")
            if not tensor.is_floating_point() or base_weight == 0.0:
                continue
            tensor.mul_(1.0 - base_weight).add_(other.to(tensor.device, tensor.dtype), alpha=base_weight)
            changed += 1
    return changed


def interpolate_folder(model: str | os.PathLike, base: str | os.PathLike, base_weight: float,
                       output: str | os.PathLike) -> Path:
    """Load the fine-tuned ``model`` folder and the ``base`` (folder or hub id), interpolate
    (:func:`interpolate_weights`) and save the result to ``output`` as a sentence-transformers folder with the
    fine-tuned model's settings (pooling, lengths, instructions)."""
    from .encoder import Encoder

    tuned = Encoder.from_pretrained(model)
    interpolate_weights(tuned, Encoder.from_pretrained(base), base_weight)
    return tuned.save(output)
