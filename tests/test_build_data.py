"""``robustir build-data``: stages chained through a work folder, completed stages skipped on re-run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from robustir.cli.main import main
from robustir.config import load_config
from robustir.errors import ConfigError, DataError
from robustir.mining import teacher_filter as teacher_module
from robustir.mining.build_data import BuildDataConfig, build_data

REPO = Path(__file__).resolve().parents[1]


def documents(path: Path) -> Path:
    topics = ["protein folding in yeast cells", "insulin signalling in liver cells", "tumour growth in mice",
              "antibiotic resistance of bacteria", "memory formation in the hippocampus", "blood pressure in adults"]
    rows = []
    for i, topic in enumerate(topics):
        text = (f"This study examines {topic}. We measured {topic} across three cohorts. "
                f"Results show that {topic} changes with age. The effect of {topic} was robust. "
                f"Further work on {topic} is needed.")
        rows.append({"_id": f"doc{i}", "title": topic.capitalize(), "text": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class LengthTeacher:
    """A deterministic stand-in teacher (no model load): longer shared prefix = higher score."""

    def score(self, queries, passages):
        return np.array([len(set(q.split()) & set(p.split())) / (1 + len(set(q.split()))) for q, p in
                         zip(queries, passages)])


@pytest.fixture
def fake_teacher(monkeypatch):
    monkeypatch.setattr(teacher_module, "load_teacher", lambda *a, **k: LengthTeacher())


def config_for(tmp_path: Path, **overrides) -> BuildDataConfig:
    data = {"input": str(documents(tmp_path / "docs.jsonl")), "work_dir": str(tmp_path / "work"),
            "progress": False, "mine": {"num_negatives": 4, "range_max": 20},
            "filter": {"method": "teacher", "teacher": {"progress": False}}}
    data.update(overrides)
    return load_config(BuildDataConfig, None, None, data)


def test_build_data_runs_and_skips_completed_stages(tmp_path, fake_teacher):
    config = config_for(tmp_path, output=str(tmp_path / "train.jsonl"))
    final, results = build_data(config)
    assert [r.name for r in results] == ["chunk", "pairs", "mine", "filter (teacher)"]
    assert not any(r.skipped for r in results)
    rows = [json.loads(line) for line in final.read_text().splitlines()]
    assert rows and all(r["pos"][0] not in r["neg"] for r in rows) and all("removed" in r for r in rows)
    work = tmp_path / "work"
    stamps = {p.name: p.stat().st_mtime_ns for p in work.glob("*.jsonl")}
    final2, results2 = build_data(config_for(tmp_path, output=str(tmp_path / "train.jsonl")))
    assert all(r.skipped for r in results2) and final2 == final
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("*.jsonl")} == stamps
    # a lost filter output is redone alone
    (work / "filtered-teacher.jsonl").unlink()
    _, results3 = build_data(config_for(tmp_path))
    assert [r.skipped for r in results3] == [True, True, True, False]
    # a mine output without its report is not complete: mine runs again, and so does the filter after it
    (work / "mined.jsonl.report.json").unlink()
    _, results4 = build_data(config_for(tmp_path))
    assert [r.skipped for r in results4] == [True, True, False, False]
    saved = json.loads((work / "build-data.json").read_text())
    assert saved["stages"][2]["name"] == "mine"


def test_build_data_cli_with_max_documents_and_no_filter(tmp_path, capsys):
    docs = documents(tmp_path / "docs.jsonl")
    argv = ["build-data", "--input", str(docs), "--work-dir", str(tmp_path / "w"), "max_documents=3",
            "filter.method=none", "mine.num_negatives=2", "progress=false", "chunk.max_tokens=20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "select" in out and "ran in" in out and "mined.jsonl" in out
    assert len((tmp_path / "w" / "documents.jsonl").read_text().splitlines()) == 3
    assert main(argv) == 0
    assert out.count("ran in") == 4 and capsys.readouterr().out.count("skipped (complete)") == 4


def test_build_data_errors(tmp_path):
    with pytest.raises(ConfigError, match="input"):
        build_data(BuildDataConfig(work_dir=str(tmp_path / "w")))
    with pytest.raises(ConfigError, match="unknown option"):
        load_config(BuildDataConfig, None, ["mine.nope=1"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "a", "text": "fine"}\n{"_id": "b", "text": 5}\n', encoding="utf-8")
    with pytest.raises(DataError) as info:
        build_data(load_config(BuildDataConfig, None, None, {"input": str(bad), "work_dir": str(tmp_path / "w2"),
                                                             "progress": False}))
    assert "bad.jsonl" in str(info.value) and "line 2" in str(info.value)


def test_example_config_parses():
    config = load_config(BuildDataConfig, REPO / "configs" / "build-data-example.yaml")
    assert config.queries.method == "pairs" and config.mine.method == "bm25" and config.filter.method == "teacher"
    assert config.filter.teacher.relative_margin == 0.05
