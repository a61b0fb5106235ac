"""Hybrid retrieval: reciprocal rank fusion (RRF) of ranked lists, e.g. a dense and a BM25 list.

Cormack, Clarke and Büttcher (SIGIR 2009): a document's fused score is ``sum_i w_i / (k + rank_i)`` over the lists
it appears in (``rank_i`` from 1; absent from a list: no term), ``k = 60`` by default. Scores of different
retrievers (cosine vs BM25) are never compared, only ranks, so no score normalisation is needed.

Hand-written (15 lines) rather than taken from ``ranx``: ranx's fusion works on its own ``Run`` objects and pulls in
numba; the formula is the whole algorithm. Ties break by the first list's order, then the document id, so the same
lists always fuse to the same order.
"""

from __future__ import annotations

from typing import Hashable, Sequence, TypeVar

from ..validation import NonNegativeFloat, PositiveInt, config_dataclass

__all__ = ["FusionConfig", "reciprocal_rank_fusion"]

Doc = TypeVar("Doc", bound=Hashable)


@config_dataclass
class FusionConfig:
    """How ``hybrid`` mode fuses the dense and the lexical (BM25) lists."""

    rrf_k: PositiveInt = 60
    """RRF's k: larger k flattens the weight of the top ranks (60: the paper's)."""
    dense_weight: NonNegativeFloat = 1.0
    """Weight of the dense list in the fusion."""
    lexical_weight: NonNegativeFloat = 1.0
    """Weight of the BM25 list in the fusion."""
    candidates: PositiveInt = 100
    """Documents taken from each list before fusing (at least top_k are taken)."""

    def fuse(self, dense: Sequence[Doc], lexical: Sequence[Doc], top_k: int | None = None) -> list[tuple[Doc, float]]:
        """:func:`reciprocal_rank_fusion` of a dense and a lexical ranked list with these settings."""
        return reciprocal_rank_fusion([dense, lexical], [self.dense_weight, self.lexical_weight], k=self.rrf_k,
                                      top_k=top_k)


def reciprocal_rank_fusion(lists: Sequence[Sequence[Doc]], weights: Sequence[float] | None = None,
                           k: int = 60, top_k: int | None = None) -> list[tuple[Doc, float]]:
    """Fuse ranked lists (best first) into one ``[(doc, score)]``, best first; ``weights`` default to 1 each."""
    weights = list(weights) if weights is not None else [1.0] * len(lists)
    if len(weights) != len(lists):
        raise ValueError(f"{len(lists)} lists but {len(weights)} weights")
    scores: dict[Doc, float] = {}
    first_seen: dict[Doc, tuple[int, int]] = {}
    for which, (ranked, weight) in enumerate(zip(lists, weights)):
        for rank, doc in enumerate(ranked, start=1):
            scores[doc] = scores.get(doc, 0.0) + weight / (k + rank)
            first_seen.setdefault(doc, (which, rank))
    order = sorted(scores, key=lambda doc: (-scores[doc], first_seen[doc], str(doc)))
    return [(doc, scores[doc]) for doc in order[:top_k]]
