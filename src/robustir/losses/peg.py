"""PEG progressive-learning loss (Wu et al., "Towards Robust Text Retrieval with Progressive Learning", eq. 3-6).

With cosine s, temperature tau, a batch of B positive pairs and the valid negatives n of each query::

    loss  = mean_q  w_q * -log( e^{s_qp/tau} / (e^{s_qp/tau} + sum_n e^{a_n s_qn / tau}) )     (3)
    w_q   = 1 if s_qp >= sigma else s_qp / sigma,      sigma = mean_B(s_qp) - beta             (4)
    a_n   = 1 if s_qp < sigma or s_qn < s_qp else t + s_qp                                     (5)
    t_s   = alpha * mean_B(s_qp) + (1 - alpha) * t_{s-1},   t_0 = 0                             (6)

Choices where the paper is silent (docs/methods.md#peg-loss-choices):
- the paper writes a *sum* over queries; we take the mean over the local rows (same optimum, the
  learning rate absorbs the scale, and it matches every other loss here);
- ``t`` is a buffer (saved in checkpoints), updated under no_grad once per training forward, *before*
  it is used, from the global-batch mean (CurricularFace order); eval-mode forwards use t unchanged;
- ``sigma`` and ``w_q`` are detached (a sample weight; with grad, ``w_q * CE`` would reward lowering
  s_qp), ``w_q`` is clamped to [0, 1], and when ``sigma <= 0`` a positive below sigma gets ``w_q = 0``
  (the ratio s_qp / sigma is meaningless there);
- ``a_n``'s masks use detached similarities; the factor ``t + s_qp`` is detached by default
  (``detach_negative_scale``), the gradient always flows through ``s_qn``;
- ``a_n`` applies to every negative, in-batch and hard (eq. 3 sums over all N).

Memory-bounded evaluation (:func:`robustir.losses.base.blocked_sum`): the only whole-batch statistic is
``mean_B(s_qp)`` (giving t and sigma), taken first from the positive-score diagonal alone (no gradient,
``(B, d)`` work), then eq. 3 runs per block of rows with t and sigma as constants; the positive score,
``w_q``, ``a_n`` and the masks of a row are computed inside its block, from the block's own score matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from robustir.losses.options import PEGOptions, loss_options
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


class PEGLoss(ContrastiveLoss):
    """Weighted InfoNCE that down-weights likely false positives and up-weights hard negatives.

    Args:
        temperature: tau of eq. 3. Default 0.05, the temperature sentence-transformers models (MiniLM, MPNet,
            scale 20) were trained at; the paper's 0.01 suits models pre-trained at that sharpness (BGE-style)
            and cost 1.4 NDCG@10 on SciFact with MiniLM (docs/benchmarks.md). Pass 0.01 for the paper's setting.
        alpha: momentum of the running bias t, eq. 6 (paper: 0.5).
        beta: margin of the threshold sigma, eq. 4 (paper: 0.1; its ablation found 0.2 best).
        detach_negative_scale: use ``(t + s_qp).detach()`` as a_n; False lets gradient reach s_qp through a_n.
        in_batch_negatives: when False a row only sees its own positive and its own hard negatives.

    The running bias is the buffer ``t`` (read ``loss.t``, set it with :meth:`set_t`); it lives in
    ``state_dict()`` so checkpoints resume with the same value.
    """

    name = "peg"

    def __init__(self, options: PEGOptions | None = None, **keywords: Any) -> None:
        """``options`` (:class:`~robustir.losses.options.PEGOptions`: the defaults, types and ranges) or the same
        as keywords (``PEGLoss(beta=0.2)``)."""
        super().__init__()
        self.options = o = loss_options("peg", options, keywords)
        self.temperature, self.alpha, self.beta = o.temperature, o.alpha, o.beta
        self.detach_negative_scale, self.in_batch_negatives = o.detach_negative_scale, o.in_batch_negatives
        self.t: Tensor
        self.register_buffer("t", torch.zeros((), dtype=torch.float32))

    def set_t(self, value: float) -> None:
        """Overwrite the running bias t (e.g. to restart the curriculum)."""
        self.t.fill_(float(value))

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        queries, passages = score_operands(batch.queries, batch.passages, "cosine")
        b = queries.shape[0]
        device = queries.device
        positive_index = batch.positive_index.to(device)

        # batch statistics come from the whole global batch and carry no gradient: only the positive scores
        # (the diagonal of the score matrix) are needed, so they are computed first, without the matrix
        with torch.no_grad():
            s_qp_all = (queries * passages[positive_index]).sum(dim=-1)
        mean_pos = batch.global_mean(s_qp_all).detach().to(device)
        if self.training:
            with torch.no_grad():
                self.t.copy_(self.alpha * mean_pos + (1 - self.alpha) * self.t.to(device))
        # a snapshot: the blocks may be recomputed in the backward pass, after t has moved on
        t = self.t.detach().to(device).clone()
        sigma = mean_pos - self.beta

        block = resolve_block_rows(b, passages.shape[0], batch.block_rows)
        loss_sum, stats = blocked_sum(self._block(batch), b, block, (queries, positive_index), (passages, t, sigma))
        loss = loss_sum / b

        w_q_sum, scaled_count, positive_sum, negative_sum, negative_count = stats.unbind()
        n_neg = float(negative_count)
        components = {
            "loss": float(loss.detach()),
            "t": float(t),
            "sigma": float(sigma),
            "mean_w_q": float(w_q_sum) / b,
            "share_scaled_negatives": float(scaled_count) / n_neg if n_neg else 0.0,
            **similarity_means(b, positive_sum, negative_sum, negative_count),
        }
        return LossOutput(loss, components)

    def _block(self, batch: ContrastiveBatch):
        """Eq. 3-5 for rows ``start:end`` given t and sigma: (sum of w_q * ce, detached statistics)."""

        def block(start: int, end: int, rows: Tensor, positive_index: Tensor, passages: Tensor, t: Tensor,
                  sigma: Tensor):
            scores = rows @ passages.T
            negatives = negative_mask(batch, self.in_batch_negatives, start, end)
            row = torch.arange(end - start, device=scores.device)
            s_qp = scores[row, positive_index]
            w_q = self.query_weights(s_qp.detach(), sigma)

            # eq. 5 on detached values: a negative is scaled when the pair is trusted and it outranks the positive
            s_qp_col = s_qp.detach().unsqueeze(1)
            scaled = (s_qp_col >= sigma) & (scores.detach() >= s_qp_col) & negatives
            scale = t + (s_qp.detach() if self.detach_negative_scale else s_qp)
            a_n = torch.where(scaled, scale.unsqueeze(1), torch.ones_like(scores))

            # a_n is 1 on the positive column (it is never a negative), so eq. 3's numerator stays e^{s_qp/tau}
            candidates = negatives.clone()
            candidates[row, positive_index] = True
            logits = (a_n * scores / self.temperature).masked_fill(~candidates, float("-inf"))
            ce = torch.logsumexp(logits, dim=1) - s_qp / self.temperature
            with torch.no_grad():
                stats = torch.stack([w_q.sum(dtype=torch.float64), scaled.sum(dtype=torch.float64),
                                     *similarity_sums(scores, positive_index, negatives)])
            return (w_q * ce).sum(), stats

        return block

    @staticmethod
    def query_weights(s_qp: Tensor, sigma: Tensor) -> Tensor:
        """Eq. 4 (detached): 1 at or above sigma, else s_qp / sigma clamped to [0, 1]; 0 below a sigma <= 0."""
        sigma = torch.as_tensor(sigma, dtype=s_qp.dtype, device=s_qp.device)
        ratio = torch.where(sigma > 0, s_qp / sigma.clamp_min(1e-12), torch.zeros_like(s_qp)).clamp(0.0, 1.0)
        return torch.where(s_qp >= sigma, torch.ones_like(s_qp), ratio)

    def config(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "alpha": self.alpha, "beta": self.beta,
                "detach_negative_scale": self.detach_negative_scale, "in_batch_negatives": self.in_batch_negatives}
