"""InfoNCE with in-batch and hard negatives (PEG paper eq. 2; the "NCE loss" of CCR eq. 6).

For local query i with positive column ``p(i)`` and valid columns ``C(i)`` (positive + negatives)::

    nce_i = -log( exp(s(q_i, p(i)) / tau) / sum_{j in C(i)} exp(s(q_i, j) / tau) ),   s = cosine (or dot)

``symmetric=True`` adds the passage->query direction (each local positive against every query of
the global batch, label ``query_offset + i``) and averages the two directions. With
``symmetric=True, similarity="cosine" | "dot", temperature=0.1`` and no hard negatives this is GUR's
in-pair contrastive loss (queries = the a-sentences, positives = the b-sentences; paper eq. 2, the
authors' ``compute_clip_loss``; docs/methods.md#gur-joint-pre-training):
``(CE(S, diag) + CE(S^T, diag)) / 2`` over ``S = sim(a, b) / tau``.

``denominator="gte"`` is GTE's improved contrastive loss (Li et al. 2023, "Towards General Text Embeddings with
Multi-stage Contrastive Learning", eq. 3): the positive's denominator also holds the other queries of the batch
(``s(q_i, q_j)``), the row's positive against the other queries (``s(d_i, q_j)``) and against the other passages
(``s(d_i, d_j)``), each divided by tau::

    Z_i = sum_{j in C(i)} e^{s(q_i,d_j)/tau} + sum_{j in Q(i)} (e^{s(q_i,q_j)/tau} + e^{s(d_i,q_j)/tau})
          + sum_{j in C(i), j != p(i)} e^{s(d_i,d_j)/tau}

where ``Q(i)`` are the queries whose positive column is a valid negative of row i (so a repeated query, or
another query of the same positive, is never pushed away: the candidate mask of the batch engine decides, as
for passages). ``false_negative_margin=m`` drops, in every term, any negative scored above the row's positive
``s(q_i, d_i) + m`` (Qwen3-Embedding's false-negative masking, m = 0.1 there): such a column is more likely an
unlabelled positive than a negative. The threshold carries no gradient.

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
        denominator: "standard" or "gte" (GTE's q-q, d-q and d-d terms in the denominator; module docstring).
        false_negative_margin: drop negatives scored above the positive + this margin; ``None`` = off.
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
        if o.denominator == "gte" and (symmetric or not in_batch_negatives):
            raise ConfigError("infonce: denominator='gte' already holds the passage->query term and needs the "
                              "batch's other queries and passages: use it with symmetric=False and "
                              "in_batch_negatives=True.")
        self.temperature = temperature
        self.in_batch_negatives = in_batch_negatives
        self.symmetric = symmetric
        self.similarity = similarity
        self.denominator = o.denominator
        self.false_negative_margin = o.false_negative_margin

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        queries, passages = score_operands(batch.queries, batch.passages, self.similarity)
        b = queries.shape[0]
        positive_index = batch.positive_index.to(queries.device)
        shared: tuple = (passages,)
        if self.denominator == "gte":
            shared = (passages, score_operand(self._global_queries(batch, positive_index), self.similarity))
        columns = 2 * sum(t.shape[0] for t in shared) if self.denominator == "gte" else passages.shape[0]
        block = resolve_block_rows(b, columns, batch.block_rows)
        nce_sum, stats = blocked_sum(self._query_block(batch), b, block, (queries, positive_index), shared)
        nce_q2p = nce_sum / b

        loss, components = nce_q2p, {}
        if self.symmetric:
            nce_p2q = self._passage_to_query(batch, passages, positive_index)
            loss = (nce_q2p + nce_p2q) / 2
            components = {"nce_q2p": float(nce_q2p.detach()), "nce_p2q": float(nce_p2q.detach())}
        positive_sum, negative_sum, negative_count, top, dropped = stats.unbind()
        components = {
            "nce": float(loss.detach()),
            **components,
            **similarity_means(b, positive_sum, negative_sum, negative_count),
            "accuracy": float(top) / b,
        }
        if self.false_negative_margin is not None:  # mean number of negatives dropped per row, every term
            components["false_negatives_dropped"] = float(dropped) / b
        return LossOutput(loss, components)

    def _query_block(self, batch: ContrastiveBatch):
        """Rows ``start:end`` of the query->passage term: (summed cross-entropy, detached statistics)."""

        def block(start: int, end: int, rows: Tensor, positive_index: Tensor, passages: Tensor,
                  all_queries: Tensor | None = None):
            scores = rows @ passages.T
            negatives = negative_mask(batch, self.in_batch_negatives, start, end)
            parts, masks = [scores], [negatives]
            if all_queries is not None:  # GTE: q-q, d-q, d-d beside q-d
                # query j is a negative of row i exactly when its positive (column j) is one
                other_queries = negatives[:, :all_queries.shape[0]]
                own_positives = passages[positive_index]
                parts += [rows @ all_queries.T, own_positives @ all_queries.T, own_positives @ passages.T]
                masks += [other_queries, other_queries, negatives]
            dropped = scores.new_zeros((), dtype=torch.float64)
            if self.false_negative_margin is not None:
                with torch.no_grad():
                    ceiling = scores.detach().gather(1, positive_index.view(-1, 1)) + self.false_negative_margin
                    kept = [mask & (part.detach() <= ceiling) for part, mask in zip(parts, masks)]
                    dropped = sum((m.sum(dtype=torch.float64) - k.sum(dtype=torch.float64))
                                  for m, k in zip(masks, kept))
                masks = kept
            negatives = masks[0]
            candidates = negatives.clone()
            candidates[torch.arange(end - start, device=scores.device), positive_index] = True
            masks[0] = candidates
            if len(parts) == 1:  # the default: no copy of the (rows, columns) scores into a concatenation
                logits = (scores / self.temperature).masked_fill(~candidates, float("-inf"))
            else:
                logits = torch.cat([part / self.temperature for part in parts], dim=1)
                logits = logits.masked_fill(~torch.cat(masks, dim=1), float("-inf"))
            nce = F.cross_entropy(logits, positive_index, reduction="sum")
            with torch.no_grad():
                positive_logit = logits.detach().gather(1, positive_index.view(-1, 1))
                # ties count as correct: the positive is (one of) the top-scored candidates
                top = (positive_logit >= logits.detach().max(dim=1, keepdim=True).values).sum(dtype=torch.float64)
                stats = torch.stack([*similarity_sums(scores, positive_index, negatives), top, dropped])
            return nce, stats

        return block

    @staticmethod
    def _global_queries(batch: ContrastiveBatch, positive_index: Tensor) -> Tensor:
        """The global batch's queries, checked to sit in the order of their positive columns (query j's positive
        is column j), as the batch engine and :meth:`ContrastiveBatch.from_groups` lay them out."""
        all_queries, offset = InfoNCELoss._all_queries(batch)
        expected = offset + torch.arange(positive_index.shape[0], device=positive_index.device)
        if all_queries.shape[0] > batch.passages.shape[0] or not torch.equal(positive_index, expected):
            raise ConfigError("infonce: denominator='gte' needs the batch laid out as the batch engine does "
                              "(query j's positive in passage column j, hard negatives after the positives).")
        return all_queries

    @staticmethod
    def _all_queries(batch: ContrastiveBatch) -> tuple[Tensor, int]:
        """The global batch's queries and the row of the first local one; a single-process batch may leave
        ``all_queries`` unset: then the local queries are the global ones."""
        if batch.all_queries is None:
            return batch.queries, 0
        return batch.all_queries, batch.query_offset

    def _passage_to_query(self, batch: ContrastiveBatch, passages: Tensor, positive_index: Tensor) -> Tensor:
        all_queries, offset = self._all_queries(batch)
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
                "symmetric": self.symmetric, "similarity": self.similarity, "denominator": self.denominator,
                "false_negative_margin": self.false_negative_margin}
