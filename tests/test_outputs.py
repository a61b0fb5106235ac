"""The stage-output protocol (robustir.outputs.StageOutput): names, the one completion rule, clear, shards."""

from __future__ import annotations

from robustir.io import Shard
from robustir.outputs import StageOutput


def test_names_of_an_output_and_its_shards(tmp_path):
    out = StageOutput(tmp_path / "mined.jsonl", "2/8", reports=True)
    assert out.shard == Shard(1, 8) and out.path.name == "mined.shard-00002-of-00008.jsonl"
    assert out.report.name == "mined.shard-00002-of-00008.jsonl.report.json"
    assert [s.path.name for s in StageOutput(tmp_path / "x.jsonl").shards(2)] == \
        ["x.shard-00001-of-00002.jsonl", "x.shard-00002-of-00002.jsonl"]
    assert StageOutput(tmp_path / "x.jsonl").path == tmp_path / "x.jsonl"


def test_one_completion_rule(tmp_path):
    out = StageOutput(tmp_path / "q.jsonl", reports=True)
    assert out.problems() == ["missing"]
    out.partial.write_text("{}\n")
    assert "unfinished" in out.problems()[0]
    out.partial.replace(out.path)
    assert out.problems() == ["no .report.json (the stage did not finish)"]
    out.write_report({"n": 1})
    assert out.complete()
    out.failed.write_text("{}\n")
    assert not out.complete() and out.complete(allow_failures=True)
    out.done.write_text('"d1"\n')
    assert any(".done" in p for p in out.problems(allow_failures=True))
    out.llm_cache.write_text("cache")
    out.clear()
    assert not any(p.exists() for p in (out.path, out.report, out.failed, out.done, out.partial))
    assert out.llm_cache.exists()  # paid-for replies survive --overwrite


def test_every_stage_report_has_a_one_line_summary():
    from robustir.data.chunking import ChunkStats
    from robustir.filtering.llm_judge import JudgeReport
    from robustir.filtering.teacher import FilterReport
    from robustir.negatives.mining import MiningReport
    from robustir.queries.generate import GenerateReport
    from robustir.queries.pairs import PairStats

    reports = [ChunkStats(documents=2, passages=5), PairStats(pairs=3), MiningReport(queries=4),
               FilterReport("teacher", "in.jsonl", "out.jsonl"), GenerateReport("out.jsonl"), JudgeReport("out.jsonl")]
    for report in reports:
        line = report.summary()
        assert isinstance(line, str) and line and "\n" not in line, type(report).__name__
    assert "5 passages" in reports[0].summary() and "4 queries" in reports[2].summary()
