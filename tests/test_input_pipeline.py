"""The training input pipeline: the Collator's tensors equal the reference collate's, the background thread and the
DataLoader workers hand over exactly those batches in step order, nothing touches the global RNGs, and the pipeline
ends cleanly when making a batch fails, when the training step fails and at the end; resume with prefetch equals an
uninterrupted synchronous run."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch

from robustir.data.training_data import TrainingExample
from robustir.training.data import Collator, Group, GroupSampler, StepBatches, collate
from robustir.training.input_pipeline import InputPipeline

pytestmark = pytest.mark.usefixtures("single_torch_thread")

#: (prefetch, workers): synchronous, one thread with a queue of 1 and of 2, DataLoader with 1 and 2 processes
MODES = [(0, 0), (1, 0), (2, 0), (2, 1), (3, 2)]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from robustir.models.encoder import Encoder

    return Encoder.from_pretrained(tiny_model_dir, query_max_length=16, passage_max_length=24)


def _examples(n: int = 14) -> list[TrainingExample]:
    examples = []
    for i in range(n):
        words = " ".join(f"w{j}" for j in range(3 * i))  # lengths from 1 token to past the max length
        negatives = [f"negative {i} about {words}", f"naïve café {i} 東京", ""] if i % 3 else []  # some have none
        positives = [f"positive {i}: {words}", "a passage shared by every query"][: 1 + i % 2]
        examples.append(TrainingExample(f"query {i} {words[: 5 * i]}", positives, negatives,
                                        prompt="Represent this question: " if i % 4 == 0 else None))
    return examples


def _assert_batches_equal(got, want) -> None:
    q, p, ids, positives = got
    rq, rp, rids, rpositives = want
    for mine, ref in ((q, rq), (p, rp)):
        assert list(mine) == list(ref)
        for key in ref:
            assert mine[key].dtype == ref[key].dtype and torch.equal(mine[key], ref[key]), key
    assert torch.equal(ids, rids) and torch.equal(positives, rpositives)


@pytest.mark.parametrize("instructions", [False, True])
def test_collator_equals_collate(encoder, instructions):
    """One fast-tokenizer call for the queries and one for the passages, written straight into padded arrays: the
    same tensors (keys, dtypes, values, padding to the longest in the batch) as the transformers tokenizer call."""
    if instructions:
        encoder.config.query_instruction, encoder.config.passage_instruction = "query: ", "passage: "
    try:
        sampler = GroupSampler(_examples(), 2, 7, 1, seed=5, epoch_unit="pairs")
        collator = Collator.for_encoder(encoder, 16, 24)
        assert collator.fast is not None  # the fast path is the one tested, not the fallback
        for step in range(3):
            groups = sampler.batch(step, 0)
            _assert_batches_equal(collator(groups), collate(groups, encoder, 16, 24))
    finally:
        encoder.config.query_instruction, encoder.config.passage_instruction = "", ""


def test_collator_pads_to_a_multiple_and_falls_back_when_it_cannot_mirror(encoder):
    groups = GroupSampler(_examples(), 1, 5, 1, seed=1).batch(0, 0)
    padded = Collator.for_encoder(encoder, 16, 24, pad_to_multiple_of=8)
    reference = Collator.for_encoder(encoder, 16, 24, pad_to_multiple_of=8, fast=False)
    assert padded.fast is not None and reference.fast is None
    q, p, _, _ = padded(groups)
    assert q["input_ids"].shape[1] % 8 == 0 and p["input_ids"].shape[1] % 8 == 0
    _assert_batches_equal(padded(groups), reference(groups))
    plain_q = Collator.for_encoder(encoder, 16, 24)(groups)[0]
    width = plain_q["input_ids"].shape[1]
    assert torch.equal(q["input_ids"][:, :width], plain_q["input_ids"]) and not q["attention_mask"][:, width:].any()
    # left padding is not what the fast path writes: the reference call on the collator's copy, same tensors
    left = encoder.tokenizer
    original = left.padding_side
    left.padding_side = "left"
    try:
        collator = Collator.for_encoder(encoder, 16, 24)
        assert collator.fast is None
        _assert_batches_equal(collator(groups), collate(groups, encoder, 16, 24))
        assert collator(groups)[0]["attention_mask"][:, 0].min() == 0  # padded on the left indeed
    finally:
        left.padding_side = original


@pytest.mark.parametrize("prefetch,workers", MODES)
def test_pipeline_batches_equal_collate_in_every_mode(encoder, prefetch, workers):
    """Two ranks, steps 1..9 (a resumed start, across two epoch boundaries): each step's batch is exactly the
    reference collate of that step's groups, whichever mode makes it."""
    sampler = GroupSampler(_examples(), 2, 3, 2, seed=11, epoch_unit="queries")  # 14 queries / 6 = 2 steps an epoch
    for rank in (0, 1):
        make = StepBatches(sampler, Collator.for_encoder(encoder, 16, 24), rank)
        with InputPipeline(make, prefetch=prefetch, workers=workers).start(1, 10) as pipeline:
            for step in range(1, 10):
                _assert_batches_equal(pipeline.get(step), collate(sampler.batch(step, rank), encoder, 16, 24))
        assert pipeline.closed and not pipeline.alive


@pytest.mark.parametrize("prefetch,workers", MODES)
def test_pipeline_leaves_the_global_generators_alone(prefetch, workers):
    """A DataLoader's base seed would come from torch's global generator and shift every later dropout mask (and
    differ between a resumed and an uninterrupted run): no mode may draw from a global generator."""
    torch.manual_seed(3)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with InputPipeline(_square, prefetch=prefetch, workers=workers).start(0, 4) as pipeline:
        assert [int(pipeline.get(s)) for s in range(4)] == [0, 1, 4, 9]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def _square(step: int) -> torch.Tensor:
    return torch.tensor(step * step)


def _fails_at_three(step: int) -> torch.Tensor:
    if step == 3:
        raise ValueError(f"bad record in step {step}")
    return torch.tensor(step)


@pytest.mark.parametrize("prefetch,workers", MODES)
def test_an_error_making_a_batch_reaches_its_step_and_the_pipeline_ends(prefetch, workers):
    pipeline = InputPipeline(_fails_at_three, prefetch=prefetch, workers=workers).start(0, 8)
    assert [int(pipeline.get(s)) for s in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad record in step 3"):
        pipeline.get(3)
    pipeline.close()
    assert not pipeline.alive
    pipeline.close()  # idempotent


def test_steps_must_be_asked_for_in_order():
    with InputPipeline(_square, prefetch=1).start(2, 5) as pipeline:
        with pytest.raises(RuntimeError, match="asked for step 3, the next one is 2"):
            pipeline.get(3)


def test_close_frees_a_producer_blocked_on_a_full_queue():
    """prefetch 1: after the step takes batch 0, the thread puts batch 1 and blocks putting batch 2. Closing must
    not hang, and the thread must end."""
    making_two = threading.Event()

    def make(step: int) -> int:
        if step == 2:
            making_two.set()
        return step

    pipeline = InputPipeline(make, prefetch=1).start(0, 100)
    assert pipeline.get(0) == 0
    assert making_two.wait(timeout=60)  # an event, not a sleep: set as soon as the thread reaches step 2
    pipeline.close()
    assert not pipeline.alive


# ---------------------------------------------------------------------------- in the training loop

def _loop(output, max_steps: int = 4):
    from robustir.training.loop import LoopConfig, TrainingLoop

    loop = TrainingLoop(LoopConfig(output=str(output), batch_size=2, max_steps=max_steps, lr=0.05, seed=1,
                                   logging_steps=2), config_file="loop_config.json")
    torch.manual_seed(0)
    loop.prepare(torch.nn.Linear(3, 1), max_steps)
    return loop


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("prefetch,workers", [(2, 0), (2, 1)])
def test_loop_hands_each_step_its_batch_logs_the_wait_and_closes(tmp_path, prefetch, workers):
    loop = _loop(tmp_path / "out")
    seen = []

    def step(index: int, batch: torch.Tensor) -> dict:
        assert torch.equal(batch, _inputs(index))
        seen.append(index)
        loss = loop.model(batch).pow(2).mean()
        loop.accelerator.backward(loss)
        return {"loss": loss}

    pipeline = InputPipeline(_inputs, prefetch=prefetch, workers=workers)
    result = loop.run(step, save_steps=10, desc="test", batches=pipeline)
    loop.finish()
    assert seen == [0, 1, 2, 3] and pipeline.closed and not pipeline.alive
    assert result.step_seconds > 0 and 0 <= result.data_wait_seconds <= result.step_seconds
    assert 0 <= result.data_wait_share <= 1
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]
    for record in log:
        assert record["data_wait_seconds"] >= 0 and 0 <= record["data_wait_share"] <= 1


@pytest.mark.parametrize("prefetch,workers", [(0, 0), (2, 0), (2, 1)])
def test_loop_closes_the_pipeline_when_the_step_raises(tmp_path, prefetch, workers):
    loop = _loop(tmp_path / "out", max_steps=50)

    def step(index: int, batch: torch.Tensor) -> dict:
        if index == 2:
            raise RuntimeError("out of memory, say")
        loss = loop.model(batch).pow(2).mean()
        loop.accelerator.backward(loss)
        return {"loss": loss}

    pipeline = InputPipeline(_inputs, prefetch=prefetch, workers=workers)
    with pytest.raises(RuntimeError, match="out of memory, say"):
        loop.run(step, save_steps=100, desc="test", batches=pipeline)
    assert pipeline.closed and not pipeline.alive
    assert not [t for t in threading.enumerate() if t.name == "robustir-input"]


# ---------------------------------------------------------------------------- fine-tuning end to end

def _write_train_file(path, n: int = 24):
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            handle.write(json.dumps({"query": f"what does report {i} say about topic {i % 5}",
                                     "pos": [f"report {i} explains topic {i % 5} with detail number {i * 13}"],
                                     "neg": [f"report {i + 1} is about something else {i}",
                                             f"unrelated text {i * 7}"]}) + "\n")
    return path


def _config(tiny_model_dir, data, output, **overrides):
    from robustir.training.arguments import TrainConfig

    values = dict(model=tiny_model_dir, train_data=str(data), output=str(output), batch_size=4, max_steps=4,
                  save_steps=2, passage_max_length=32, query_max_length=16, probe_size=8, lr=1e-3, loss="peg",
                  num_negatives=1, seed=7, chunk_size=3, report=False)
    values.update(overrides)
    return TrainConfig(**values)


def test_resume_with_prefetch_and_workers_equals_an_uninterrupted_synchronous_run(tiny_model_dir, tmp_path):
    """The same weights and losses whether the batches are made on the main thread (prefetch 0, the old path), by
    the background thread, or by DataLoader workers, and across a resume that changes the mode (operational)."""
    from safetensors.torch import load_file

    from robustir.training.trainer import train

    data = _write_train_file(tmp_path / "train.jsonl")
    full = train(_config(tiny_model_dir, data, tmp_path / "full", prefetch_batches=0))
    first = train(_config(tiny_model_dir, data, tmp_path / "resumed", prefetch_batches=2), stop_after=2)
    assert first.steps == 2 and 0 <= first.data_wait_share <= 1
    second = train(_config(tiny_model_dir, data, tmp_path / "resumed", prefetch_batches=2, dataloader_workers=1))
    assert second.steps == 4 and not [t for t in threading.enumerate() if t.name == "robustir-input"]
    a, b = load_file(str(full.model_path / "model.safetensors")), load_file(str(second.model_path / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    logs = [[json.loads(x) for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
            for name in ("full", "resumed")]
    assert [r["step"] for r in logs[1]] == [1, 2, 3, 4]
    for x, y in zip(*logs):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["t"] == pytest.approx(y["t"], abs=1e-6)
        assert {"data_wait_seconds", "data_wait_share"} <= set(y)


def test_training_that_raises_mid_epoch_leaves_no_input_thread(tiny_model_dir, tmp_path, monkeypatch):
    from robustir.training.batch_engine import BatchEngine
    from robustir.training.trainer import train

    calls = []
    real_step = BatchEngine.step

    def failing_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the engine failed mid-epoch")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "step", failing_step)
    data = _write_train_file(tmp_path / "train.jsonl")
    with pytest.raises(RuntimeError, match="failed mid-epoch"):
        train(_config(tiny_model_dir, data, tmp_path / "out", max_steps=6, prefetch_batches=1))
    assert len(calls) == 2
    assert not [t for t in threading.enumerate() if t.name == "robustir-input"]


def test_a_group_without_positives_list_still_collates(encoder):
    """Groups built by hand (bench, older callers) leave ``positives`` empty: width-1 rows of -1."""
    groups = [Group("q one", None, ["p one", "n one"]), Group("q two", None, ["p two", "n two"])]
    got = Collator.for_encoder(encoder, 16, 24)(groups)
    _assert_batches_equal(got, collate(groups, encoder, 16, 24))
    assert got[3].tolist() == [[-1], [-1]]



def test_rows_of_one_query_share_their_positives_in_the_batch(encoder):
    """Data with one positive per line: two rows of "q one" (positives "p a" and "p b") in one batch each know the
    other's positive, so neither trains against it as a negative (sentence-transformers keeps such rows apart with
    its NO_DUPLICATES sampler). Another prompt or query keeps its own."""
    from robustir.training.data import text_id

    groups = [Group("q one", None, ["p a", "n 1"], ("p a",)), Group("q two", None, ["p c", "n 2"], ("p c",)),
              Group("q one", None, ["p b", "n 3"], ("p b",)), Group("q one", "other: ", ["p d", "n 4"], ("p d",))]
    for made in (Collator.for_encoder(encoder, 16, 24)(groups), collate(groups, encoder, 16, 24)):
        known = [{text_id(t) for t in row} for row in ([["p a", "p b"], ["p c"], ["p a", "p b"], ["p d"]])]
        assert [set(row) - {-1} for row in made[3].tolist()] == known

def test_pipeline_settings_have_ranges_and_are_checked():
    from robustir.errors import ConfigError
    from robustir.training.arguments import TrainConfig

    config = TrainConfig()
    assert (config.prefetch_batches, config.dataloader_workers, config.pad_to_multiple_of) == (2, 0, None)
    for bad in ({"prefetch_batches": -1}, {"dataloader_workers": 65}, {"pad_to_multiple_of": 0}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} = .* is out of range"):
            TrainConfig(**bad)
    with pytest.raises(ConfigError, match="needs prefetch_batches >= 1"):
        TrainConfig(prefetch_batches=0, dataloader_workers=2).validate()
