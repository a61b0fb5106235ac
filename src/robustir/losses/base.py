"""What every contrastive loss receives and returns.

Losses are pure functions of embeddings. They never encode text, never know about gradient caching,
devices or processes: :class:`robustir.training.batch_engine.BatchEngine` assembles a
:class:`ContrastiveBatch` (local queries against the *global* candidate columns, labels already
offset for this process) and calls the loss once per optimizer step.

Column layout of ``passages`` (built by the engine, relied on by nobody but ``positive_index`` /
``hard_negative_index``): the positives of every process in rank order, then the hard negatives of
every process in rank order, then (with a cross-batch memory, :mod:`robustir.training.memory`) the
``memory_columns`` stored passages of earlier steps, constants.

Memory-bounded losses: every loss here is a sum over its rows of a per-row term, given a few batch
statistics (PEG's mean positive score). :func:`blocked_sum` evaluates such a sum over blocks of
``block_rows`` rows (:func:`resolve_block_rows`; ``ContrastiveBatch.block_rows``, set by the engine) under
non-reentrant activation checkpointing, so the ``(rows, columns)`` score matrix and its softmax
intermediates only ever exist for one block, in the forward and in the backward pass, with the same values
and gradients as the whole-batch computation (docs/methods.md#memory-bounded-losses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _local_mean(values: Tensor) -> Tensor:
    return values.mean()


class RowMask:
    """A ``(rows, columns)`` bool mask that is never materialised whole: ``mask[start:end]`` computes those rows.

    The batch engine hands one to the loss as ``candidate_mask`` when the loss runs in row blocks
    (:func:`resolve_block_rows` smaller than the batch), so that the mask, like the score matrix, only exists
    one block at a time. ``rows(start, end)`` must return the ``(end - start, columns)`` bool rows.
    """

    def __init__(self, shape: tuple[int, int], rows: Callable[[int, int], Tensor]) -> None:
        self.shape = torch.Size(shape)
        self._rows = rows

    def __getitem__(self, index: slice) -> Tensor:
        if not isinstance(index, slice):
            raise TypeError(f"RowMask only supports row slices (mask[start:end]), got {index!r}")
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            raise ValueError("RowMask slices must have step 1")
        return self._rows(start, max(start, stop))

    def materialize(self) -> Tensor:
        """The whole ``(rows, columns)`` mask (defeats the purpose on large batches; for tests and small ones)."""
        return self[:]


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
        block_rows: rows per block of the loss's score matrix (:func:`resolve_block_rows`): ``None`` = auto
            (the whole batch while the matrix is small, else blocks of about :data:`AUTO_BLOCK_SCORES`
            scores), an int forces that many rows per block. Values and gradients do not depend on it.
        column_ids: ``(N,)`` id of the passage in each column when the engine knows them (masks, the memory).
        memory_columns: how many of the last columns come from the cross-batch memory (no gradient); every loss
            treats them as in-batch negatives.

    ``candidate_mask`` may also be a :class:`RowMask` (computed per block of rows); read it through
    :func:`negative_mask` or ``candidate_mask[start:end]``, which both forms support.
    """

    queries: Tensor
    passages: Tensor
    positive_index: Tensor
    hard_negative_index: Tensor | None = None
    candidate_mask: Tensor | RowMask | None = None
    all_queries: Tensor | None = None
    query_offset: int = 0
    global_mean: Callable[[Tensor], Tensor] = field(default=_local_mean)
    block_rows: int | None = None
    column_ids: Tensor | None = None
    memory_columns: int = 0

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


def negative_mask(batch: ContrastiveBatch, in_batch_negatives: bool = True, start: int = 0,
                  end: int | None = None) -> Tensor:
    """``(end - start, N)`` bool for rows ``start:end`` (default: all), True where column j may act as a negative.

    All columns (``in_batch_negatives``) or only the row's own hard negatives, minus the columns that
    ``candidate_mask`` excludes, and never the row's own positive (it is the label, not a negative).
    """
    b, n = batch.queries.shape[0], batch.passages.shape[0]
    end = b if end is None else end
    device = batch.queries.device
    mask = torch.full((end - start, n), in_batch_negatives, dtype=torch.bool, device=device)
    if not in_batch_negatives and batch.hard_negative_index is not None:
        mask.scatter_(1, batch.hard_negative_index[start:end].to(device), True)
    if batch.candidate_mask is not None:
        mask &= batch.candidate_mask[start:end].to(device=device, dtype=torch.bool)
    mask[torch.arange(end - start, device=device), batch.positive_index[start:end].to(device)] = False
    return mask


def similarity_components(scores: Tensor, positive_index: Tensor, negatives: Tensor) -> dict[str, float]:
    """Mean cosine of the positives and of the valid negatives (``nan`` when a batch has no negative)."""
    positive = scores.detach().gather(1, positive_index.view(-1, 1))
    count = int(negatives.sum())
    neg_sim = float(scores.detach()[negatives].mean()) if count else float("nan")
    return {"pos_sim": float(positive.mean()), "neg_sim": neg_sim}


