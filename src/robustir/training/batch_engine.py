"""The one batch engine: in-batch + hard negatives, gradient caching and cross-process negatives.

Every loss (:mod:`robustir.losses`) is a pure function of embeddings. :class:`BatchEngine` turns
tokenised queries and passages into those embeddings and a :class:`ContrastiveBatch`, so every loss
gets every capability below and no loss has a "cached" twin.

Input layout (FlagEmbedding train groups): for ``b`` queries and ``k`` hard negatives,
``passage_features`` has ``b * (1 + k)`` rows; row ``i * (1 + k)`` is query ``i``'s positive and the
next ``k`` rows are its hard negatives.

Column layout of ``ContrastiveBatch.passages`` (``W`` processes, this one has rank ``r``): the
positives of all ranks in rank order, then the hard negatives of all ranks in rank order, so
``positive_index[i] = r*b + i`` and ``hard_negative_index[i, j] = W*b + r*b*k + i*k + j``.

Gradient caching (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"; algorithm of luyug/GradCache), used when ``chunk_size`` is smaller than the batch:

1. forward every chunk of ``chunk_size`` rows without a graph, recording a :class:`RandContext`
   before each chunk;
2. treat the concatenated embeddings as leaves, compute the loss **once** on the full matrices
   (so batch statistics such as PEG's sigma and momentum t see the whole batch and are updated
   once per step) and back-propagate it to the leaves: their ``.grad`` is the gradient cache;
3. replay every chunk with a graph under its saved RNG state (identical dropout masks) and
   back-propagate the surrogate ``sum(embeddings_chunk * cached_grad_chunk)``, whose parameter
   gradient equals the full-batch one.

With ``step(..., backward=False)`` the returned loss carries a graph in both modes; in cached mode
its backward runs step 3 from inside autograd, so the caller may scale it first
(``scaler.scale(loss).backward()``, ``(loss / accumulation_steps).backward()``).

Auxiliary losses (the same forward also yields a non-contrastive loss, e.g. GUR's masked-LM loss; a
RetroMAE-style objective could use it too): the model callable may return ``(embeddings, AuxLoss)``
(:class:`robustir.losses.base.AuxLoss`; or a sequence of them) with ``total`` the **sum** over the
forward's units (masked tokens) and ``count`` their number. The step's aux loss is
``sum(totals) / sum(counts)`` over every query and passage forward, and the returned loss is
``loss_weight * contrastive + sum(aux.weight * aux mean)``. Plain mode adds it directly. Cached mode
records every chunk's total and count in step 1 (so the step's count is known before the replay),
makes the step's aux means leaves next to the embeddings in step 2, and in step 3 adds
``total_chunk * d(loss)/d(mean) / count_step`` to each chunk's surrogate: parameter gradients equal
the plain step's, whatever the chunk boundaries (tests/test_batch_engine.py).

Multi-process scaling: each process computes the loss of its *local* rows (mean over its ``b``
rows) against the *gathered* columns. :func:`robustir.training.distributed.gather_with_grad` sums
over processes the gradient that every process's loss sends into the gathered tensors, and
DistributedDataParallel *averages* parameter gradients over processes; together the parameters
receive the gradient of the mean of the per-process losses, which is the global-batch mean loss
because every process has the same ``b``. Without DDP, average the parameter gradients over
processes yourself (``all_reduce(SUM) / world_size``) to obtain the same gradient. Aux losses are
**not** gathered: each process adds the mean over its own units (its own count), so after DDP's
averaging the parameters receive the gradient of the mean over processes of the per-process aux means,
which equals the global mean over all units only when every process has the same count.

Memory-bounded losses: ``block_rows`` (``ContrastiveBatch.block_rows``) makes every loss evaluate its
``(b, N)`` score matrix in blocks of rows (:func:`robustir.losses.base.blocked_sum`; ``None`` = auto, blocks
only when the matrix is large), with the same values and gradients. When the loss runs in blocks, the
duplicate mask is a :class:`robustir.losses.base.RowMask` computed per block too, so nothing of size
``b x N`` is materialised by the engine or the loss. It composes with GradCache (the loss on the cached
leaves runs in blocks) and with the cross-process gather (blocks of local rows against the gathered columns).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import reduce
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states, set_device_states

from robustir.losses.base import AuxLoss, ContrastiveBatch, ContrastiveLoss, LossOutput, RowMask, resolve_block_rows
from robustir.training import distributed
from robustir.training.memory import PassageMemory

Features = Mapping[str, Any]
ContextFactory = Callable[[], AbstractContextManager]
#: what the model callable returns: embeddings, or embeddings and the auxiliary loss(es) of the same forward
ModelOutput = Tensor | tuple[Tensor, AuxLoss | Sequence[AuxLoss]]
Model = Callable[[Features], ModelOutput]

__all__ = ["AuxLoss", "RandContext", "BatchEngine"]


class RandContext:
    """Snapshot of the RNG state, replayed on ``with`` so dropout draws the same masks again.

    The CPU generator is always saved; the CUDA (or other accelerator) generator of every device
    that holds one of ``tensors`` is saved as well, so the tensors must already be on their device
    when the context is created. Entering forks the RNG (``torch.random.fork_rng``) and restores the
    snapshot; leaving ends the fork, so the outer random stream continues as if nothing happened.
    """

    def __init__(self, *tensors: Any) -> None:
        self.cpu_state = torch.get_rng_state()
        self.device_ids, self.device_states = get_device_states(*tensors)
        accelerator_types = {t.device.type for t in tensors
                             if isinstance(t, Tensor) and t.device.type not in ("cpu", "meta")}
        # Prefer cuda, as torch.utils.checkpoint does, if tensors live on several device types.
        self.device_type = "cuda" if "cuda" in accelerator_types else next(iter(accelerator_types), "cuda")
        self._fork: AbstractContextManager | None = None

    def __enter__(self) -> "RandContext":
        self._fork = torch.random.fork_rng(devices=self.device_ids, enabled=True, device_type=self.device_type)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        set_device_states(self.device_ids, self.device_states, device_type=self.device_type)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._fork is not None, "RandContext.__exit__ without __enter__"
        self._fork.__exit__(*exc)
        self._fork = None


def _num_rows(features: Features, what: str) -> int:
    rows = {v.shape[0] for v in features.values() if isinstance(v, Tensor)}
    if len(rows) != 1:
        raise ValueError(f"{what}: every tensor must have the same number of rows (dim 0), got {sorted(rows)}")
    return rows.pop()


def _split_features(features: Features, chunk_size: int) -> list[dict[str, Any]]:
    """Split every tensor of a feature dict into row chunks; non-tensors are shared by all chunks."""
    n = _num_rows(features, "features")
    return [{key: (v[start:start + chunk_size] if isinstance(v, Tensor) else v) for key, v in features.items()}
            for start in range(0, n, chunk_size)]


def _feature_tensors(features: Features) -> list[Tensor]:
    return [v for v in features.values() if isinstance(v, Tensor)]


def _device_anchors(model: Any) -> list[Tensor]:
    """One parameter per device the model's parameters live on (none for a plain callable)."""
    if not isinstance(model, nn.Module):
        return []
    anchors: dict[torch.device, Tensor] = {}
    for parameter in model.parameters():
        anchors.setdefault(parameter.device, parameter)
    return list(anchors.values())


