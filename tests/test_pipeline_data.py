"""``robustir run`` as the data builder: chunking, the LLM stages, ``--until``, typed sections, PEG's recipe."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from robustir.cli.main import main
from robustir.errors import ConfigError, DataError
from robustir.filtering import teacher as teacher_module
from robustir.pipeline import STAGES, load_pipeline_config, run_pipeline

from fake_llm_server import FakeLLMServer, last_user  # tests/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["protein folding in yeast cells", "insulin signalling in liver cells", "tumour growth in mice",
          "antibiotic resistance of bacteria", "memory formation in the hippocampus", "blood pressure in adults"]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def documents(path: Path) -> Path:
    rows = []
    for i, topic in enumerate(TOPICS):
        text = (f"This study examines {topic}. We measured {topic} across three cohorts. "
                f"Results show that {topic} changes with age. The effect of {topic} was robust. "
                f"Further work on {topic} is needed.")
        rows.append({"_id": f"doc{i}", "title": topic.capitalize(), "text": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class LengthTeacher:
    """A deterministic stand-in teacher (no model load): word overlap with the query."""

    def score(self, queries, passages):
        return np.array([len(set(q.split()) & set(p.split())) / (1 + len(set(q.split()))) for q, p in
                         zip(queries, passages)])


@pytest.fixture
def fake_teacher(monkeypatch):
    monkeypatch.setattr(teacher_module, "load_teacher", lambda *a, **k: LengthTeacher())


def data_config(tmp_path: Path, **sections) -> dict:
    config = {"work_dir": str(tmp_path / "work"), "corpus": str(documents(tmp_path / "docs.jsonl")),
              "chunk": {"max_tokens": 20, "min_tokens": 4},
              "queries": {"source": "pairs"}, "pretrain": None, "mine": {"num_negatives": 4, "range_max": 20},
              "filter": {"method": "teacher", "teacher": {"progress": False}}}
    config.update(sections)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return config


def load(tmp_path: Path, overrides: list[str] | None = None, **sections):
    data_config(tmp_path, **sections)
    return load_pipeline_config(tmp_path / "pipeline.yaml", overrides)


def test_until_filter_builds_training_data_and_skips_completed_stages(tmp_path, fake_teacher):
    result = run_pipeline(load(tmp_path), until="filter")
    assert result.stages == {"corpus": "ran", "chunk": "ran", "queries": "ran", "pretrain": "off", "mine": "ran",
                             "filter": "ran", "train": "not run (--until)", "eval": "not run (--until)"}
    work = tmp_path / "work"
    assert result.model_path == work / "filter" / "train.jsonl" and result.metrics == {}
    passages = [json.loads(x) for x in (work / "chunk" / "passages.jsonl").read_text().splitlines()]
    assert len(passages) > len(TOPICS) and {p["doc_id"] for p in passages} == {f"doc{i}" for i in range(6)}
    rows = [json.loads(x) for x in result.model_path.read_text().splitlines()]
    assert rows and all(r["pos"][0] not in r["neg"] for r in rows) and all("removed" in r for r in rows)
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*.jsonl")}
    again = run_pipeline(load(tmp_path), until="filter")
    assert {again.stages[s] for s in STAGES[:6]} == {"skipped", "off"}
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*.jsonl")} == stamps
    # a changed section reruns that stage and the ones after it, never the ones before
    changed = run_pipeline(load(tmp_path, ["mine.num_negatives=2"]), until="filter")
    assert [changed.stages[s] for s in ("corpus", "chunk", "queries", "mine", "filter")] == \
        ["skipped", "skipped", "skipped", "ran", "ran"]


def test_cli_until_with_max_documents_and_no_filter(tmp_path, capsys):
    data_config(tmp_path)
    argv = ["run", str(tmp_path / "pipeline.yaml"), "--until", "filter", "max_documents=3", "filter=null",
            "mine.num_negatives=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "corpus ran, chunk ran, queries ran, pretrain off, mine ran, filter off" in out
    assert "output of stage filter:" in out and str(tmp_path / "work" / "mine" / "train.jsonl") in out
    assert len((tmp_path / "work" / "corpus" / "corpus.jsonl").read_text().splitlines()) == 3
    assert main(argv) == 0
    assert "corpus skipped, chunk skipped, queries skipped" in capsys.readouterr().out


@pytest.mark.parametrize("override, path", [
    ("max_document=3", "config: unknown option 'max_document'"),
    ("chunk.max_tokn=3", "chunk: unknown option 'max_tokn'"),
    ("queries.pairs.min_weigth=2", "queries.pairs: unknown option 'min_weigth'"),
    ("queries.generate.num_querys=2", "queries.generate: unknown option 'num_querys'"),
    ("queries.generate.llm.modle=x", "queries.generate.llm: unknown option 'modle'"),
    ("pretrain={mode: gur, max_step: 2}", "pretrain: unknown option 'max_step'"),
    ("mine.num_negativs=3", "mine: unknown option 'num_negativs'"),
    ("filter.teacher.relative_margn=0.1", "filter.teacher: unknown option 'relative_margn'"),
    ("filter.sieve.betta=0.1", "filter.sieve: unknown option 'betta'"),
    ("filter.llm.llm.base_ur=x", "filter.llm.llm: unknown option 'base_ur'"),
    ("train.lrate=1", "train: unknown option 'lrate'"),
    ("eval.splt=dev", "eval: unknown option 'splt'"),
    ("mine.num_negatives=many", "mine.num_negatives"),
])
def test_a_typo_in_any_stage_section_fails_at_load_naming_its_key_path(tmp_path, override, path):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, [override])
    assert path in str(info.value)


def test_runner_owned_fields_and_bad_input_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="queries.generate.input"):
        load(tmp_path, ["queries.generate.input=x.jsonl"])
    with pytest.raises(ConfigError, match="--until 'nope'"):
        run_pipeline(load(tmp_path), until="nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "a", "text": "fine"}\n{"_id": "b", "text": 5}\n', encoding="utf-8")
    with pytest.raises(DataError) as info:
        run_pipeline(load(tmp_path, [f"corpus={bad}"]), until="corpus")
    assert "bad.jsonl" in str(info.value) and "line 2" in str(info.value)


def test_peg_recipe_end_to_end_against_a_fake_endpoint(tiny_model_dir, tmp_path, monkeypatch):
    """configs/peg-recipe.yaml as shipped, pointed at a local fake endpoint and shrunk to a tiny model."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    documents(beir / "corpus.jsonl")
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"what about {t}"}) + "\n"
                                                for i, t in enumerate(TOPICS)))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                             "".join(f"q{i}\tdoc{i}\t1\n" for i in range(6)))

    def reply(messages):
        prompt = last_user(messages)
        if "Query:" in prompt:  # the judge: a passage on the query's own topic is relevant (a false negative)
            query_line = next(line for line in prompt.splitlines() if line.startswith("Query:"))
            rest = prompt.replace(query_line, "")
            return "Yes" if any(t in query_line and t in rest for t in TOPICS) else "No"
        topic = next((t for t in TOPICS if t in prompt), "something")
        return f"1. What is known about {topic}?\n2. Why study {topic}?"

    with FakeLLMServer(reply) as server:
        overrides = [f"work_dir={tmp_path / 'work'}", f"model={tiny_model_dir}", f"corpus={beir}",
                     f"eval.data={beir}", f"queries.generate.llm.base_url={server.url}",
                     "queries.generate.llm.model=fake-model", f"filter.llm.llm.base_url={server.url}",
                     "filter.llm.llm.model=fake-model", "queries.generate.progress=false",
                     "filter.llm.progress=false", "mine.precision=fp32", "train.precision=fp32", "eval.precision=fp32",
                     "train.max_steps=2", "train.batch_size=4", "train.num_negatives=2", "train.report=false",
                     "train.passage_max_length=32", "train.query_max_length=16", "train.probe_size=8",
                     "eval.passage_max_length=32", "eval.query_max_length=16", "chunk.max_tokens=20",
                     "chunk.min_tokens=4"]
        config = load_pipeline_config(REPO / "configs" / "peg-recipe.yaml", overrides)
        assert config.queries.source == "generate" and config.filter.method == "llm" and config.train.loss == "peg"
        result = run_pipeline(config)
        judged = server.count
    assert result.stages == {"corpus": "ran", "chunk": "ran", "queries": "ran", "pretrain": "off", "mine": "ran",
                             "filter": "ran", "train": "ran", "eval": "ran"}
    work = tmp_path / "work"
    generated = [json.loads(x) for x in (work / "queries" / "train.jsonl").read_text().splitlines()]
    passages = (work / "chunk" / "passages.jsonl").read_text().splitlines()
    assert len(generated) == 2 * len(passages) and generated[0]["query"].startswith("What is known about")
    filtered = [json.loads(x) for x in (work / "filter" / "train.jsonl").read_text().splitlines()]
    assert len(filtered) == len(generated) and judged > len(passages)
    assert all(r["pos"][0] not in r["neg"] for r in filtered)
    removed = [x for r in filtered for x in r.get("removed", []) if x["reason"] == "llm_judge"]
    assert removed  # other passages of the query's own document were judged relevant and dropped
    assert set(result.metrics) == {"base", "finetuned"} and 0 <= result.metrics["finetuned"]["ndcg@10"] <= 1
    saved = json.loads((work / "pipeline_config.json").read_text())
    assert saved["queries"]["generate"]["llm"]["api_key"] is None  # secrets never land on disk


def test_failed_judgements_stop_the_runner_and_a_re_run_retries_them(tmp_path):
    """Judgements that failed (an unparseable reply) keep the filter stage unfinished; the next run retries them."""
    flaky = {"on": True}

    def reply(messages):
        prompt = last_user(messages)
        if flaky["on"] and TOPICS[0] in prompt:
            return "Maybe."  # neither yes nor no: a failed judgement, never a guess
        return "No"

    with FakeLLMServer(reply) as server:
        sections = {"queries": {"source": "pairs"},
                    "filter": {"method": "llm", "llm": {"progress": False,
                                                        "max_failure_rate": 1.0,
                                                        "llm": {"base_url": server.url, "model": "fake-model",
                                                                "on_failure": "skip", "max_retries": 0}}}}
        with pytest.raises(ConfigError, match="re-run to retry"):
            run_pipeline(load(tmp_path, **sections), until="filter")
        flaky["on"] = False
        result = run_pipeline(load(tmp_path, **sections), until="filter")
    assert result.stages["filter"] == "ran"
    filtered = tmp_path / "work" / "filter" / "train.jsonl"
    assert filtered.exists() and not (filtered.parent / "train.jsonl.failed.jsonl").exists()
