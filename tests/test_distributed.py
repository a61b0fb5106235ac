"""Two gloo processes on CPU give the same loss, gradients and PEG state as one process on the whole batch.

Each rank holds half of the queries (and their passage groups). Gradient scaling: every rank's loss
is the mean over its own rows; gather_with_grad sums the cross-rank gradients; averaging parameter
gradients over ranks (done by hand with all_reduce / W, or by DistributedDataParallel) then gives
the gradient of the global mean loss, which is what the single process computes.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from robustir.losses import get_loss
from robustir.training import distributed
from robustir.training.batch_engine import BatchEngine
from robustir.training.memory import PassageMemory

from helpers import gloo_process, multiprocess_engine_step  # tests/ is on sys.path

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
    gloo_process(rank, WORLD, init_file, os.path.join(out_dir, f"rank{rank}.pt"), _rank_results)


def _rank_results(rank: int) -> dict[str, object]:
    results: dict[str, object] = {"world_size": distributed.world_size(), "rank": distributed.rank()}
    queries, passages, ids = shard(rank)
    for loss_name in LOSS_NAMES:
        for label, chunk_size, use_ddp, backward in MODES:
            model = make_model()
            loss = get_loss(loss_name)
            engine = BatchEngine(loss, chunk_size=chunk_size)
            # DDP averages the grads (no_sync defaults to ddp.no_sync); by hand: all-reduced and averaged
            out, value = multiprocess_engine_step(model, engine, queries, passages, use_ddp, WORLD, K,
                                                  backward=backward, find_unused_parameters=False, passage_ids=ids)
            results[f"{loss_name}/{label}"] = {
                "loss": value,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "t": loss.t.clone() if loss_name == "peg" else None,
            }

    # a cross-batch memory holds the global columns: a step that fills it (other ids), then a step that reads it
    for label, chunk_size, use_ddp, backward in MODES[:2]:
        model, memory = make_model(), PassageMemory(40, 8)
        engine = BatchEngine(get_loss("infonce"), chunk_size=chunk_size, memory=memory)
        multiprocess_engine_step(model, engine, queries, passages, use_ddp, WORLD, K, passage_ids=ids + 1000)
        model.zero_grad()
        out, value = multiprocess_engine_step(model, engine, queries, passages, use_ddp, WORLD, K, passage_ids=ids)
        results[f"memory/{label}"] = {"loss": value, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                                      "memory": memory.state_dict(), "columns": out.components["memory_columns"]}

    # helpers: unequal rows are refused on every rank; global_mean weighs every value equally
    try:
        distributed.gather_with_grad(torch.zeros(rank + 1, 2, requires_grad=True))
        results["unequal_error"] = None
    except ValueError as err:
        results["unequal_error"] = str(err)
    results["global_mean"] = distributed.global_mean(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([6.0]))
    return results


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


@pytest.mark.parametrize("mode", [m[0] for m in MODES[:2]])
def test_two_processes_with_a_memory_match_one(rank_results: list[dict], mode: str) -> None:
    """Every rank stores the global columns, so the memory (and the step that reads it) equals one process's."""
    queries, passages, ids = global_batch()
    model, memory = make_model(), PassageMemory(40, 8)
    engine = BatchEngine(get_loss("infonce"), memory=memory)
    engine.step(model, queries, passages, K, passage_ids=ids + 1000)
    model.zero_grad()
    out = engine.step(model, queries, passages, K, passage_ids=ids)
    assert out.components["memory_columns"] == WORLD * B_PER_RANK * (1 + K)
    for result in rank_results:
        got = result[f"memory/{mode}"]
        assert got["columns"] == out.components["memory_columns"]
        for name, tensor in memory.state_dict().items():
            assert torch.allclose(got["memory"][name].double(), tensor.double(), atol=1e-6), name
        assert torch.allclose(got["loss"], out.loss.double(), atol=1e-5)
        for name, parameter in model.named_parameters():
            scale = float(parameter.grad.abs().max())
            assert torch.allclose(got["grads"][name], parameter.grad, atol=1e-5 * scale, rtol=0), name


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


# ---------------------------------------------------------------------------------- GUR pre-training steps

GUR_PAIRS_PER_RANK = 3
GUR_OPTIONS = {"alpha": 0.7, "mlm_weight": 1.3, "projection": True, "projection_dim": 8, "pooling": "mean"}
# (label, chunk_size, wrap the model in DistributedDataParallel as pre-training does)
GUR_MODES = (("plain", None, False), ("plain_ddp", None, True), ("cached_ddp", 2, True))