def _loss_precision(reps: Tensor) -> Tensor:
    # Similarities divided by tau = 0.01 need more than bf16/fp16's 8-11 mantissa bits.
    return reps.float() if reps.dtype in (torch.float16, torch.bfloat16) else reps


def _model_output(output: Any) -> tuple[Tensor, list[AuxLoss]]:
    """Split what the model callable returned into the embeddings and its (possibly empty) aux losses."""
    if isinstance(output, Tensor):
        return output, []
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[0], Tensor):
        aux = [output[1]] if isinstance(output[1], AuxLoss) else list(output[1])
        if all(isinstance(a, AuxLoss) for a in aux):
            return output[0], aux
    raise TypeError("the model callable must return (rows, d) embeddings or (embeddings, AuxLoss) / "
                    f"(embeddings, [AuxLoss, ...]), got {type(output).__name__}")


def _sum_aux(forwards: Sequence[Sequence[AuxLoss]]) -> dict[str, AuxLoss]:
    """Sum the totals and counts of the aux losses of several forwards, by name (first-seen order)."""
    summed: dict[str, AuxLoss] = {}
    for aux_losses in forwards:
        for aux in aux_losses:
            seen = summed.get(aux.name)
            count = float(aux.count)
            if seen is None:
                summed[aux.name] = AuxLoss(aux.total, count, aux.name, aux.weight)
            elif seen.weight != aux.weight:
                raise ValueError(f"aux loss {aux.name!r} has weight {seen.weight} in one forward and {aux.weight} "
                                 "in another")
            else:
                summed[aux.name] = AuxLoss(seen.total + aux.total, float(seen.count) + count, aux.name, aux.weight)
    return summed


