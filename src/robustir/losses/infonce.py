"""InfoNCE with in-batch and hard negatives (PEG paper eq. 2; the "NCE loss" of CCR eq. 6).

For local query i with positive column ``p(i)`` and valid columns ``C(i)`` (positive + negatives)::

    nce_i = -log( exp(s(q_i, p(i)) / tau) / sum_{j in C(i)} exp(s(q_i, j) / tau) ),   s = cosine (or dot)

``symmetric=True`` adds the passage->query direction (each local positive against every query of
the global batch, label ``query_offset + i``) and averages the two directions. With
``symmetric=True, similarity="cosine" | "dot", temperature=0.1`` and no hard negatives this is GUR's
in-pair contrastive loss (queries = the a-sentences, positives = the b-sentences; paper eq. 2, the
authors' ``compute_clip_loss``; docs/methods.md#gur-joint-pre-training):
``(CE(S, diag) + CE(S^T, diag)) / 2`` over ``S = sim(a, b) / tau``.

Both directions are sums of per-row cross-entropies, evaluated in blocks of ``batch.block_rows`` rows
(:func:`robustir.losses.base.blocked_sum`): same values and gradients, bounded memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from robustir.errors import ConfigError
from robustir.losses.options import InfoNCEOptions, loss_options
from robustir.losses.base import (
    ContrastiveBatch,
    ContrastiveLoss,
    LossOutput,
    blocked_sum,
    negative_mask,
    resolve_block_rows,
    score_operand,
    score_operands,
    similarity_means,
    similarity_sums,
)


class InfoNCELoss(ContrastiveLoss):
    """Cross-entropy of each query's positive among its valid columns, on similarity / temperature.

    Args:
        temperature: divides the similarities (0.05 is the usual value for cosine).
        in_batch_negatives: when False a row only sees its own positive and its own hard negatives.
        symmetric: also score each positive against all queries (passage->query), mean of both terms.
            Needs in-batch negatives: a passage's only query would otherwise be its own (loss 0).
        similarity: "cosine" (default) or "dot" (raw inner product, e.g. GUR's authors' code); the
            ``pos_sim`` / ``neg_sim`` components are then mean dot products.
    """

    name = "infonce"

    def __init__(self, options: InfoNCEOptions | None = None, **keywords: Any) -> None:
        """``options`` (:class:`~robustir.losses.options.InfoNCEOptions`: the defaults, types and ranges) or the
        same as keywords (``InfoNCELoss(temperature=0.02)``)."""
        super().__init__()
        self.options = o = loss_options("infonce", options, keywords)
        temperature, in_batch_negatives, symmetric, similarity = (o.temperature, o.in_batch_negatives, o.symmetric,
                                                                  o.similarity)
        if symmetric and not in_batch_negatives:
            raise ConfigError("infonce: symmetric=True needs in_batch_negatives=True (the passage->query term "
                              "has no negatives otherwise).")
        self.temperature = temperature
        self.in_batch_negatives = in_batch_negatives
        self.symmetric = symmetric
        self.similarity = similarity

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        queries, passages = score_operands(batch.queries, batch.passages, self.similarity)
        b = queries.shape[0]
        positive_index = batch.positive_index.to(queries.device)
        block = resolve_block_rows(b, passages.shape[0], batch.block_rows)
        nce_sum, stats = blocked_sum(self._query_block(batch), b, block, (queries, positive_index), (passages,))
        nce_q2p = nce_sum / b

        loss, components = nce_q2p, {}
        if self.symmetric:
            nce_p2q = self._passage_to_query(batch, passages, positive_index)
            loss = (nce_q2p + nce_p2q) / 2
            components = {"nce_q2p": float(nce_q2p.detach()), "nce_p2q": float(nce_p2q.detach())}
        positive_sum, negative_sum, negative_count, top = stats.unbind()
        components = {
            "nce": float(loss.detach()),
            **components,
            **similarity_means(b, positive_sum, negative_sum, negative_count),
            "accuracy": float(top) / b,
        }
        return LossOutput(loss, components)

    def _query_block(self, batch: ContrastiveBatch):
        """Rows ``start:end`` of the query->passage term: (summed cross-entropy, detached statistics)."""

        def block(start: int, end: int, rows: Tensor, positive_index: Tensor, passages: Tensor):
            scores = rows @ passages.T
            negatives = negative_mask(batch, self.in_batch_negatives, start, end)
            candidates = negatives.clone()
            candidates[torch.arange(end - start, device=scores.device), positive_index] = True
            logits = (scores / self.temperature).masked_fill(~candidates, float("-inf"))
            nce = F.cross_entropy(logits, positive_index, reduction="sum")
            with torch.no_grad():
                positive_logit = logits.detach().gather(1, positive_index.view(-1, 1))
                # ties count as correct: the positive is (one of) the top-scored candidates
                top = (positive_logit >= logits.detach().max(dim=1, keepdim=True).values).sum(dtype=torch.float64)
                stats = torch.stack([*similarity_sums(scores, positive_index, negatives), top])
            return nce, stats

        return block

    def _passage_to_query(self, batch: ContrastiveBatch, passages: Tensor, positive_index: Tensor) -> Tensor:
        # single-process batches may leave all_queries unset: then the local queries are the global ones
        all_queries = batch.all_queries if batch.all_queries is not None else batch.queries
        offset = batch.query_offset if batch.all_queries is not None else 0
        # passages are already in score form (float32, normalised for cosine): index the local positives
        columns = score_operand(all_queries, self.similarity)
        rows = passages[positive_index]
        labels = offset + torch.arange(rows.shape[0], device=rows.device)
        block = resolve_block_rows(rows.shape[0], columns.shape[0], batch.block_rows)

        def p2q(start: int, end: int, rows: Tensor, labels: Tensor, columns: Tensor):
            logits = (rows @ columns.T) / self.temperature
            return F.cross_entropy(logits, labels, reduction="sum"), logits.new_zeros(0, dtype=torch.float64)

        total, _ = blocked_sum(p2q, rows.shape[0], block, (rows, labels), (columns,))
        return total / rows.shape[0]

    def config(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "in_batch_negatives": self.in_batch_negatives,
                "symmetric": self.symmetric, "similarity": self.similarity}
