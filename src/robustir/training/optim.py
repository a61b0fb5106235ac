"""The optimiser and schedule shared by fine-tuning and pre-training."""

from __future__ import annotations

import torch
from torch import nn


def adamw_with_linear_schedule(model: nn.Module, lr: float, weight_decay: float, warmup_ratio: float,
                               total_steps: int):
    """AdamW without weight decay on biases and normalisation weights, linear warm-up then linear decay.

    Returns ``(optimizer, scheduler)``; the caller steps the scheduler once per optimizer step.
    """
    from transformers import get_linear_schedule_with_warmup

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        exempt = param.ndim < 2 or "LayerNorm" in name or "norm" in name or "bias" in name
        (no_decay if exempt else decay).append(param)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler
