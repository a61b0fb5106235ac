"""Multi-source training mixtures: step -> source by weight (seeded), homogeneous batches, per-source instructions,
symmetric pairs, per-source in_batch_negatives, per-source loss in the log and the report, resume, bad configs."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from robustir.config import load_config
from robustir.data.arrow_store import TrainingRows
from robustir.data.training_data import TrainingExample
from robustir.errors import ConfigError
from robustir.training.arguments import TrainConfig
from robustir.training.data import GroupSampler, SamplerSource, collate

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def source(name: str, n: int, negatives: int = 1, **options) -> SamplerSource:
    examples = [TrainingExample(f"{name} query {i}", [f"{name} passage {i}"],
                                [f"{name} negative {i} {j}" for j in range(negatives)]) for i in range(n)]
    return SamplerSource(TrainingRows.from_examples(examples), name=name, **options)


def source_of(group) -> str:
    return group.query.split(" ")[0]


# ---------------------------------------------------------------------------- step -> source

def test_step_sources_follow_the_weights_and_the_seed():
    sources = [source("a", 40, weight=1.0), source("b", 40, weight=2.0), source("c", 40, weight=5.0)]
    sampler = GroupSampler(sources, 1, 4, 1, seed=5, epoch_unit="queries")
    steps = 8192
    drawn = [sampler.assign(step)[0] for step in range(steps)]
    counts = np.bincount(drawn, minlength=3)
    expected = np.array([1, 2, 5]) / 8 * steps
    sd = np.sqrt(expected * (1 - np.array([1, 2, 5]) / 8))
    assert np.all(np.abs(counts - expected) < 4 * sd), (counts, expected)
    again = GroupSampler(sources, 1, 4, 1, seed=5, epoch_unit="queries")
    assert [again.assign(step)[0] for step in reversed(range(steps))] == drawn[::-1]  # any order, same answer
    other = GroupSampler(sources, 1, 4, 1, seed=6, epoch_unit="queries")
    assert [other.assign(step)[0] for step in range(steps)] != drawn
    # each source walks through its own epochs: its k-th batch is position k, nothing skipped or repeated
    for s in range(3):
        positions = [sampler.assign(step)[1] for step in range(steps) if drawn[step] == s]
        assert positions == list(range(len(positions)))


def test_without_weights_shares_follow_the_sizes():
    sampler = GroupSampler([source("small", 40), source("large", 120)], 1, 4, 1, seed=0, epoch_unit="queries")
    assert sampler.shares.tolist() == pytest.approx([0.25, 0.75])
    assert sampler.steps_per_epoch == 10 + 30  # one pass over every source
    share = np.mean([sampler.assign(step)[0] for step in range(8000)])
    assert share == pytest.approx(0.75, abs=0.02)


def test_every_global_batch_comes_from_one_source_and_covers_it():
    sources = [source("a", 24, weight=1.0), source("b", 16, weight=1.0)]
    sampler = GroupSampler(sources, 1, 4, 2, seed=3, epoch_unit="queries")
    seen: dict[str, Counter] = {"a": Counter(), "b": Counter()}
    for step in range(60):
        groups = sampler.batch(step, 0) + sampler.batch(step, 1)
        names = {source_of(g) for g in groups}
        assert names == {sampler.source_of(step).name}  # homogeneous, on both processes
        for g in groups:  # a group's negatives come from its own source too
            assert {source_of(g)} == {p.split(" ")[0] for p in g.passages}
        seen[names.pop()].update(g.query for g in groups)
    # 3 steps per epoch of a (24 / 8) and 2 of b: each source's items appear equally often (whole epochs)
    for name, counts in seen.items():
        full_epochs = min(counts.values())
        assert max(counts.values()) - full_epochs <= 1 and len(counts) == {"a": 24, "b": 16}[name]
    # a DataLoader worker gets a copy that gives the same batches (caches and the lock are rebuilt there)
    copy = pickle.loads(pickle.dumps(sampler))
    assert [copy.batch(step, 1) for step in (59, 3)] == [sampler.batch(step, 1) for step in (59, 3)]


# ---------------------------------------------------------------------------- per-source options

def test_per_source_instructions_reach_the_tokenizer(tiny_model_dir):
    from robustir.models.encoder import Encoder
    from robustir.training.data import Collator

    encoder = Encoder.from_pretrained(tiny_model_dir, query_max_length=16, passage_max_length=16,
                                      query_instruction="modelquery ", passage_instruction="modelpassage ")
    own = source("own", 8, query_instruction="ownquery ", passage_instruction="ownpassage ")
    default = source("default", 8)  # retrieval: the model's instructions
    symmetric = source("sym", 8, task="symmetric")  # none unless the source gives one
    title = source("title", 8, task="title", query_instruction="titlequery ")
    prompted = TrainingRows.from_examples([TrainingExample(f"rec query {i}", [f"rec passage {i}"], [f"rec n {i}"],
                                                           prompt="recordprompt ") for i in range(8)])
    record = SamplerSource(prompted, name="rec", query_instruction="ignored ")  # a record's own prompt wins
    expected = {"own": ("ownquery", "ownpassage"), "default": ("modelquery", "modelpassage"), "sym": ("", ""),
                "title": ("titlequery", ""), "rec": ("recordprompt", "modelpassage")}
    decode = encoder.tokenizer.batch_decode
    for spec in (own, default, symmetric, title, record):
        groups = GroupSampler([spec], 1, 4, 1, seed=0).batch(0, 0)
        q, p, _, _ = collate(groups, encoder, 16, 16)
        fast = Collator.for_encoder(encoder, 16, 16)(groups)  # the training path gives the same tensors
        assert all(torch.equal(q[k], fast[0][k]) for k in q) and all(torch.equal(p[k], fast[1][k]) for k in p)
        query_prefix, passage_prefix = expected[spec.name]
        for text in decode(q["input_ids"], skip_special_tokens=True):
            first = text.split(" ")[0]
            assert first == (query_prefix or spec.name), (spec.name, text)
        for text in decode(p["input_ids"], skip_special_tokens=True):
            first = text.split(" ")[0]
            assert first == (passage_prefix or spec.name), (spec.name, text)


def test_symmetric_pairs_are_trained_in_both_directions():
    examples = [TrainingExample(f"left {i}", [f"right {i}"], [f"other {i}"]) for i in range(10)]
    spec = SamplerSource(TrainingRows.from_examples(examples), name="para", task="symmetric")
    sampler = GroupSampler([spec], 1, 4, 1, seed=2, epoch_unit="pairs")
    assert sampler.steps_per_epoch == 5  # 10 pairs x 2 directions / 4
    seen = [(g.query, g.passages[0]) for step in range(5) for g in sampler.batch(step, 0)]
    assert sorted(seen) == sorted([(f"left {i}", f"right {i}") for i in range(10)] +
                                  [(f"right {i}", f"left {i}") for i in range(10)])
    for g in sampler.batch(0, 0):
        i = g.query.split(" ")[1]
        assert g.passages[1] == f"other {i}"  # the pair's hard negative serves both directions
        assert set(g.positives) == {f"left {i}", f"right {i}"}  # neither side is a negative of the other
    # without negatives: drawn from the pool, never the query or its positive
    bare = SamplerSource(TrainingRows.from_examples([TrainingExample(f"l{i}", [f"r{i}"]) for i in range(6)]),
                         name="bare", task="symmetric")
    sampler = GroupSampler([bare], 3, 4, 1, seed=0, epoch_unit="pairs")
    for step in range(3):
        for g in sampler.batch(step, 0):
            assert not set(g.passages[1:]) & {g.query, g.passages[0]}


def _engine_loss(loss, in_batch_negatives: bool, block_rows=None):
    from robustir.training.batch_engine import BatchEngine

    torch.manual_seed(0)
    b, k, d = 4, 2, 8
    queries, passages = torch.randn(b, d), torch.randn(b * (1 + k), d)
    engine = BatchEngine(loss, block_rows=block_rows)
    batch = engine.build_batch(queries, passages, k, in_batch_negatives=in_batch_negatives)
    return float(loss(batch).loss)


@pytest.mark.parametrize("name", ["infonce", "peg"])
def test_in_batch_negatives_false_is_the_losses_own_hard_negative_only_mode(name):
    """The engine's mask gives exactly the loss computed by the loss's own in_batch_negatives=False option."""
    from robustir.losses import get_loss

    with_mask = _engine_loss(get_loss(name), in_batch_negatives=False)
    blocked = _engine_loss(get_loss(name), in_batch_negatives=False, block_rows=1)  # the RowMask path
    own_option = _engine_loss(get_loss(name, in_batch_negatives=False), in_batch_negatives=True)
    everything = _engine_loss(get_loss(name), in_batch_negatives=True)
    assert with_mask == pytest.approx(own_option, rel=1e-6) and blocked == pytest.approx(own_option, rel=1e-6)
    assert everything != pytest.approx(with_mask, rel=1e-3)


# ---------------------------------------------------------------------------- training on a mixture

def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _mixture_config(tiny_model_dir: str, tmp_path: Path, output: str, **overrides) -> TrainConfig:
    qa = _write(tmp_path / "qa.jsonl", [{"query": f"what does report {i} say", "pos": [f"report {i} explains {i}"],
                                         "neg": [f"report {i + 1} is about something else"]} for i in range(16)])
    para = _write(tmp_path / "para.jsonl", [{"query": f"sentence {i} in words", "pos": [f"words of sentence {i}"]}
                                            for i in range(12)])
    values = dict(model=tiny_model_dir, output=str(tmp_path / output), batch_size=4, max_steps=6, save_steps=10,
                  passage_max_length=32, query_max_length=16, probe_size=4, lr=1e-3, loss="peg", seed=9,
                  mine="none", report=False, data_cache=str(tmp_path / "cache"),
                  train_data=[{"path": str(qa), "weight": 1.0},
                              {"path": str(para), "name": "para", "weight": 1.0, "task": "symmetric",
                               "in_batch_negatives": False, "query_instruction": "same meaning: "}])
    values.update(overrides)
    return TrainConfig(**values)


def test_mixture_training_resumes_exactly_and_logs_each_source(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from robustir.training import trainer
    from robustir.training.batch_engine import BatchEngine

    flags = []
    original = BatchEngine.step

    def spy(self, *args, **kwargs):
        flags.append(kwargs.get("in_batch_negatives", True))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "step", spy)
    full = trainer.train(_mixture_config(tiny_model_dir, tmp_path, "full", report=True))
    assert trainer.train(_mixture_config(tiny_model_dir, tmp_path, "resumed"), stop_after=3).steps == 3
    resumed = trainer.train(_mixture_config(tiny_model_dir, tmp_path, "resumed"))
    a = load_file(str(full.model_path / "model.safetensors"))
    b = load_file(str(resumed.model_path / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    logs = [[json.loads(x) for x in (tmp_path / o / "train_log.jsonl").read_text().splitlines()]
            for o in ("full", "resumed")]
    assert [r["source"] for r in logs[0]] == [r["source"] for r in logs[1]]
    assert [r["loss"] for r in logs[0]] == pytest.approx([r["loss"] for r in logs[1]], rel=1e-6)
    assert set(r["source"] for r in logs[0]) == {"qa", "para"}  # both sources were drawn (seed 9)
    # the para source trained without in-batch negatives, the qa source with them, step by step
    assert flags[:6] == [r["source"] == "qa" for r in logs[0]]
    report = json.loads((tmp_path / "full" / "report.json").read_text())
    for name in ("qa", "para"):
        losses = [r["loss"] for r in logs[0] if r["source"] == name]
        assert report["per_source"][name] == {"steps": len(losses), "mean_loss": pytest.approx(np.mean(losses))}
    assert "Loss per training source" in (tmp_path / "full" / "report.html").read_text()
    card = (full.model_path / "README.md").read_text()
    assert "a mixture of `qa`" in card and "symmetric" in card
    # both runs converted nothing twice: one cache entry per source file
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2


def test_mixture_config_from_yaml_and_bad_mixtures(tmp_path):
    config_file = tmp_path / "mix.yaml"
    config_file.write_text("train_data:\n  - path: web.jsonl\n    weight: 3\n    query_instruction: 'q: '\n"
                           "  - {path: nli.jsonl, weight: 1, task: symmetric, in_batch_negatives: false}\n"
                           "num_negatives: 1\n")
    config = load_config(TrainConfig, config_file)
    assert [(s.label, s.weight, s.task, s.in_batch_negatives) for s in config.sources] == \
        [("web", 3.0, "retrieval", True), ("nli", 1.0, "symmetric", False)]
    assert load_config(TrainConfig, None, ["train_data=plain.jsonl"]).sources[0].path == "plain.jsonl"

    bad = {
        "  - {path: a.jsonl, wieght: 2}\n":
            r"train_data\[0\]: unknown option 'wieght' \(did you mean 'weight'\?\)",
        "  - {path: a.jsonl, weight: -1}\n": r"train_data\[0\]\.weight = -1 is out of range: it must be > 0",
        "  - {path: a.jsonl, task: qa}\n": r"train_data\[0\]\.task: 'qa' is not one of",
        "  - a.jsonl\n": r"train_data\[0\]: is a section of options",
        "  - {path: a.jsonl, weight: 1}\n  - {path: b.jsonl}\n": r"source\(s\) 'b' have no weight while others have",
        "  - {path: x/a.jsonl}\n  - {path: y/a.jsonl}\n": r"distinct names, and 'a' is used more than once",
        "  - {weight: 1}\n": r"train_data\[0\]: path is required",
        "  - {path: a.jsonl, in_batch_negatives: false}\nnum_negatives: 0\n":
            r"'a' have in_batch_negatives false and num_negatives is 0",
    }
    for text, message in bad.items():
        config_file.write_text("train_data:\n" + text)
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, config_file)
    config_file.write_text("train_data: []\n")
    with pytest.raises(ConfigError, match="train_data is an empty list"):
        load_config(TrainConfig, config_file)
    config_file.write_text("train_data:\n  - {path: a.jsonl, in_batch_negatives: false}\n"
                           "loss_options: {symmetric: true}\n")
    with pytest.raises(ConfigError, match="symmetric needs in-batch negatives"):
        load_config(TrainConfig, config_file)


def test_a_source_smaller_than_a_global_batch_is_named():
    with pytest.raises(ConfigError, match=r"training source 'tiny' has 3 queries .* fewer than one global batch"):
        GroupSampler([source("big", 40), source("tiny", 3)], 1, 4, 1, seed=0, epoch_unit="queries")
    with pytest.raises(ConfigError, match="distinct names"):
        GroupSampler([source("a", 8), source("a", 8)], 1, 4, 1, seed=0)
