"""robustir.runs: fingerprints (operational fields left out, inputs by content) and the one start/finish rule."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from robustir.errors import ConfigError
from robustir.negatives.mining import MiningConfig
from robustir.runs import Artifact, Fingerprint, added, fingerprint, operational, settings_of
from robustir.training.arguments import TrainConfig


@dataclass
class Section:
    size: int = 3
    batch_size: int = operational(64)


@dataclass
class Options:
    lr: float = 0.1
    progress: bool = operational(True)
    api_key: str | None = None
    section: Section = field(default_factory=Section)


def test_settings_leave_out_operational_fields_at_every_depth_and_hide_secrets():
    assert settings_of(Options(api_key="sk-secret")) == {"lr": 0.1, "api_key": "<set>", "section": {"size": 3}}
    assert settings_of({"options": Options(), "split": "train"})["options"]["api_key"] is None
    # the configs themselves say what is operational: changing those never changes a fingerprint
    assert fingerprint("mine", MiningConfig()) == fingerprint("mine", MiningConfig(encode_batch_size=7, device="cpu",
                                                                                   query_batch_size=3))
    assert fingerprint("mine", MiningConfig()) != fingerprint("mine", MiningConfig(num_negatives=3))
    train = settings_of(TrainConfig())
    assert "prefetch_batches" not in train and "device" not in train and "lr" in train and "seed" in train


@dataclass
class Before:
    lr: float = 0.1


@dataclass
class After:
    lr: float = 0.1
    base_weight: float = added(0.0)


def test_a_field_added_later_keeps_finished_outputs_finished_until_it_is_set(tmp_path):
    """An output made before a field existed stays reusable after the upgrade while the field holds the old
    behaviour's value (TrainConfig.base_weight: 0); set to anything else, it is a difference that is named."""
    artifact = Artifact(tmp_path / "out.jsonl")
    artifact.path.write_text("x\n")
    artifact.start(fingerprint("train", Before()))
    artifact.finish()
    assert artifact.complete(fingerprint("train", After()))
    assert fingerprint("train", After()).differences(fingerprint("train", Before())) == []
    changed = fingerprint("train", After(base_weight=0.2))
    assert not artifact.complete(changed)
    assert any(d.startswith("base_weight") for d in changed.differences(fingerprint("train", Before())))
    assert "base_weight" not in settings_of(TrainConfig()) and settings_of(TrainConfig(base_weight=0.2))["base_weight"]


def test_an_input_edited_in_place_changes_the_fingerprint_and_the_difference_is_named(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"_id": "1"}\n')
    before = fingerprint("corpus", {"mining": {"k": 3}}, {"corpus": data})
    data.write_text('{"_id": "1"}\n{"_id": "2"}\n')  # same path, same name
    after = fingerprint("corpus", {"mining": {"k": 4}}, {"corpus": data})
    diffs = after.differences(before)
    assert any("mining.k: 3 -> 4" in d for d in diffs) and any("corpus.jsonl changed" in d for d in diffs)
    assert before.differences(fingerprint("corpus", {"mining": {"k": 3}}, {"corpus": tmp_path / "corpus.jsonl"})) \
        != [] and before.digest != after.digest
    same = fingerprint("corpus", {"mining": {"k": 4}}, {"corpus": data})
    assert same.differences(after) == [] and same.digest == after.digest
    assert Fingerprint.from_json(after.to_json()).digest == after.digest


def test_begin_reuses_refuses_redoes_and_resumes(tmp_path):
    out = Artifact(tmp_path / "out.jsonl")
    a, b = Fingerprint("s", {"x": 1}), Fingerprint("s", {"x": 2})
    assert not out.begin(a) and not out.complete(a)  # started, not done
    out.path.write_text("row\n")
    out.finish({"rows": 1})
    assert out.complete(a) and not out.complete(b) and out.report == {"rows": 1}
    assert out.begin(a)  # nothing to do
    with pytest.raises(ConfigError, match=r"other settings or inputs than this run: x: 1 -> 2.*--overwrite"):
        out.begin(b, on_change="refuse")
    assert out.path.exists()  # refusing touches nothing
    assert not out.begin(b, on_change="redo") and not out.path.exists()  # redone from scratch
    out.path.write_text("partial")
    assert not out.begin(b) and out.path.read_text() == "partial"  # the same run resumes
    assert not out.begin(b, overwrite=True) and not out.path.exists()


def test_a_damaged_output_is_never_reused(tmp_path, caplog):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "data.bin").write_bytes(b"0123456789")
    entry = Artifact(folder)
    made = Fingerprint("cache", {})
    entry.begin(made)
    entry.finish({}, files=["data.bin"], checksums=True)
    assert entry.complete(made)
    (folder / "data.bin").write_bytes(b"0123456780")  # same size, one byte changed
    assert entry.check(made).problems == ["data.bin does not match the checksum recorded when it was written"]
    assert not Artifact(folder, checksum_limit=4).check(made).problems  # large files: sizes only
    (folder / "data.bin").write_bytes(b"01234")
    assert "data.bin has 5 bytes, 10 were written" in entry.check(made).problems
    with caplog.at_level("WARNING", logger="robustir"):
        assert not entry.begin(made)
    assert not folder.exists() and "damaged" in caplog.text


def test_a_folder_can_carry_its_record_and_a_damaged_record_says_nothing(tmp_path, caplog):
    run = Artifact(tmp_path / "run", inside=True)
    run.start(Fingerprint("train", {"lr": 1}))
    assert run.record_path == tmp_path / "run" / "run.json" and run.check().state == "started"
    run.record_path.write_text("{not json")
    assert run.record() is None and run.fingerprint is None
    with caplog.at_level("WARNING", logger="robustir"):  # said, not silent
        run.decide(Fingerprint("train", {"lr": 1}))
    assert "cannot be read as a run record" in caplog.text
    run.note(rows=5)
    assert json.loads(run.record_path.read_text())["progress"] == {"rows": 5} and run.progress == {"rows": 5}


def test_a_run_reads_each_input_once_through_its_digest_cache(tmp_path, monkeypatch):
    import importlib

    fingerprint_module = importlib.import_module("robustir.runs.fingerprint")  # the module, not the function

    data = tmp_path / "corpus.jsonl"
    data.write_text('{"_id": "1"}\n')
    calls = []
    real = fingerprint_module.input_digest
    monkeypatch.setattr(fingerprint_module, "input_digest", lambda *a, **k: calls.append(a) or real(*a, **k))
    cache: dict = {}
    first = fingerprint("corpus", {}, {"corpus": data}, cache=cache)
    again = fingerprint("queries", {}, {"beir corpus": data}, cache=cache)
    assert len(calls) == 1 and first.inputs["corpus"] == again.inputs["beir corpus"]
    fingerprint("corpus", {}, {"corpus": data})
    assert len(calls) == 2  # without a cache every call reads the input
