"""Two gloo processes on CPU give the same loss, gradients and PEG state as one process on the whole batch.

Each rank holds half of the queries (and their passage groups). Gradient scaling: every rank's loss
is the mean over its own rows; gather_with_grad sums the cross-rank gradients; averaging parameter
gradients over ranks (done by hand with all_reduce / W, or by DistributedDataParallel) then gives
the gradient of the global mean loss, which is what the single process computes.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from robustir.losses import get_loss
from robustir.training import distributed
from robustir.training.batch_engine import BatchEngine

WORLD = 2
B_PER_RANK, K = 3, 2
LOSS_NAMES = ("infonce", "peg", "ccr")
# (label, chunk_size, wrap the model in DistributedDataParallel, backward inside step)
MODES = (("plain", None, False, True), ("cached", 2, False, True), ("cached_ddp", 4, True, True),
         ("cached_ddp_deferred", 4, True, False))


class Encoder(nn.Module):
    """Embedding + masked mean pooling + linear, no dropout (ranks cannot share one dropout stream)."""

    def __init__(self, vocab: int = 30, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        mask = features["attention_mask"].unsqueeze(-1).to(self.embed.weight.dtype)
        return self.proj((self.embed(features["input_ids"]) * mask).sum(1) / mask.sum(1).clamp_min(1.0))


def make_model() -> Encoder:
    torch.manual_seed(0)
    return Encoder().double()


def global_batch() -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """The whole batch: WORLD * B_PER_RANK queries, passages grouped per query, one id per passage."""
    b, seq = WORLD * B_PER_RANK, 5
    g = torch.Generator().manual_seed(7)

    def features(n: int) -> dict[str, Tensor]:
        ids = torch.randint(1, 30, (n, seq), generator=g)
        mask = (torch.arange(seq) < torch.randint(1, seq + 1, (n, 1), generator=g)).long()
        return {"input_ids": ids * mask, "attention_mask": mask}

    queries, passages = features(b), features(b * (1 + K))
    ids = torch.arange(b * (1 + K), dtype=torch.int64)
    # query 4 (rank 1) has the same positive as query 0 (rank 0): a cross-rank duplicate to mask
    for key in passages:
        passages[key][4 * (1 + K)] = passages[key][0]
    ids[4 * (1 + K)] = ids[0]
    return queries, passages, ids


def shard(rank: int) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    queries, passages, ids = global_batch()
    q = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
    p = slice(rank * B_PER_RANK * (1 + K), (rank + 1) * B_PER_RANK * (1 + K))
    return {k: v[q] for k, v in queries.items()}, {k: v[p] for k, v in passages.items()}, ids[p]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results: dict[str, object] = {"world_size": distributed.world_size(), "rank": distributed.rank()}
        queries, passages, ids = shard(rank)
        for loss_name in LOSS_NAMES:
            for label, chunk_size, use_ddp, backward in MODES:
                model = make_model()
                loss = get_loss(loss_name)
                engine = BatchEngine(loss, chunk_size=chunk_size)
                if use_ddp:  # DDP averages the grads; no_sync defaults to ddp.no_sync
                    ddp = nn.parallel.DistributedDataParallel(model)
                    out = engine.step(ddp, queries, passages, K, passage_ids=ids, backward=backward)
                    if not backward:
                        out.loss.backward()  # runs the replay from inside autograd
                else:
                    out = engine.step(model, queries, passages, K, passage_ids=ids)
                    for p in model.parameters():  # what DDP would do: average over ranks
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                        p.grad /= WORLD
                value = out.loss.detach().clone().double()
                dist.all_reduce(value, op=dist.ReduceOp.SUM)
                results[f"{loss_name}/{label}"] = {
                    "loss": value / WORLD,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "t": loss.t.clone() if loss_name == "peg" else None,
                }

        # helpers: unequal rows are refused on every rank; global_mean weighs every value equally
        try:
            distributed.gather_with_grad(torch.zeros(rank + 1, 2, requires_grad=True))
            results["unequal_error"] = None
        except ValueError as err:
            results["unequal_error"] = str(err)
        results["global_mean"] = distributed.global_mean(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([6.0]))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def single_process(loss_name: str) -> tuple[Tensor, dict[str, Tensor], Tensor | None]:
    queries, passages, ids = global_batch()
    model, loss = make_model(), get_loss(loss_name)
    out = BatchEngine(loss).step(model, queries, passages, K, passage_ids=ids)
    t = loss.t.clone() if loss_name == "peg" else None
    return out.loss.double(), {n: p.grad.clone() for n, p in model.named_parameters()}, t


def test_ranks_see_the_process_group(rank_results: list[dict]) -> None:
    assert [r["rank"] for r in rank_results] == [0, 1]
    assert all(r["world_size"] == WORLD for r in rank_results)


@pytest.mark.parametrize("mode", [m[0] for m in MODES])
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_two_processes_match_one(rank_results: list[dict], loss_name: str, mode: str) -> None:
    ref_loss, ref_grads, ref_t = single_process(loss_name)
    for result in rank_results:
        got = result[f"{loss_name}/{mode}"]
        # the losses score in float32 (robustir.losses.base.cosine_scores) and the two runs multiply
        # matrices of different shapes, so agreement is to float32 precision, relative to the scale
        assert torch.allclose(got["loss"], ref_loss, atol=1e-5), (got["loss"], ref_loss)
        for name, grad in ref_grads.items():
            scale = float(grad.abs().max())
            assert torch.allclose(got["grads"][name], grad, atol=1e-5 * scale, rtol=0), name
        if loss_name == "peg":
            assert torch.allclose(got["t"], ref_t, atol=1e-6) and float(ref_t) != 0.0
    if loss_name == "peg":
        assert torch.equal(rank_results[0][f"peg/{mode}"]["t"], rank_results[1][f"peg/{mode}"]["t"])


def test_duplicate_positive_masked_across_ranks() -> None:
    """Guard: the cross-rank duplicate really changes the loss, so the test above checks the mask too."""
    queries, passages, ids = global_batch()
    masked = BatchEngine(get_loss("infonce")).step(make_model(), queries, passages, K, passage_ids=ids)
    unmasked = BatchEngine(get_loss("infonce")).step(make_model(), queries, passages, K)
    assert abs(float(masked.loss) - float(unmasked.loss)) > 1e-6  # well above the 1e-5 * |grad| test tolerance
    assert masked.components["neg_sim"] != pytest.approx(unmasked.components["neg_sim"])


def test_unequal_rows_raise_on_every_rank(rank_results: list[dict]) -> None:
    for result in rank_results:
        assert result["unequal_error"] is not None and "same number of rows" in result["unequal_error"]


def test_global_mean_over_processes(rank_results: list[dict]) -> None:
    for result in rank_results:
        assert float(result["global_mean"]) == pytest.approx(3.0)  # (1 + 2 + 6) / 3, not (1.5 + 6) / 2