def similarity_sums(scores: Tensor, positive_index: Tensor, negatives: Tensor) -> list[Tensor]:
    """Detached float64 sums for :func:`similarity_means`: positive scores, valid negative scores, negatives count."""
    scores = scores.detach()
    return [scores.gather(1, positive_index.view(-1, 1)).sum(dtype=torch.float64),
            scores.masked_fill(~negatives, 0.0).sum(dtype=torch.float64),
            negatives.sum(dtype=torch.float64)]


def similarity_means(rows: int, positive_sum: Tensor, negative_sum: Tensor, negative_count: Tensor) -> dict[str, float]:
    """``pos_sim`` / ``neg_sim`` of :func:`similarity_components` from the sums of :func:`similarity_sums`."""
    count = float(negative_count)
    return {"pos_sim": float(positive_sum) / rows if rows else float("nan"),
            "neg_sim": float(negative_sum) / count if count else float("nan")}


# --- memory-bounded evaluation: the per-row sum over blocks of rows ----------------------------------

#: ``block_rows=None`` (auto): a loss scores the whole batch at once while rows x columns stays at or below this
#: many scores (128 MiB per float32 matrix), else blocks of ``AUTO_BLOCK_SCORES // columns`` rows. A block holds
#: a handful of such (rows x columns) intermediates (scores, logits, masks, softmax) in its forward and backward.
AUTO_BLOCK_SCORES = 1 << 25


def resolve_block_rows(rows: int, columns: int, block_rows: int | None = None) -> int:
    """Rows per block for a ``(rows, columns)`` score matrix: ``block_rows`` (capped at ``rows``), or auto."""
    rows = max(int(rows), 1)
    if block_rows is not None:
        if isinstance(block_rows, bool) or int(block_rows) != block_rows or block_rows < 1:
            raise ValueError(f"block_rows must be a positive number of rows or None (auto), got {block_rows!r}")
        return min(int(block_rows), rows)
    if rows * max(int(columns), 1) <= AUTO_BLOCK_SCORES:
        return rows
    return max(1, min(rows, AUTO_BLOCK_SCORES // max(int(columns), 1)))


def score_operand(embeddings: Tensor, similarity: str = "cosine") -> Tensor:
    """``embeddings`` in float32, normalised for cosine: the operand of :func:`pairwise_scores`'s matmul."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    embeddings = embeddings.float()
    return F.normalize(embeddings, dim=-1) if similarity == "cosine" else embeddings


def score_operands(rows: Tensor, columns: Tensor, similarity: str = "cosine") -> tuple[Tensor, Tensor]:
    """:func:`score_operand` of both, so ``rows @ columns.T`` is :func:`pairwise_scores` ``(rows, columns)``.

    Normalising once outside the blocks is exact: the normalisation is per row, and each block reuses it.
    """
    return score_operand(rows, similarity), score_operand(columns, similarity)


BlockFn = Callable[..., tuple[Tensor, Tensor]]


def blocked_sum(fn: BlockFn, rows: int, block_rows: int, row_inputs: Sequence[Tensor],
                shared: Sequence[Any] = ()) -> tuple[Tensor, Tensor]:
    """Sum ``fn`` over blocks of rows: ``fn(start, end, *row_blocks, *shared) -> (loss_sum, stats)``.

    ``row_inputs`` are split along dim 0 into blocks of ``block_rows`` rows (block i gets rows
    ``start:end``); ``shared`` (e.g. all candidate columns, batch statistics) is passed whole to every block.
    ``fn`` returns the block's *summed* loss (a scalar with a graph) and a 1-D tensor of detached statistics
    (e.g. sums for logged means); both are summed over blocks. With more than one block and a graph to build,
    every block runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint`: autograd keeps only the
    block's inputs (views of tensors that exist anyway) and recomputes the block's intermediates in the
    backward pass, one block at a time, so no ``(rows, columns)`` tensor ever exists whole. The gradient is
    the whole-batch one (a sum of per-block gradients, accumulated by autograd into the shared inputs). ``fn``
    must be deterministic and free of side effects (no collectives, no buffer updates): it runs twice.
    One block runs ``fn`` directly, exactly the whole-batch computation.
    """
    if rows <= 0:  # nothing to block: one (empty) block, as the whole-batch computation
        loss_sum, block_stats = fn(0, 0, *row_inputs, *shared)
        return loss_sum, block_stats.detach()
    splits = [t.split(block_rows) for t in row_inputs]
    tensors = [t for t in (*row_inputs, *shared) if isinstance(t, Tensor)]
    recompute = (len(splits[0]) > 1 if splits else rows > block_rows) and torch.is_grad_enabled() \
        and any(t.requires_grad for t in tensors)
    total: Tensor | None = None
    stats: Tensor | None = None
    for i, start in enumerate(range(0, rows, block_rows)):
        end = min(start + block_rows, rows)
        args = (start, end, *(s[i] for s in splits), *shared)
        if recompute:
            loss_sum, block_stats = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            loss_sum, block_stats = fn(*args)
        total = loss_sum if total is None else total + loss_sum
        stats = block_stats.detach() if stats is None else stats + block_stats.detach()
    assert total is not None and stats is not None
    return total, stats
