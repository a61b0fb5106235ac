"""InfoNCE with in-batch and hard negatives (PEG paper eq. 2; the "NCE loss" of CCR eq. 6).

For local query i with positive column ``p(i)`` and valid columns ``C(i)`` (positive + negatives)::

    nce_i = -log( exp(s(q_i, p(i)) / tau) / sum_{j in C(i)} exp(s(q_i, j) / tau) ),   s = cosine (or dot)

``symmetric=True`` adds the passage->query direction (each local positive against every query of
the global batch, label ``query_offset + i``) and averages the two directions. With
``symmetric=True, similarity="cosine" | "dot", temperature=0.1`` and no hard negatives this is GUR's
in-pair contrastive loss (queries = the a-sentences, positives = the b-sentences; paper eq. 2, the
authors' ``compute_clip_loss``; docs/methods.md#gur-joint-pre-training):
``(CE(S, diag) + CE(S^T, diag)) / 2`` over ``S = sim(a, b) / tau``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from robustir.errors import ConfigError
from robustir.losses.base import (
    ContrastiveBatch,
    ContrastiveLoss,
    LossOutput,
    SIMILARITIES,
    negative_mask,
    pairwise_scores,
    similarity_components,
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

    def __init__(self, temperature: float = 0.05, in_batch_negatives: bool = True, symmetric: bool = False,
                 similarity: str = "cosine") -> None:
        super().__init__()
        if similarity not in SIMILARITIES:
            raise ConfigError(f"infonce: similarity must be one of {', '.join(SIMILARITIES)}, got {similarity!r}.")
        if temperature <= 0:
            raise ConfigError(f"infonce: temperature must be > 0, got {temperature}.")
        if symmetric and not in_batch_negatives:
            raise ConfigError("infonce: symmetric=True needs in_batch_negatives=True (the passage->query term "
                              "has no negatives otherwise).")
        self.temperature = temperature
        self.in_batch_negatives = in_batch_negatives
        self.symmetric = symmetric
        self.similarity = similarity

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        scores = pairwise_scores(batch.queries, batch.passages, self.similarity)
        negatives = negative_mask(batch, self.in_batch_negatives)
        positive_index = batch.positive_index.to(scores.device)
        logits = scores / self.temperature
        rows = torch.arange(scores.shape[0], device=scores.device)
        candidates = negatives.clone()
        candidates[rows, positive_index] = True
        logits = logits.masked_fill(~candidates, float("-inf"))
        nce_q2p = F.cross_entropy(logits, positive_index)

        loss, components = nce_q2p, {}
        if self.symmetric:
            nce_p2q = self._passage_to_query(batch, positive_index)
            loss = (nce_q2p + nce_p2q) / 2
            components = {"nce_q2p": float(nce_q2p.detach()), "nce_p2q": float(nce_p2q.detach())}
        positive_logit = logits.detach().gather(1, positive_index.view(-1, 1))
        # ties count as correct: the positive is (one of) the top-scored candidates
        top = (positive_logit >= logits.detach().max(dim=1, keepdim=True).values).float()
        components = {
            "nce": float(loss.detach()),
            **components,
            **similarity_components(scores, positive_index, negatives),
            "accuracy": float(top.mean()),
        }
        return LossOutput(loss, components)

    def _passage_to_query(self, batch: ContrastiveBatch, positive_index: Tensor) -> Tensor:
        # single-process batches may leave all_queries unset: then the local queries are the global ones
        all_queries = batch.all_queries if batch.all_queries is not None else batch.queries
        offset = batch.query_offset if batch.all_queries is not None else 0
        logits = pairwise_scores(batch.passages[positive_index], all_queries, self.similarity) / self.temperature
        labels = offset + torch.arange(logits.shape[0], device=logits.device)
        return F.cross_entropy(logits, labels)

    def config(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "in_batch_negatives": self.in_batch_negatives,
                "symmetric": self.symmetric, "similarity": self.similarity}