def gur_model(model_dir: str):
    """The tiny BERT as a GUR model in float64, dropout off (ranks cannot share one dropout stream)."""
    import transformers

    from robustir.pretraining.gur import GURModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return GURModel.from_pretrained(model_dir, **GUR_OPTIONS).double().eval()


def gur_global_batch(model_dir: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """a-rows and b-rows of WORLD * GUR_PAIRS_PER_RANK span-masked pairs (the same on every process)."""
    from transformers import AutoTokenizer

    from robustir.pretraining.masking import SpanMasker
    from robustir.pretraining.gur import GURCollator

    words = "cat dog river model retrieval dense passage query vector spring flood garden mouse".split()
    g = torch.Generator().manual_seed(3)
    pairs = [tuple(" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=g))
                   for n in torch.randint(3, 9, (2,), generator=g))
             for _ in range(WORLD * GUR_PAIRS_PER_RANK)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = GURCollator(tokenizer, max_length=16, masker=SpanMasker(mask_ratio=0.3), seed=0)(pairs)
    return {k: v[0::2] for k, v in batch.items()}, {k: v[1::2] for k, v in batch.items()}


def gur_shard(features: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    rows = slice(rank * GUR_PAIRS_PER_RANK, (rank + 1) * GUR_PAIRS_PER_RANK)
    return {k: v[rows] for k, v in features.items()}


def _gur_worker(rank: int, init_file: str, out_dir: str, model_dir: str) -> None:
    gloo_process(rank, WORLD, init_file, os.path.join(out_dir, f"gur-rank{rank}.pt"),
                 functools.partial(_gur_rank_results, model_dir=model_dir))


def _gur_rank_results(rank: int, model_dir: str) -> dict[str, object]:
    a_rows, b_rows = (gur_shard(f, rank) for f in gur_global_batch(model_dir))
    results: dict[str, object] = {}
    for label, chunk_size, use_ddp in GUR_MODES:
        model = gur_model(model_dir)
        engine = BatchEngine(model.contrastive_loss(), chunk_size=chunk_size, loss_weight=model.alpha)
        out, loss = multiprocess_engine_step(model, engine, a_rows, b_rows, use_ddp, WORLD)
        results[label] = {"loss": loss, "mlm_loss": out.components["mlm_loss"],
                          "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return results


@pytest.fixture(scope="module")
def gur_rank_results(tmp_path_factory, tiny_model_dir) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist-gur")
    mp.spawn(_gur_worker, args=(str(tmp / "init"), str(tmp), tiny_model_dir), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"gur-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def gur_reference(model_dir: str) -> tuple[Tensor, list[float], dict[str, Tensor]]:
    """One process, by hand: the symmetric InfoNCE over the vectors of *all* pairs (gathered negatives), plus each
    process's own MLM mean averaged over the processes (the aux loss stays local)."""
    from robustir.losses import ContrastiveBatch

    model = gur_model(model_dir)
    a_rows, b_rows = gur_global_batch(model_dir)
    vectors_a, vectors_b, mlm_means = [], [], []
    for rank in range(WORLD):
        va, total_a, count_a = model.encode_with_mlm(**gur_shard(a_rows, rank))
        vb, total_b, count_b = model.encode_with_mlm(**gur_shard(b_rows, rank))
        vectors_a.append(va)
        vectors_b.append(vb)
        mlm_means.append((total_a + total_b) / (count_a + count_b))
    contrastive = model.contrastive_loss()(ContrastiveBatch.from_groups(torch.cat(vectors_a), torch.cat(vectors_b)))
    loss = model.alpha * contrastive.loss + model.mlm_weight * torch.stack(mlm_means).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), [float(m.detach()) for m in mlm_means], grads


@pytest.mark.parametrize("mode", [m[0] for m in GUR_MODES])
def test_gur_two_processes_gather_negatives(gur_rank_results: list[dict], tiny_model_dir: str, mode: str) -> None:
    """GUR's contrastive term sees the pairs of both processes; its MLM aux loss is each process's own mean."""
    ref_loss, ref_mlm, ref_grads = gur_reference(tiny_model_dir)
    assert ref_mlm[0] != pytest.approx(ref_mlm[1])  # per-process MLM means differ: the test tells local from global
    for rank, result in enumerate(gur_rank_results):
        got = result[mode]
        assert torch.allclose(got["loss"], ref_loss, atol=1e-5), (got["loss"], ref_loss)
        assert got["mlm_loss"] == pytest.approx(ref_mlm[rank], rel=1e-6)
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            # + 1e-12: attention key biases get an exactly-zero gradient in theory (float noise ~1e-21 here)
            scale = float(grad.abs().max())
            assert torch.allclose(got["grads"][name], grad, atol=1e-5 * scale + 1e-12, rtol=0), name


def test_gur_local_negatives_would_differ(tiny_model_dir: str) -> None:
    """Guard: without the gather (each process's pairs only) the contrastive loss is clearly different."""
    from robustir.losses import ContrastiveBatch

    model = gur_model(tiny_model_dir)
    a_rows, b_rows = gur_global_batch(tiny_model_dir)
    with torch.no_grad():
        va, vb = model.encode_with_mlm(**a_rows)[0], model.encode_with_mlm(**b_rows)[0]
        loss = model.contrastive_loss()
        global_loss = float(loss(ContrastiveBatch.from_groups(va, vb)).loss)
        n = GUR_PAIRS_PER_RANK
        local = sum(float(loss(ContrastiveBatch.from_groups(va[r * n:(r + 1) * n], vb[r * n:(r + 1) * n])).loss)
                    for r in range(WORLD)) / WORLD
    assert abs(global_loss - local) > 1e-3


# ---------------------------------------------------------------------------------- memory-bounded losses

BLOCKED_LOSSES = {"infonce": {}, "infonce_symmetric": {"symmetric": True}, "peg": {}, "ccr": {},
                  "ccr_authors_code": {"variant": "authors_code", "temperature": 1.0, "beta": 0.1}}
# (label, chunk_size, wrap the model in DistributedDataParallel, backward inside step)
BLOCKED_MODES = (("plain", None, False, True), ("cached_ddp_deferred", 4, True, False))
BLOCK_SIZES = (None, 1, 2)  # None: whole local batch; 2 does not divide B_PER_RANK = 3


def blocked_loss(name: str):
    return get_loss(name.split("_")[0], **BLOCKED_LOSSES[name])


def _blocked_worker(rank: int, init_file: str, out_dir: str) -> None:
    gloo_process(rank, WORLD, init_file, os.path.join(out_dir, f"blocked-rank{rank}.pt"), _blocked_rank_results)


def _blocked_rank_results(rank: int) -> dict[str, object]:
    results: dict[str, object] = {}
    queries, passages, ids = shard(rank)
    for name in BLOCKED_LOSSES:
        for label, chunk_size, use_ddp, backward in BLOCKED_MODES:
            for block_rows in BLOCK_SIZES:
                model = make_model()
                loss = blocked_loss(name)
                engine = BatchEngine(loss, chunk_size=chunk_size, block_rows=block_rows)
                out, value = multiprocess_engine_step(model, engine, queries, passages, use_ddp, WORLD, K,
                                                      backward=backward, find_unused_parameters=False,
                                                      passage_ids=ids)
                results[f"{name}/{label}/{block_rows}"] = {
                    "loss": value,
                    "components": dict(out.components),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "t": loss.t.clone() if name == "peg" else None,
                }
    return results


@pytest.fixture(scope="module")
def blocked_rank_results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist-blocked")
    mp.spawn(_blocked_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"blocked-rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mode", [m[0] for m in BLOCKED_MODES])
@pytest.mark.parametrize("name", list(BLOCKED_LOSSES))
def test_blocked_losses_with_the_gather_match_unblocked_and_one_process(
        blocked_rank_results: list[dict], name: str, mode: str) -> None:
    """Blocks of local rows against the gathered columns (duplicate mask across ranks included): the same loss,
    gradients, logged statistics and PEG state as the whole local batch, and as one process on the global batch."""
    queries, passages, ids = global_batch()
    reference_model, reference_loss = make_model(), blocked_loss(name)
    reference = BatchEngine(reference_loss).step(reference_model, queries, passages, K, passage_ids=ids)
    ref_grads = {n: p.grad for n, p in reference_model.named_parameters()}
    for result in blocked_rank_results:
        whole = result[f"{name}/{mode}/None"]
        for block_rows in BLOCK_SIZES[1:]:
            got = result[f"{name}/{mode}/{block_rows}"]
            assert torch.allclose(got["loss"], whole["loss"], atol=1e-6, rtol=1e-6)
            assert torch.allclose(got["loss"], reference.loss.double(), atol=1e-5)
            for grad_name, grad in whole["grads"].items():
                scale = float(grad.abs().max())
                assert torch.allclose(got["grads"][grad_name], grad, atol=1e-6 * scale, rtol=0), grad_name
                scale = float(ref_grads[grad_name].abs().max())
                assert torch.allclose(got["grads"][grad_name], ref_grads[grad_name], atol=1e-5 * scale, rtol=0)
            assert got["components"].keys() == whole["components"].keys()
            for key, value in whole["components"].items():
                assert got["components"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
            if name == "peg":
                assert torch.equal(got["t"], whole["t"]) and float(got["t"]) != 0.0
                assert torch.allclose(got["t"], reference_loss.t, atol=1e-6)
