"""What every contrastive loss receives and returns.

Losses are pure functions of embeddings. They never encode text, never know about gradient caching,
devices or processes: :class:`robustir.training.batch_engine.BatchEngine` assembles a
:class:`ContrastiveBatch` (local queries against the *global* candidate columns, labels already
offset for this process) and calls the loss once per optimizer step.

Column layout of ``passages`` (built by the engine, relied on by nobody but ``positive_index`` /
``hard_negative_index``): the positives of every process in rank order, then the hard negatives of
every process in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _local_mean(values: Tensor) -> Tensor:
    return values.mean()


@dataclass
class ContrastiveBatch:
    """Embeddings for one optimizer step, as seen by one process.

    Attributes:
        queries: ``(b, d)`` this process's query embeddings (the rows of the loss).
        passages: ``(N, d)`` every candidate passage of the global batch (positives, then hard negatives).
        positive_index: ``(b,)`` column in ``passages`` of each query's positive.
        hard_negative_index: ``(b, k)`` columns of each query's own hard negatives, or ``None`` (k = 0).
        candidate_mask: optional ``(b, N)`` bool; ``False`` marks columns that must not act as negatives
            for that row (e.g. another query's positive with the same text as this query's positive).
            The positive column itself is always kept.
        all_queries: ``(B, d)`` the queries of the whole global batch (for passage->query terms).
        query_offset: row of ``queries[0]`` inside ``all_queries``.
        global_mean: mean of a per-query statistic over the whole global batch (all processes);
            the result carries no gradient. Used for batch statistics such as PEG's sigma.
    """

    queries: Tensor
    passages: Tensor
    positive_index: Tensor
    hard_negative_index: Tensor | None = None
    candidate_mask: Tensor | None = None
    all_queries: Tensor | None = None
    query_offset: int = 0
    global_mean: Callable[[Tensor], Tensor] = field(default=_local_mean)

    @classmethod
    def from_groups(cls, queries: Tensor, positives: Tensor, negatives: Tensor | None = None) -> "ContrastiveBatch":
        """Single-process batch from ``(b,d)`` queries, ``(b,d)`` positives and ``(b,k,d)`` or ``(b*k,d)`` negatives."""
        b = queries.shape[0]
        positive_index = torch.arange(b, device=queries.device)
        if negatives is None or negatives.numel() == 0:
            return cls(queries, positives, positive_index, all_queries=queries)
        negatives = negatives.reshape(b, -1, queries.shape[-1])
        k = negatives.shape[1]
        passages = torch.cat([positives, negatives.reshape(b * k, -1)], dim=0)
        hard = b + torch.arange(b * k, device=queries.device).view(b, k)
        return cls(queries, passages, positive_index, hard, all_queries=queries)

    @property
    def num_hard_negatives(self) -> int:
        return 0 if self.hard_negative_index is None else int(self.hard_negative_index.shape[1])


@dataclass
class LossOutput:
    """A scalar loss to back-propagate and detached components to log (floats)."""

    loss: Tensor
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class AuxLoss:
    """An auxiliary loss the model computes in the same forward as the embeddings (e.g. GUR's MLM loss).

    A model callable given to :meth:`robustir.training.batch_engine.BatchEngine.step` may return
    ``(embeddings, AuxLoss(...))`` (or ``(embeddings, [AuxLoss, ...])``) instead of the embeddings alone.
    ``total`` is a **sum** over this forward's units (e.g. the cross-entropies of its masked tokens), with a
    graph; ``count`` the number of units (no gradient). The engine divides the totals of every forward of the
    step (queries and passages, every chunk) by their summed count, so a chunked (GradCache) step and a plain
    one give the same loss and gradients, and adds ``weight * total / count`` to the contrastive loss; the
    unweighted mean is logged as ``components[name]``.
    """

    total: Tensor
    count: Tensor | int | float
    name: str = "aux"
    weight: float = 1.0


class ContrastiveLoss(nn.Module):
    """Base class: subclasses implement :meth:`forward` on a :class:`ContrastiveBatch`."""

    #: name used in configs and the CLI (``--loss infonce``)
    name: str = ""

    def forward(self, batch: ContrastiveBatch) -> LossOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def config(self) -> dict:
        """Hyper-parameters, written into the model card and the training log."""
        return {}


# --- shared helpers for the losses (pure functions of a batch) -------------------------------------


def cosine_scores(batch: ContrastiveBatch) -> Tensor:
    """``(b, N)`` cosine similarity of every local query with every candidate column.

    Computed in float32: with temperatures as small as 0.01 the logits reach 100, where bf16/fp16
    rounding would swamp the differences between candidates.
    """
    return pairwise_scores(batch.queries, batch.passages, "cosine")


#: similarity functions a loss may score with (``similarity=`` option)
SIMILARITIES = ("cosine", "dot")


def pairwise_scores(rows: Tensor, columns: Tensor, similarity: str = "cosine") -> Tensor:
    """``(n, m)`` similarity of every row with every column in float32: cosine or the raw dot product."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    rows, columns = rows.float(), columns.float()
    if similarity == "cosine":
        rows, columns = F.normalize(rows, dim=-1), F.normalize(columns, dim=-1)
    return rows @ columns.T


def negative_mask(batch: ContrastiveBatch, in_batch_negatives: bool = True) -> Tensor:
    """``(b, N)`` bool, True where column j may act as a negative for row i.

    All columns (``in_batch_negatives``) or only the row's own hard negatives, minus the columns that
    ``candidate_mask`` excludes, and never the row's own positive (it is the label, not a negative).
    """
    b, n = batch.queries.shape[0], batch.passages.shape[0]
    device = batch.queries.device
    mask = torch.full((b, n), in_batch_negatives, dtype=torch.bool, device=device)
    if not in_batch_negatives and batch.hard_negative_index is not None:
        mask.scatter_(1, batch.hard_negative_index.to(device), True)
    if batch.candidate_mask is not None:
        mask &= batch.candidate_mask.to(device=device, dtype=torch.bool)
    mask[torch.arange(b, device=device), batch.positive_index.to(device)] = False
    return mask


def similarity_components(scores: Tensor, positive_index: Tensor, negatives: Tensor) -> dict[str, float]:
    """Mean cosine of the positives and of the valid negatives (``nan`` when a batch has no negative)."""
    positive = scores.detach().gather(1, positive_index.view(-1, 1))
    count = int(negatives.sum())
    neg_sim = float(scores.detach()[negatives].mean()) if count else float("nan")
    return {"pos_sim": float(positive.mean()), "neg_sim": neg_sim}
