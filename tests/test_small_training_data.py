"""Training data smaller than one batch, and records without a positive.

A data set smaller than ``batch_size`` trains with the batch capped at its size (one warning), as
sentence-transformers does; a record whose ``pos`` list is empty is a data error naming its file and line, unless
``skip_empty_positives`` asks to skip (and count) such records, or a robustir filter emptied it on purpose.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from robustir.errors import DataError
from robustir.training.arguments import TrainConfig
from robustir.training.trainer import train

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def records(n: int) -> list[dict]:
    return [{"query": f"what does report {i} say", "pos": [f"report {i} says something about topic {i}"],
             "neg": [f"unrelated text number {i}"]} for i in range(n)]


def config(tiny_model_dir: str, data: Path, output: Path, **overrides) -> TrainConfig:
    values = dict(model=tiny_model_dir, train_data=str(data), output=str(output), batch_size=8, epochs=1.0,
                  passage_max_length=32, query_max_length=16, probe_size=4, lr=1e-3, num_negatives=1, mine="none",
                  report=False, seed=1)
    values.update(overrides)
    return TrainConfig(**values)


def test_data_smaller_than_a_batch_trains_with_the_batch_capped(tiny_model_dir, tmp_path, caplog):
    data = write_records(tmp_path / "train.jsonl", records(3))
    with caplog.at_level(logging.WARNING):
        result = train(config(tiny_model_dir, data, tmp_path / "run"))
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert capped == ["the training data has 3 (query, positive) pairs (epoch_unit pairs), fewer than one batch of "
                      "8: batch_size capped at 3"]
    assert result.steps == 1  # one epoch of 3 examples in batches of 3
    saved = json.loads((result.model_path / "training_config.json").read_text())
    assert saved["batch_size"] == 3
    card = (result.model_path / "README.md").read_text()
    assert "batch 3 queries per process (batch_size 8 capped at the size of the training data)" in card
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1]


def test_fit_batch_size_per_process_and_not_for_mixtures():
    from robustir.data.arrow_store import TrainingRows
    from robustir.data.training_data import TrainingExample
    from robustir.training.data import SamplerSource, fit_batch_size

    def source(n: int, name: str = "train") -> SamplerSource:
        return SamplerSource(TrainingRows.from_examples([TrainingExample(f"q{i}", [f"p{i}"]) for i in range(n)]),
                             name=name)

    assert fit_batch_size([source(20)], 8, 1, "queries") == 8  # enough data: unchanged
    assert fit_batch_size([source(5)], 8, 1, "queries") == 5
    assert fit_batch_size([source(5)], 8, 2, "queries") == 2  # per process: 5 // 2
    assert fit_batch_size([source(1)], 8, 2, "queries") == 8  # under one per process: GroupSampler's error
    assert fit_batch_size([source(40, "a"), source(3, "b")], 8, 1, "queries") == 8  # a mixture: not capped


def test_a_record_with_an_empty_positive_list_is_an_error_naming_file_and_line(tiny_model_dir, tmp_path, capsys):
    from robustir.cli.main import main

    data = write_records(tmp_path / "train.jsonl", records(4) + [{"query": "q", "pos": [], "neg": ["n"]}])
    with pytest.raises(DataError) as err:
        train(config(tiny_model_dir, data, tmp_path / "run"))
    message = str(err.value)
    assert f"{data}, line 5, field 'pos'" in message and "empty positive list" in message
    assert "skip_empty_positives" in message  # the fix names the option
    # the CLI: one line, no traceback
    code = main(["train", "--model", tiny_model_dir, "--train-data", str(data), "--output", str(tmp_path / "cli"),
                 "--no-mine", "--max-steps", "1", "report=false"])
    err_text = capsys.readouterr().err
    assert code != 0 and "line 5" in err_text and "Traceback" not in err_text


def test_skip_empty_positives_skips_and_counts_them(tiny_model_dir, tmp_path, caplog):
    from robustir.data.training_data import load_training_data

    rows = records(4)
    rows.insert(2, {"query": "q", "pos": [], "neg": ["n"]})
    data = write_records(tmp_path / "train.jsonl", rows)
    examples, stats = load_training_data(data, skip_empty_positives=True)
    assert len(examples) == 4 and stats["skipped_empty_positives"] == 1 and stats["skipped_empty"] == 1
    with caplog.at_level(logging.WARNING):
        result = train(config(tiny_model_dir, data, tmp_path / "run", batch_size=2, skip_empty_positives=True))
    assert result.steps == 2
    assert any("skipped 1 training record(s) with an empty positive list" in r.getMessage() for r in caplog.records)
    card = (result.model_path / "README.md").read_text()
    assert "4 examples" in card and "1 record(s) with an empty positive list skipped" in card


def test_records_a_filter_emptied_are_skipped_without_the_option(tmp_path):
    from robustir.data.training_data import load_training_data

    emptied = {"query": "q", "pos": [], "neg": ["n"],
               "removed": [{"text": "p", "reason": "suspect_positive", "positive": True}]}
    data = write_records(tmp_path / "train.jsonl", records(2) + [emptied])
    examples, stats = load_training_data(data)
    assert len(examples) == 2 and stats["skipped_empty"] == 1


def test_a_conversion_that_skipped_empty_positives_is_not_reused_by_one_that_refuses_them(tmp_path):
    from robustir.data.arrow_store import convert_training_files

    data = write_records(tmp_path / "train.jsonl", records(3) + [{"query": "q", "pos": []}])
    rows = convert_training_files(data, tmp_path / "cache", skip_empty_positives=True)
    assert len(rows) == 3 and rows.stats["skipped_empty_positives"] == 1
    with pytest.raises(DataError, match="line 4, field 'pos': empty positive list"):
        convert_training_files(data, tmp_path / "cache")
