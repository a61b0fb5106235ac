"""Cross-batch memory (XBM): the store, the engine's columns and masks, GradCache, the trainer's checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from robustir.losses import get_loss
from robustir.training.batch_engine import BatchEngine
from robustir.training.memory import PassageMemory
from robustir.training.trainer import train
from test_batch_engine import DotLoss, TinyEncoder, make_batch
from test_training import small_config, weights, write_train_file


def test_memory_is_first_in_first_out_and_keeps_the_last_size_passages() -> None:
    memory = PassageMemory(5, 2)
    assert len(memory) == 0 and memory.read()[0].shape == (0, 2)
    memory.push(torch.arange(6.0).view(3, 2), torch.tensor([10, 11, 12]))
    assert len(memory) == 3 and memory.read()[1].tolist() == [10, 11, 12]
    memory.push(torch.arange(8.0).view(4, 2) + 100, torch.tensor([13, 14, 15, 16]))
    embeddings, ids = memory.read()
    assert len(memory) == 5 and sorted(ids.tolist()) == [12, 13, 14, 15, 16]  # 10 and 11, the oldest, went out
    assert embeddings[ids.tolist().index(16)].tolist() == [106.0, 107.0]
    memory.push(torch.zeros(7, 2), torch.arange(20, 27))  # more than it holds: the last 5
    assert sorted(memory.read()[1].tolist()) == [22, 23, 24, 25, 26]
    with pytest.raises(ValueError, match="width 2"):
        memory.push(torch.zeros(1, 3), torch.tensor([1]))
    with pytest.raises(ValueError, match="one id per embedding"):
        memory.push(torch.zeros(2, 2), torch.tensor([1]))


def test_memory_state_dict_restores_it_exactly() -> None:
    memory = PassageMemory(4, 3)
    memory.push(torch.randn(6, 3), torch.arange(6))
    restored = PassageMemory(4, 3)
    restored.load_state_dict(memory.state_dict())
    assert len(restored) == 4 and torch.equal(restored.read()[0], memory.read()[0])
    restored.push(torch.ones(1, 3), torch.tensor([99]))  # and it continues where the first one would
    memory.push(torch.ones(1, 3), torch.tensor([99]))
    assert torch.equal(restored.read()[1], memory.read()[1])


def test_engine_appends_earlier_steps_as_masked_constant_columns() -> None:
    b, k = 4, 1
    queries, passages, ids = make_batch(b, k)
    model = TinyEncoder()
    memory = PassageMemory(16, 12)
    engine = BatchEngine(DotLoss(), memory=memory)
    first = engine.step(model, queries, passages, k, passage_ids=ids)
    assert len(memory) == b * (1 + k) and first.components["memory_columns"] == 0.0
    stored, stored_ids = memory.read()
    assert not stored.requires_grad and torch.equal(stored_ids.sort().values, ids.sort().values)

    # the next step: the same queries come back (a second epoch); the memory holds their positives
    q = torch.randn(b, 12)
    p = torch.randn(b * (1 + k), 12)
    batch = engine.build_batch(q, p, k, ids)
    assert batch.memory_columns == b * (1 + k) and batch.passages.shape[0] == 2 * b * (1 + k)
    assert torch.equal(batch.passages[b * (1 + k):], stored)
    mask = batch.candidate_mask
    own = ids.view(b, 1 + k)[:, 0]
    for i in range(b):
        for j, column_id in enumerate(batch.column_ids.tolist()):
            expected = j == batch.positive_index[i] or column_id != own[i]
            assert bool(mask[i, j]) == expected, (i, j)  # the stored copy of row i's positive is no negative

    # a known positive of the row's query in the memory is masked too
    other_positive = int(stored_ids[(stored_ids != own[0]).nonzero()[0]])
    positive_ids = torch.full((b, 1), -1)
    positive_ids[0, 0] = other_positive
    masked = engine.build_batch(q, p, k, ids, positive_ids).candidate_mask
    memory_columns = masked[0, b * (1 + k):]
    assert not bool(memory_columns[stored_ids == other_positive].any())


def test_memory_loss_is_infonce_over_the_stored_columns_and_sends_no_gradient_into_them() -> None:
    b, k, d = 3, 1, 8
    torch.manual_seed(0)
    loss = get_loss("infonce", temperature=0.05)
    memory = PassageMemory(10, d)
    stored = torch.randn(6, d)
    memory.push(stored, torch.arange(100, 106))  # ids no row knows
    engine = BatchEngine(loss, memory=memory)
    q = torch.randn(b, d, requires_grad=True)
    p = torch.randn(b * (1 + k), d, requires_grad=True)
    ids = torch.arange(b * (1 + k))
    out = engine._loss(q, p, k, ids)
    groups = p.view(b, 1 + k, d)
    columns = torch.cat([groups[:, 0], groups[:, 1:].reshape(-1, d), stored])
    logits = F.normalize(q, dim=-1) @ F.normalize(columns, dim=-1).T / 0.05
    reference = F.cross_entropy(logits, torch.arange(b))
    torch.testing.assert_close(out.loss, reference)
    out.loss.backward()
    assert q.grad is not None and memory.embeddings.grad is None
    # the step's own columns went in after the loss read the old ones: 6 + 6 = 10 kept, ids 0..5 among them
    assert len(memory) == 10 and set(range(b * (1 + k))) <= set(memory.read()[1].tolist())


@pytest.mark.parametrize("loss_name", ["infonce", "peg"])
def test_gradcache_with_a_memory_equals_the_plain_step(loss_name: str) -> None:
    b, k = 6, 1
    queries, passages, ids = make_batch(b, k)
    grads, losses = [], []
    for chunk_size in (None, 4):
        torch.manual_seed(3)
        model = TinyEncoder(dropout=0.0)
        memory = PassageMemory(20, 12)
        engine = BatchEngine(get_loss(loss_name), chunk_size=chunk_size, memory=memory)
        engine.step(model, queries, passages, k, passage_ids=ids + 1000)  # fill it (other ids)
        model.zero_grad()
        out = engine.step(model, queries, passages, k, passage_ids=ids)
        assert out.components["memory_columns"] == b * (1 + k)
        losses.append(float(out.loss))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for plain, cached in zip(*grads):
        torch.testing.assert_close(plain, cached, rtol=1e-4, atol=1e-6)


def test_memory_needs_ids_and_the_duplicate_mask_and_skips_own_columns_only_sources() -> None:
    b, k = 2, 1
    with pytest.raises(ValueError, match="mask_duplicate_positives"):
        BatchEngine(DotLoss(), mask_duplicate_positives=False, memory=PassageMemory(4, 3))
    engine = BatchEngine(DotLoss(), memory=PassageMemory(4, 3))
    with pytest.raises(ValueError, match="passage_ids"):
        engine.build_batch(torch.randn(b, 3), torch.randn(b * (1 + k), 3), k)
    engine.memory.push(torch.randn(2, 3), torch.tensor([50, 51]))
    batch = engine.build_batch(torch.randn(b, 3), torch.randn(b * (1 + k), 3), k, torch.arange(4),
                               in_batch_negatives=False)
    assert batch.memory_columns == 0 and batch.passages.shape[0] == b * (1 + k)
    engine._loss(torch.randn(b, 3), torch.randn(b * (1 + k), 3), k, torch.arange(4), in_batch_negatives=False)
    assert sorted(engine.memory.read()[1].tolist()) == [50, 51]  # such a step does not fill it either


def test_resume_with_a_memory_equals_uninterrupted(tiny_model_dir, tmp_path):
    """The memory is checkpointed: without it the resumed steps would see an empty memory and train otherwise."""
    data = write_train_file(tmp_path / "train.jsonl")
    settings = dict(loss="infonce", memory_size=12, max_steps=4, save_steps=2)
    full = train(small_config(tiny_model_dir, data, tmp_path / "full", **settings))
    train(small_config(tiny_model_dir, data, tmp_path / "resumed", **settings), stop_after=2)
    second = train(small_config(tiny_model_dir, data, tmp_path / "resumed", **settings))
    a, b = weights(full.model_path), weights(second.model_path)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    log = [json.loads(x) for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    # batch 4 x (1 positive + 1 negative) = 8 columns a step, 12 kept
    assert [row["memory_columns"] for row in log] == [0.0, 8.0, 12.0, 12.0]
    card = (full.model_path / "README.md").read_text(encoding="utf-8")
    assert "a cross-batch memory of 12 passages" in card
    # the memory changes the training: the same run without it ends elsewhere
    without = train(small_config(tiny_model_dir, data, tmp_path / "without", **{**settings, "memory_size": 0}))
    c = weights(without.model_path)
    assert any(not torch.equal(a[key], c[key]) for key in a)