def _aux_mean(aux: AuxLoss) -> Tensor:
    # a step without any unit (e.g. no masked token) has total 0: the mean is that 0, still in the graph
    return _loss_precision(aux.total) / max(float(aux.count), 1.0)


def _no_autocast(device_type: str) -> AbstractContextManager:
    """Disable an autocast the caller may have wrapped around ``step`` (the loss runs in fp32)."""
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device_type):
        return nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


class _ReplayOnBackward(torch.autograd.Function):
    """Identity on the cached embeddings whose backward runs the GradCache replay (step 3).

    Lets ``step(..., backward=False)`` return a loss that the caller back-propagates itself (for
    example ``scaler.scale(loss).backward()`` or ``(loss / accumulation_steps).backward()``): the
    replay receives the gradient already multiplied by whatever the caller scaled the loss with, for
    the embeddings and for the step's aux-loss means alike.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, replay: Callable[[Tensor | None, Tensor | None, Tensor | None], None], queries: Tensor,
        passages: Tensor, aux_means: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        ctx.replay = replay
        return queries.clone(), passages.clone(), aux_means.clone()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad_queries: Tensor | None, grad_passages: Tensor | None, grad_aux: Tensor | None
    ) -> tuple[None, None, None, None]:
        ctx.replay(grad_queries, grad_passages, grad_aux)
        return None, None, None, None


class BatchEngine:
    """Encode a batch, build the :class:`ContrastiveBatch`, compute the loss and its gradients.

    Args:
        loss: any :class:`ContrastiveLoss`; called exactly once per :meth:`step`.
        chunk_size: rows per forward chunk for gradient caching; ``None`` (or a value covering both
            the query and the passage rows) runs a plain forward/backward.
        gather_across_processes: gather queries and passages from all processes so every process
            sees the global batch as in-batch negatives (no-op in a single process).
        mask_duplicate_positives: with ``passage_ids`` given to :meth:`step`, mask columns that carry
            the same passage as a row's positive (they would be false negatives).
        autocast: factory of the mixed-precision context used for *every* model forward (the
            no-grad pass and the replay must match), e.g.
            ``lambda: torch.autocast("cuda", dtype=torch.bfloat16)``. The loss itself always runs
            outside autocast on float32 (or float64) embeddings.
        loss_weight: multiplies the contrastive loss before the model's aux losses (each with its own
            :attr:`AuxLoss.weight`) are added, e.g. GUR's ``alpha``.
        block_rows: query rows per block of the loss's score matrix (``ContrastiveBatch.block_rows``):
            ``None`` = auto (the whole batch while ``b x N`` is at most
            :data:`robustir.losses.base.AUTO_BLOCK_SCORES` scores, else blocks under that budget), an int
            forces it. Values and gradients do not depend on it; a smaller block trades a recomputation of
            each block's scores in the backward pass for memory.
        memory: a :class:`robustir.training.memory.PassageMemory` (cross-batch memory, XBM): its passages join
            every step's columns as constant negatives (after the positives and hard negatives), minus the ones
            that hold a known positive of the row's query, and each step's own columns are pushed into it after
            the loss. Needs ``passage_ids`` at every step and ``mask_duplicate_positives``. A step with
            ``in_batch_negatives=False`` neither reads nor fills it.
    """

    def __init__(
        self,
        loss: ContrastiveLoss,
        chunk_size: int | None = None,
        gather_across_processes: bool = True,
        mask_duplicate_positives: bool = True,
        autocast: ContextFactory | None = None,
        loss_weight: float = 1.0,
        block_rows: int | None = None,
        memory: PassageMemory | None = None,
    ) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size}")
        if memory is not None and not mask_duplicate_positives:
            raise ValueError("a passage memory needs mask_duplicate_positives=True: the memory holds earlier steps' "
                             "passages, among them the positives of queries that come back, which must not act as "
                             "their negatives")
        self.memory = memory
        resolve_block_rows(1, 1, block_rows)  # validates
        self.block_rows = block_rows
        self.loss = loss
        self.chunk_size = chunk_size
        self.gather_across_processes = gather_across_processes
        self.mask_duplicate_positives = mask_duplicate_positives
        self.autocast = autocast
        self.loss_weight = float(loss_weight)

    # ------------------------------------------------------------------ batch layout

    def _gathering(self) -> bool:
        return self.gather_across_processes and distributed.is_distributed()

    def build_batch(
        self,
        queries: Tensor,
        passages: Tensor,
        num_hard_negatives: int,
        passage_ids: Tensor | None = None,
        positive_ids: Tensor | None = None,
        in_batch_negatives: bool = True,
    ) -> ContrastiveBatch:
        """Build the :class:`ContrastiveBatch` from local ``(b, d)`` queries and ``(b*(1+k), d)`` grouped passages.

        ``in_batch_negatives=False`` (a training source that asks for it): the candidate mask keeps only each row's
        positive and its own hard negatives, so every loss sees no other column (the same mask every loss already
        honours; no loss needs a variant)."""
        b, d = queries.shape
        k = num_hard_negatives
        if passages.shape[0] != b * (1 + k):
            raise ValueError(
                f"expected {b} queries x (1 positive + {k} hard negatives) = {b * (1 + k)} passage rows, "
                f"got {passages.shape[0]}. Passages must be grouped per query: positive, then its negatives."
            )
        gather = self._gathering()
        world = distributed.world_size() if gather else 1
        rank = distributed.rank() if gather else 0
        gather_fn = distributed.gather_with_grad if gather else (lambda t: t)

        groups = passages.view(b, 1 + k, d)
        all_queries = gather_fn(queries)
        columns = [gather_fn(groups[:, 0])]
        if k > 0:
            columns.append(gather_fn(groups[:, 1:].reshape(b * k, d)))
        all_passages = torch.cat(columns, dim=0)

        device = queries.device
        positive_index = rank * b + torch.arange(b, device=device)
        hard_negative_index = None
        if k > 0:
            hard_negative_index = world * b + rank * b * k + torch.arange(b * k, device=device).view(b, k)

        column_ids = None  # the ids of the columns: for the duplicate mask, and a memory needs them
        if passage_ids is not None and self.mask_duplicate_positives:
            column_ids = self._column_ids(passage_ids.to(device), b, k, gather_fn)
        memory_columns = 0
        if self.memory is not None and in_batch_negatives:
            if column_ids is None:
                raise ValueError("a passage memory needs passage_ids at every step (to mask the stored passages "
                                 "that are a row's positive)")
            stored, stored_ids = self.memory.read()
            memory_columns = stored.shape[0]
            if memory_columns:
                all_passages = torch.cat([all_passages, stored.to(device=device, dtype=all_passages.dtype)])
                column_ids = torch.cat([column_ids, stored_ids.to(device)])

        candidate_mask = None
        if column_ids is not None:
            own_ids = passage_ids.to(device).view(b, 1 + k)[:, 0]
            candidate_mask = self._duplicate_mask(column_ids, own_ids, positive_index,
                                                  None if positive_ids is None else positive_ids.to(device),
                                                  self.block_rows)
        if not in_batch_negatives:
            candidate_mask = self._own_columns_mask(b, all_passages.shape[0], positive_index, hard_negative_index,
                                                    candidate_mask, self.block_rows)

        return ContrastiveBatch(
            queries=queries,
            passages=all_passages,
            positive_index=positive_index,
            hard_negative_index=hard_negative_index,
            candidate_mask=candidate_mask,
            all_queries=all_queries,
            query_offset=rank * b,
            global_mean=distributed.global_mean,
            block_rows=self.block_rows,
            column_ids=column_ids,
            memory_columns=memory_columns,
        )

    @staticmethod
    def _column_ids(passage_ids: Tensor, b: int, k: int, gather_fn: Callable[[Tensor], Tensor]) -> Tensor:
        """The ``(W * b * (1 + k),)`` ids of the global batch's passage columns, in column order."""
        if passage_ids.shape != (b * (1 + k),):
            raise ValueError(f"passage_ids must have one id per passage row, shape ({b * (1 + k)},), "
                             f"got {tuple(passage_ids.shape)}")
        with torch.no_grad():
            groups = passage_ids.view(b, 1 + k)
            column_ids = [gather_fn(groups[:, 0].contiguous())]
            if k > 0:
                column_ids.append(gather_fn(groups[:, 1:].reshape(b * k)))
            return torch.cat(column_ids)

    @staticmethod
    def _duplicate_mask(
        column_ids: Tensor, own_ids: Tensor, positive_index: Tensor, positive_ids: Tensor | None = None,
        block_rows: int | None = None,
    ) -> Tensor | RowMask | None:
        """``(b, N)`` mask, False where a column holds row i's positive passage but is not its positive column.

        ``column_ids``: the id of every column (:meth:`_column_ids`, then the memory's); ``own_ids``: the ``(b,)``
        ids of the rows' positives. With ``positive_ids`` (``(b, P)``, padded with -1) a column holding *any* known
        positive of row i's query is masked too (a query with several positives can meet another of them in the
        batch, or in the memory).

        When the loss will run in blocks of rows (``resolve_block_rows(b, N, block_rows) < b``) the mask is a
        :class:`RowMask` that computes each block's rows on demand (the same rows, exactly), so no ``(b, N)``
        tensor is built; ``None`` when nothing is masked.
        """
        b = own_ids.shape[0]
        if positive_ids is not None and positive_ids.shape[0] != b:
            raise ValueError(f"positive_ids must have one row per query, shape ({b}, P), "
                             f"got {tuple(positive_ids.shape)}")
        with torch.no_grad():
            # padding (-1) becomes -2, which matches no id
            known = None if positive_ids is None else positive_ids.masked_fill(positive_ids < 0, -2)

        def rows(start: int, end: int) -> Tensor:
            with torch.no_grad():
                duplicate = column_ids.unsqueeze(0) == own_ids[start:end].unsqueeze(1)
                if known is not None:
                    for j in range(known.shape[1]):  # one (rows, N) comparison per known positive
                        duplicate |= column_ids.unsqueeze(0) == known[start:end, j:j + 1]
                duplicate[torch.arange(end - start, device=duplicate.device), positive_index[start:end]] = False
                return ~duplicate

        n = column_ids.shape[0]
        block = resolve_block_rows(b, n, block_rows)
        if block >= b:
            mask = rows(0, b)
            return None if bool(mask.all()) else mask  # nothing to mask: let the loss take its fast path
        if all(bool(rows(start, min(start + block, b)).all()) for start in range(0, b, block)):
            return None
        return RowMask((b, n), rows)

    @staticmethod
    def _own_columns_mask(b: int, n: int, positive_index: Tensor, hard_negative_index: Tensor | None,
                          within: Tensor | RowMask | None, block_rows: int | None) -> Tensor | RowMask:
        """``(b, N)`` mask keeping only row i's positive and hard-negative columns (and of those, what ``within``
        keeps); a :class:`RowMask` when the loss runs in blocks of rows."""

        def rows(start: int, end: int) -> Tensor:
            with torch.no_grad():
                device = positive_index.device
                mask = torch.zeros(end - start, n, dtype=torch.bool, device=device)
                mask[torch.arange(end - start, device=device), positive_index[start:end]] = True
                if hard_negative_index is not None:
                    mask.scatter_(1, hard_negative_index[start:end], True)
                if within is not None:
                    mask &= within[start:end].to(device=device, dtype=torch.bool)
                return mask

        return rows(0, b) if resolve_block_rows(b, n, block_rows) >= b else RowMask((b, n), rows)

    # ------------------------------------------------------------------ encoding

    def _autocast(self) -> AbstractContextManager:
        return self.autocast() if self.autocast is not None else nullcontext()

    def _encode(self, model: Model, features: Features) -> tuple[Tensor, list[AuxLoss]]:
        with self._autocast():
            return _model_output(model(features))

    def _loss(self, queries: Tensor, passages: Tensor, k: int, passage_ids: Tensor | None,
              positive_ids: Tensor | None = None, in_batch_negatives: bool = True) -> LossOutput:
        queries, passages = _loss_precision(queries), _loss_precision(passages)
        with _no_autocast(queries.device.type):
            batch = self.build_batch(queries, passages, k, passage_ids, positive_ids, in_batch_negatives)
            out = self.loss(batch)
        if self.memory is not None and in_batch_negatives:
            # this step's own columns (every process's: the same store everywhere), after the loss has read the
            # earlier ones; constants (detached), so the memory never carries a graph
            step_columns = batch.passages.shape[0] - batch.memory_columns
            assert batch.column_ids is not None  # build_batch requires passage_ids with a memory
            self.memory.push(batch.passages[:step_columns], batch.column_ids[:step_columns])
            out.components["memory_columns"] = float(batch.memory_columns)
        return out

    def _with_aux(self, out: LossOutput, aux: Mapping[str, AuxLoss], means: Sequence[Tensor]) -> LossOutput:
        """``loss_weight * contrastive + sum(weight * aux mean)``; the aux means join the components."""
        loss = out.loss if self.loss_weight == 1.0 else self.loss_weight * out.loss
        components = dict(out.components)
        for (name, a), mean in zip(aux.items(), means):
            if name in components:
                raise ValueError(f"aux loss name {name!r} collides with a component of the {type(self.loss).__name__}")
            loss = loss + a.weight * mean
            components[name] = float(mean.detach())
        return LossOutput(loss, components)

    def _is_plain(self, num_query_rows: int, num_passage_rows: int) -> bool:
        return self.chunk_size is None or self.chunk_size >= max(num_query_rows, num_passage_rows)

    # ------------------------------------------------------------------ the step

    def step(
        self,
        model: Model,
        query_features: Features,
        passage_features: Features,
        num_hard_negatives: int,
        passage_ids: Tensor | None = None,
        backward: bool = True,
        no_sync: ContextFactory | None = None,
        positive_ids: Tensor | None = None,
        in_batch_negatives: bool = True,
    ) -> LossOutput:
        """Encode, compute the loss once and (by default) back-propagate it into ``model``'s parameters.

        Args:
            model: callable mapping a feature dict to ``(rows, d)`` embeddings (e.g. an ``nn.Module``,
                possibly wrapped in DistributedDataParallel), or to ``(embeddings, aux)`` where ``aux`` is
                an :class:`AuxLoss` (or a sequence of them) computed by the same forward, e.g. an MLM loss
                as a sum over the chunk's masked tokens and their count. The returned loss is then
                ``loss_weight * contrastive + sum(aux.weight * sum(totals) / sum(counts))`` over every
                query and passage forward of the step, and equal in plain and cached mode.
            query_features: tokenised queries, ``b`` rows per tensor.
            passage_features: tokenised passages, ``b * (1 + num_hard_negatives)`` rows, grouped per query.
            num_hard_negatives: ``k``, hard negatives per query.
            passage_ids: optional ``(b*(1+k),)`` int64 id per passage row (e.g. a text hash) to mask
                duplicates of a row's positive among its negatives.
            positive_ids: optional ``(b, P)`` ids of every known positive of each row's query (-1 pads);
                with ``passage_ids``, columns holding any of them are masked for that row.
            in_batch_negatives: False masks every column but each row's positive and own hard negatives (a
                training source with ``in_batch_negatives: false``).
            backward: run the backward pass here and return a detached loss. With ``False`` the
                returned loss carries a graph and the caller calls ``.backward()`` on it (possibly
                scaled); in cached mode that backward triggers the chunk replay.
            no_sync: factory of the context that suppresses gradient synchronisation (DDP's
                ``model.no_sync``); all replay chunks but the last run under it. Defaults to
                ``model.no_sync`` when ``model`` is DistributedDataParallel.

        Returns:
            The loss and its logged components (the contrastive loss's, plus the unweighted mean of
            every aux loss under its name).
        """
        num_queries = _num_rows(query_features, "query_features")
        num_passages = _num_rows(passage_features, "passage_features")
        if num_passages != num_queries * (1 + num_hard_negatives):
            raise ValueError(
                f"{num_queries} queries with {num_hard_negatives} hard negatives each need "
                f"{num_queries * (1 + num_hard_negatives)} passage rows, got {num_passages}"
            )
        if no_sync is None and isinstance(model, nn.parallel.DistributedDataParallel):
            no_sync = model.no_sync

        if self._is_plain(num_queries, num_passages):
            queries, query_aux = self._encode(model, query_features)
            passages, passage_aux = self._encode(model, passage_features)
            aux = _sum_aux([query_aux, passage_aux])
            out = self._loss(queries, passages, num_hard_negatives, passage_ids, positive_ids, in_batch_negatives)
            out = self._with_aux(out, aux, [_aux_mean(a) for a in aux.values()])
            if backward:
                out.loss.backward()
                return LossOutput(out.loss.detach(), out.components)
            return out
        return self._cached_step(model, query_features, passage_features, num_hard_negatives,
                                 passage_ids, backward, no_sync, positive_ids, in_batch_negatives)

    def _cached_step(
        self,
        model: Model,
        query_features: Features,
        passage_features: Features,
        k: int,
        passage_ids: Tensor | None,
        backward: bool,
        no_sync: ContextFactory | None,
        positive_ids: Tensor | None = None,
        in_batch_negatives: bool = True,
    ) -> LossOutput:
        assert self.chunk_size is not None
        query_chunks = _split_features(query_features, self.chunk_size)
        passage_chunks = _split_features(passage_features, self.chunk_size)

        # The RNG snapshot covers the devices of the inputs *and* of the model: features still on the CPU while
        # the model (which moves them) sits on a GPU would otherwise replay GPU dropout with other masks.
        anchors = _device_anchors(model)
        # Step 1: graph-free forward; the RNG snapshot must be taken right before each chunk.
        states: list[RandContext] = []
        reps: list[Tensor] = []
        chunk_aux: list[list[AuxLoss]] = []
        with torch.no_grad():
            for chunk in query_chunks + passage_chunks:
                states.append(RandContext(*_feature_tensors(chunk), *anchors))
                chunk_reps, aux_losses = self._encode(model, chunk)
                reps.append(chunk_reps)
                chunk_aux.append(aux_losses)
        num_query_chunks = len(query_chunks)
        query_reps = torch.cat(reps[:num_query_chunks]).detach().requires_grad_()
        passage_reps = torch.cat(reps[num_query_chunks:]).detach().requires_grad_()
        del reps
        # Aux losses: every chunk's total and count are known now, so the step's mean of each is a leaf
        # too; its gradient (weight x whatever the caller scales the loss with) / the step's count is the
        # factor of each chunk's total in the replay's surrogate.
        aux = _sum_aux(chunk_aux)
        aux_counts = [max(float(a.count), 1.0) for a in aux.values()]
        means = [_aux_mean(a) for a in aux.values()]
        dtype = reduce(torch.promote_types, (m.dtype for m in means), torch.float32)
        aux_means = torch.stack([m.to(dtype) for m in means]) if means else query_reps.new_zeros(0, dtype=dtype)
        aux_means = aux_means.detach().requires_grad_()
        del chunk_aux, means

        def replay(grad_queries: Tensor | None, grad_passages: Tensor | None, grad_aux: Tensor | None) -> None:
            # Step 3: re-run each chunk with a graph under its RNG snapshot, back-propagate the surrogate.
            grads = []
            for full_rows, grad in ((query_reps, grad_queries), (passage_reps, grad_passages)):
                grad = torch.zeros_like(full_rows) if grad is None else grad
                grads.extend(grad.split(self.chunk_size))
            aux_factor = {} if grad_aux is None else {
                name: grad_aux[i].detach() / count for i, (name, count) in enumerate(zip(aux, aux_counts))}
            chunks = query_chunks + passage_chunks
            for i, (chunk, state, grad) in enumerate(zip(chunks, states, grads)):
                # Under DDP only the last backward all-reduces the accumulated gradients.
                sync = nullcontext() if (no_sync is None or i == len(chunks) - 1) else no_sync()
                with sync:
                    # enable_grad: in deferred mode this runs inside autograd's backward (grad off).
                    with state, torch.enable_grad():
                        chunk_reps, aux_losses = self._encode(model, chunk)
                        surrogate = torch.dot(chunk_reps.flatten().to(grad.dtype), grad.flatten())
                        for a in aux_losses:
                            if a.name not in aux:
                                raise RuntimeError(f"aux loss {a.name!r} appeared in the replay of chunk {i} only")
                            if a.name in aux_factor:
                                surrogate = surrogate + _loss_precision(a.total) * aux_factor[a.name]
                        surrogate.backward()

        if backward:
            # Step 2 at the top level, then the replay (GradCache order; DDP-friendly).
            out = self._with_aux(self._loss(query_reps, passage_reps, k, passage_ids, positive_ids,
                                            in_batch_negatives), aux, list(aux_means.unbind()))
            out.loss.backward()
            replay(query_reps.grad, passage_reps.grad, aux_means.grad)
            return LossOutput(out.loss.detach(), out.components)
        # Deferred: the caller's backward reaches _ReplayOnBackward, which runs step 3 (scaled).
        queries, passages, means_out = _ReplayOnBackward.apply(replay, query_reps, passage_reps, aux_means)
        return self._with_aux(self._loss(queries, passages, k, passage_ids, positive_ids, in_batch_negatives),
                              aux, list(means_out.unbind()))
