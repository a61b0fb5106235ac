"""Cross-process helpers for contrastive training (gloo and nccl).

Everything here degrades to a no-op in a single process, so callers never branch on
``is_distributed()`` themselves.

Gradient convention (relied on by :mod:`robustir.training.batch_engine`): every process computes the
loss of its *own* rows against the gathered columns. :func:`gather_with_grad` sums, over processes,
the gradient that each process's loss sends into the gathered tensor, and hands each process the
slice that belongs to its own rows. Combined with DistributedDataParallel, which *averages*
parameter gradients over processes, the parameters receive the gradient of the mean of the
per-process losses, i.e. of the global-batch mean loss (per-process batches have equal size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """True when a default process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Rank of this process in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_equal_rows(t: Tensor) -> None:
    """Raise if processes hold different numbers of rows (all_gather needs equal shapes)."""
    rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    all_rows = [torch.zeros_like(rows) for _ in range(world_size())]
    dist.all_gather(all_rows, rows)
    sizes = [int(r.item()) for r in all_rows]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"gather_with_grad needs the same number of rows on every process, got {sizes} "
            f"(rank {rank()} has {t.shape[0]}). Fix: use equal per-device batch sizes and drop the "
            "last incomplete batch (drop_last=True)."
        )


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward sums the incoming gradient over processes.

    Each process's loss depends on every process's rows, so the gradient of a row is the sum of the
    gradients that all processes' losses send to it: all_reduce(SUM) the full gradient, keep our slice.
    (all_reduce rather than reduce_scatter because gloo has no reduce_scatter.)
    """

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:  # type: ignore[override]
        t = t.contiguous()
        ctx.rows = t.shape[0]
        ctx.rank = rank()
        parts = [torch.empty_like(t) for _ in range(world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()  # all_reduce works in place; never mutate autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = ctx.rank * ctx.rows
        return grad[start:start + ctx.rows]


def gather_with_grad(t: Tensor) -> Tensor:
    """Concatenate ``t`` from all processes along dim 0 (rank order), keeping gradients.

    Identity when not distributed. Every process must hold the same number of rows; a mismatch
    raises ``ValueError`` instead of hanging or silently misaligning labels.
    """
    if not is_distributed():
        return t
    _check_equal_rows(t)
    if not t.requires_grad:
        # No autograd needed (e.g. integer ids): a plain all_gather.
        parts = [torch.empty_like(t.contiguous()) for _ in range(world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=0)
    return _GatherWithGrad.apply(t)


def global_mean(values: Tensor) -> Tensor:
    """Mean of ``values`` over all elements on all processes, detached (a batch statistic).

    Computed as all_reduce(sum) / all_reduce(count) so that it is exact even when processes hold
    different numbers of values. Accumulates in at least float32 (bf16 sums lose digits).
    """
    values = values.detach()
    acc_dtype = torch.promote_types(values.dtype, torch.float32)
    if not is_distributed():
        return values.to(acc_dtype).mean().to(values.dtype)
    stats = torch.stack([values.to(acc_dtype).sum(),
                         torch.tensor(float(values.numel()), dtype=acc_dtype, device=values.device)])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).to(values.dtype)
