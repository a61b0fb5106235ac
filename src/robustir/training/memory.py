"""Cross-batch memory: the passages of the last steps as extra negatives (Wang et al., 2020, XBM).

"Cross-Batch Memory for Embedding Learning" (CVPR 2020) observes that once a model trains slowly -- a
pre-trained encoder fine-tuned at a small learning rate is the case here -- the embeddings it produced a few
steps ago are close to the ones it would produce now ("slow drift"), so a first-in-first-out store of them adds
negatives to every row's softmax at no encoding cost. :class:`PassageMemory` is that store; the batch engine
(:class:`robustir.training.batch_engine.BatchEngine`, ``memory=``) appends its rows as constant columns after
the step's positives and hard negatives, masks the columns that hold a known positive of the row's query (the
same passage ids as its in-batch duplicate mask: a positive seen an epoch earlier is no negative), and pushes the
step's own gathered columns once the loss is computed. So every loss gets it without a variant, under GradCache
and across processes (the store holds the *global* columns, identical on every process).

The store is an ``nn.Module`` of fixed-size buffers, so a checkpoint saves and restores it exactly (the
trainer checkpoints it beside the loss's state) and a resumed run sees the columns an uninterrupted one would.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PassageMemory"]


class PassageMemory(nn.Module):
    """First-in-first-out store of the last ``size`` passage embeddings (detached, float32) and their ids.

    Args:
        size: passages kept (columns added to every step once full).
        dim: embedding width.
    """

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"a passage memory needs size >= 1 and dim >= 1, got size={size}, dim={dim}")
        self.size = int(size)
        self.register_buffer("embeddings", torch.zeros(size, dim))
        self.register_buffer("ids", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))  # slots holding a passage
        self.register_buffer("position", torch.zeros((), dtype=torch.long))  # the next slot written

    def __len__(self) -> int:
        return int(self.filled)

    def read(self) -> tuple[Tensor, Tensor]:
        """The stored ``(n, dim)`` embeddings and ``(n,)`` ids, ``n = len(self)``, in slot order (no gradient)."""
        n = len(self)
        return self.embeddings[:n], self.ids[:n]

    @torch.no_grad()
    def push(self, embeddings: Tensor, ids: Tensor) -> None:
        """Store ``(m, dim)`` embeddings with their ``(m,)`` ids, overwriting the oldest once full."""
        if embeddings.ndim != 2 or embeddings.shape[1] != self.embeddings.shape[1]:
            raise ValueError(f"passage memory of width {self.embeddings.shape[1]} got embeddings of shape "
                             f"{tuple(embeddings.shape)}")
        if ids.shape != (embeddings.shape[0],):
            raise ValueError(f"passage memory needs one id per embedding, got {tuple(ids.shape)} ids for "
                             f"{embeddings.shape[0]} rows")
        embeddings = embeddings.detach()[-self.size:].to(self.embeddings.device, self.embeddings.dtype)
        ids = ids[-self.size:].to(self.ids.device, torch.long)
        m = embeddings.shape[0]
        slots = (int(self.position) + torch.arange(m, device=self.ids.device)) % self.size
        self.embeddings[slots] = embeddings
        self.ids[slots] = ids
        self.position.fill_((int(self.position) + m) % self.size)
        self.filled.fill_(min(self.size, int(self.filled) + m))

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.embeddings.shape[1]}, filled={len(self)}"
