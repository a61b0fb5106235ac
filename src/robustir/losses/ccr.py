"""Robust contrastive loss with the contrastive confidence regulariser (Wang et al., AAAI 2024, eq. 8).

For query q with valid candidate columns C(q) (positive + negatives), cosine s and temperature tau::

    nce(p, q) = -log softmax_{C(q)}(s(q, .) / tau)[p]                          (eq. 6)
    ccr(q)    = mean_{p in C(q)} nce(p, q)                                     (eq. 8)
    rcl(q)    = nce(p+, q) - beta * ccr(q)                                     (eq. 8), averaged over rows

This is the paper's appendix listing (A.3). ``variant="authors_code"`` reproduces the sieve model the
authors actually trained (docs/methods.md#ccr-loss): no in-batch negatives (a row sees its own hard
negatives + positive, G columns) and their reduction ``sum(L) / (Q * G)`` over a matrix holding
``nce`` once and ``-beta * ccr`` in every column, i.e. ``mean_i(nce_i / G) - beta * mean_i ccr_i``:
relative to the NCE term the regulariser weight is ``G * beta``, not ``beta``.

Temperature: the paper and the authors' code feed raw cosine into the softmax (tau = 1); pass
``temperature=1.0`` to match them. We default to 0.05 because with tau = 1 the cosine range [-1, 1]
caps every probability ratio at e^2, so the NCE term can barely separate positives from negatives.

beta: the default 0.02 was chosen on a 200-query dev split carved out of SciFact train (bench/vs_st.py --dev 200,
seed 1: InfoNCE 69.27, beta 0.02 69.40, beta 0.1 68.86; docs/benchmarks.md). The paper's 0.5 was set for tau = 1;
at tau = 0.05 the regulariser (a mean NCE over the whole row, ~15x the NCE term) then dominates and pushes every
non-positive column down, which cost 4.5 NDCG@10 on SciFact. A sharp temperature needs a small beta, as the paper
itself uses for dot products (1e-4..1e-3).

Both variants are means of per-row terms (``nce``, ``ccr`` and ``G`` are per row), evaluated in blocks of
``batch.block_rows`` rows (:func:`robustir.losses.base.blocked_sum`): same values and gradients, bounded memory.

:func:`sieve_keep_mask` is the passage-sieve rule of Algorithm 1.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from robustir.errors import ConfigError
from robustir.losses.options import CCROptions, loss_options
from robustir.losses.base import (
    ContrastiveBatch,
    ContrastiveLoss,
    LossOutput,
    blocked_sum,
    negative_mask,
    resolve_block_rows,
    score_operands,
    similarity_means,
    similarity_sums,
)

Variant = Literal["paper", "authors_code"]
VARIANTS = ("paper", "authors_code")


class CCRLoss(ContrastiveLoss):
    """NCE minus beta times the mean NCE over the row's candidates (sharpens the softmax).

    Args:
        temperature: divides the cosine similarities (paper and code: 1.0; default 0.05, see module doc).
        beta: regulariser weight (default 0.02, chosen on a SciFact dev split for tau 0.05, see module doc; paper:
            0.5 at tau 1; authors' code: 0.1 on ``main``, 1.0 on the ``AR2`` branch).
        variant: ``"paper"`` (eq. 8, mean of ``nce - beta * ccr``) or ``"authors_code"`` (see module doc).
        in_batch_negatives: default True for ``"paper"``; ``"authors_code"`` never uses them (True is an error).
    """

    name = "ccr"

    def __init__(self, options: CCROptions | None = None, **keywords: Any) -> None:
        """``options`` (:class:`~robustir.losses.options.CCROptions`: the defaults, types and ranges) or the same
        as keywords (``CCRLoss(beta=0.02)``)."""
        super().__init__()
        self.options = o = loss_options("ccr", options, keywords)
        temperature, beta, variant, in_batch_negatives = o.temperature, o.beta, o.variant, o.in_batch_negatives
        if variant == "authors_code" and in_batch_negatives:
            raise ConfigError("ccr: variant='authors_code' has no in-batch negatives; drop in_batch_negatives "
                              "or use variant='paper'.")
        self.temperature = temperature
        self.beta = beta
        self.variant = variant
        self.in_batch_negatives = variant == "paper" if in_batch_negatives is None else in_batch_negatives

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        queries, passages = score_operands(batch.queries, batch.passages, "cosine")
        b = queries.shape[0]
        positive_index = batch.positive_index.to(queries.device)
        block = resolve_block_rows(b, passages.shape[0], batch.block_rows)
        loss_sum, stats = blocked_sum(self._block(batch), b, block, (queries, positive_index), (passages,))
        loss = loss_sum / b

        nce_sum, ccr_sum, positive_sum, negative_sum, negative_count = stats.unbind()
        components = {
            "nce": float(nce_sum) / b,
            "ccr": float(ccr_sum) / b,
            "loss": float(loss.detach()),
            **similarity_means(b, positive_sum, negative_sum, negative_count),
        }
        return LossOutput(loss, components)

    def _block(self, batch: ContrastiveBatch):
        """Rows ``start:end``: (the rows' summed loss terms, detached statistics)."""

        def block(start: int, end: int, rows: Tensor, positive_index: Tensor, passages: Tensor):
            scores = rows @ passages.T
            negatives = negative_mask(batch, self.in_batch_negatives, start, end)
            row = torch.arange(end - start, device=scores.device)
            candidates = negatives.clone()
            candidates[row, positive_index] = True

            log_p = F.log_softmax((scores / self.temperature).masked_fill(~candidates, float("-inf")), dim=1)
            nce = -log_p[row, positive_index]
            group_size = candidates.sum(dim=1)
            # excluded columns hold -inf; zero them before the row mean (0 * inf would be nan)
            ccr = (-log_p).masked_fill(~candidates, 0.0).sum(dim=1) / group_size
            if self.variant == "paper":
                loss_sum = (nce - self.beta * ccr).sum()
            else:
                # authors' sum(v * L) / sum(v): nce counted once per row, -beta * ccr in every one of its G columns
                loss_sum = (nce / group_size).sum() - self.beta * ccr.sum()
            with torch.no_grad():
                stats = torch.stack([nce.detach().sum(dtype=torch.float64), ccr.detach().sum(dtype=torch.float64),
                                     *similarity_sums(scores, positive_index, negatives)])
            return loss_sum, stats

        return block

    def config(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "beta": self.beta, "variant": self.variant,
                "in_batch_negatives": self.in_batch_negatives}


def sieve_keep_mask(query_emb: Tensor, positive_emb: Tensor, candidate_emb: Tensor, strict: bool = False) -> Tensor:
    """Passage sieve (CCR Algorithm 1): which of each query's m candidate negatives to keep.

    Args:
        query_emb: ``(b, d)``; positive_emb: ``(b, d)``; candidate_emb: ``(b, m, d)``.
        strict: the authors' code rule (``loss > mean``, ties removed) instead of the paper's ``>=``.

    Returns:
        ``(b, m)`` bool, True = keep the negative as a confident (true) negative.

    The paper keeps negative j iff ``nce_j >= mean of nce over the m candidates + positive``. Since
    ``nce_j = logsumexp(s / tau) - s_j / tau``, the log-partition cancels on both sides and the rule is
    ``cos_j <= mean cosine over the same m + 1`` -- independent of the temperature, computed here directly.
    """
    query = F.normalize(query_emb.float(), dim=-1)
    group = F.normalize(torch.cat([positive_emb.unsqueeze(1), candidate_emb], dim=1).float(), dim=-1)
    cosine = torch.einsum("bd,bmd->bm", query, group)
    threshold = cosine.mean(dim=1, keepdim=True)
    negatives = cosine[:, 1:]
    return negatives < threshold if strict else negatives <= threshold
