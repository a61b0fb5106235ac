"""robustir's recipe for noisy data: ``robustir train --filter-positives --loss peg`` (docs/robustness.md).

The starting model, as teacher, drops positives that look like random passages (the audit's random p-value) before
PEG trains on the rest, for the step budget of the data as given. The rule itself is tested on hand-made
scores in tests/test_filters.py; here: the real bundled model on SciFact with planted false positives, the
resumable filtered copy, and the options' checks.
"""

from __future__ import annotations

import json

import pytest

from robustir.errors import ConfigError


@pytest.mark.slow
def test_filter_positives_drops_planted_false_positives_before_peg_trains(tmp_path, minilm_path, scifact_dir):
    from robustir.training import train
    from robustir.training.arguments import TrainConfig

    from helpers import scifact_with_planted_positives

    data = tmp_path / "train.jsonl"
    planted = {i + 1 for i in scifact_with_planted_positives(scifact_dir, data, 120, 30)}  # line numbers
    config = TrainConfig(model=minilm_path, train_data=str(data), mine="none", num_negatives=1, loss="peg",
                         filter_positives=True, batch_size=8, max_steps=2, query_max_length=32,
                         passage_max_length=96, output=str(tmp_path / "run"), report=False, seed=1)
    result = train(config)
    assert (result.model_path / "config.json").exists()
    filtered = [json.loads(line) for line in (tmp_path / "run" / "filtered.jsonl").read_text().splitlines()]
    assert len(filtered) == 120  # aligned with the input, line for line
    dropped = {i + 1 for i, r in enumerate(filtered) if not r["pos"]}
    reasons = {r["reason"] for row in filtered for r in row.get("removed", []) if r.get("positive")}
    assert reasons <= {"random_like_positive"}
    # the planted (random) positives get weight 0 -- they are not trained on -- and the clean ones weight 1
    assert len(dropped & planted) >= 27, f"found {len(dropped & planted)} of 30 planted false positives"
    assert len(dropped - planted) <= 3, f"dropped {len(dropped - planted)} of 90 clean positives"
    # what training read: the filtered records, without the dropped ones
    stats = json.loads((tmp_path / "run" / "filtered.jsonl.run.json").read_text())
    assert stats["complete"] is True


def test_filter_positives_copy_is_reused_and_redone_when_the_data_changes(tmp_path, tiny_model_dir, monkeypatch):
    from robustir.filtering import teacher as teacher_module
    from robustir.training import train
    from robustir.training.arguments import TrainConfig

    rows = [{"query": f"query {i} about topic {i}", "pos": [f"passage {i} on topic {i} and more words here"],
             "neg": [f"negative {i} {j} other words" for j in range(3)]} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    real = teacher_module.teacher_filter

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "teacher_filter", counting)

    def run(**extra):
        return train(TrainConfig(model=tiny_model_dir, train_data=str(data), mine="none", num_negatives=1,
                                 loss="peg", filter_positives=True, batch_size=4, max_steps=1,
                                 query_max_length=16, passage_max_length=32, output=str(tmp_path / "a"), report=False,
                                 precision="fp32", **extra))

    run()
    filtered = tmp_path / "a" / "filtered.jsonl"
    assert len(calls) == 1 and filtered.exists()
    run()  # the same run again: complete, nothing filtered again
    assert len(calls) == 1
    rows[0]["pos"] = ["an edited positive about topic 0 with enough words"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(resume=False)  # edited data, started over: filtered again, from the new data
    assert len(calls) == 2 and "an edited positive" in filtered.read_text()
    # without the option nothing is filtered
    train(TrainConfig(model=tiny_model_dir, train_data=str(data), mine="none", num_negatives=1, batch_size=4,
                      max_steps=1, query_max_length=16, passage_max_length=32, output=str(tmp_path / "b"),
                      report=False, precision="fp32"))
    assert len(calls) == 2 and not (tmp_path / "b" / "filtered.jsonl").exists()


def test_recipe_options_are_checked_at_load():
    from robustir.config import load_config
    from robustir.filtering.teacher import TeacherFilterConfig
    from robustir.robustness.bench import NoiseBenchConfig
    from robustir.training.arguments import TrainConfig

    with pytest.raises(ConfigError, match="filter_positive"):
        load_config(TrainConfig, None, ["filter_positive=true"])
    with pytest.raises(ConfigError, match="random_like_shar"):
        NoiseBenchConfig(robust={"random_like_shar": 0.1})
    with pytest.raises(ConfigError, match="random_like_share"):
        NoiseBenchConfig(robust={"random_like_share": 2.0})
    with pytest.raises(ConfigError):
        TeacherFilterConfig(random_passages=0)
    with pytest.raises(ConfigError, match="preset"):
        NoiseBenchConfig(preset="cpu-longer")


def test_filtered_training_keeps_the_step_budget_of_the_data_as_given(tmp_path, tiny_model_dir):
    """After filter_positives dropped pairs, ``epochs`` still buys the steps of the unfiltered data (the GPU preset
    measured a perfect filter losing 3.0 NDCG@10 at the same epochs and 1.0 at the same steps)."""
    from robustir.data.arrow_store import convert_training_files
    from robustir.training import train
    from robustir.training.arguments import TrainConfig
    from robustir.training.data import SamplerSource
    from robustir.training.trainer import budget_scale

    rows = [{"query": f"query {i} about topic {i}", "pos": [f"passage {i} on topic {i} and more words here"],
             "neg": [f"negative {i} {j} other words" for j in range(3)]} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train(TrainConfig(model=tiny_model_dir, train_data=str(data), mine="none", num_negatives=1, loss="peg",
                               filter_positives=True, batch_size=4, epochs=1.0, query_max_length=16,
                               passage_max_length=32, output=str(tmp_path / "run"), report=False, precision="fp32"))
    kept = sum(1 for line in (tmp_path / "run" / "filtered.jsonl").read_text().splitlines()
               if json.loads(line)["pos"])
    assert kept < 40  # the tiny random teacher finds some positives random-like
    assert result.steps == 10  # 40 pairs / batch 4, not kept / 4
    source = convert_training_files(tmp_path / "run" / "filtered.jsonl", tmp_path / "cache", skip_empty_positives=True)
    assert budget_scale([SamplerSource(source, budget_items=40)], "pairs") == pytest.approx(40 / kept)
    assert budget_scale([SamplerSource(source)], "pairs") == 1.0
