"""The one false-negative margin rule, used by hard-negative mining and by the teacher filter.

A candidate negative ``n`` of query ``q`` is a likely false negative when it scores too close to the
positive ``p`` (NV-Retriever's positive-aware rules):

    absolute margin a:  reject if  s(q, n) > s(q, p) - a
    relative margin r:  reject if  s(q, n) > s(q, p) - |s(q, p)| * r

For ``s(q, p) >= 0`` the relative rule is NV-Retriever's "TopK-PercPos" threshold ``s(q, p) * (1 - r)``. The
``|s|`` keeps the threshold *below* the positive when scores can be negative (raw cross-encoder logits,
cosine of an unrelated pair): ``s(q, p) * (1 - r)`` would then lie above the positive and let negatives that
outscore it through. A score equal to the threshold is kept. ``s(q, p)`` is the lowest score among the
query's positives (the conservative choice when there are several); the callers pick it.
"""

from __future__ import annotations

__all__ = ["REASON_ABSOLUTE", "REASON_RELATIVE", "margin_reason"]

REASON_ABSOLUTE = "teacher_absolute_margin"
REASON_RELATIVE = "teacher_relative_margin"


def margin_reason(negative_score: float, positive_score: float, absolute_margin: float | None,
                  relative_margin: float | None) -> str | None:
    """Which margin rejects a negative scoring ``negative_score`` (a reason string), or None to keep it."""
    if absolute_margin is not None and negative_score > positive_score - absolute_margin:
        return REASON_ABSOLUTE
    if relative_margin is not None and negative_score > positive_score - abs(positive_score) * relative_margin:
        return REASON_RELATIVE
    return None
