"""Bad input gives a DataError that names the file, the line and the field — never a traceback."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from robustir.data.beir import load_beir, load_corpus, load_qrels_tsv, load_queries
from robustir.data.trec import read_trec_qrels, read_trec_run, write_trec_run
from robustir.data.training_data import examples_from_beir, iter_training_examples, load_training_data
from robustir.errors import DataError


def write_lines(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def make_beir(root: Path, corpus=None, queries=None, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t2\n"):
    write_lines(root / "corpus.jsonl", corpus or [{"_id": "d1", "title": "T1", "text": "alpha"},
                                                  {"_id": "d2", "title": "", "text": "beta"},
                                                  {"_id": "d3", "text": "gamma"}])
    write_lines(root / "queries.jsonl", queries or [{"_id": "q1", "text": "a?"}, {"_id": "q2", "text": "b?"},
                                                    {"_id": "q3", "text": "unjudged"}])
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "qrels" / "test.tsv").write_text(qrels, encoding="utf-8")
    return root


def test_valid_beir_folder(tmp_path):
    data = load_beir(make_beir(tmp_path))
    assert data.corpus.ids == ["d1", "d2", "d3"]
    assert data.corpus.texts_for_encoding() == ["T1 alpha", "beta", "gamma"]
    assert data.queries == {"q1": "a?", "q2": "b?"}  # only queries judged in the split
    assert data.qrels == {"q1": {"d1": 1}, "q2": {"d2": 2}}  # graded relevance kept


def test_gzip_corpus(tmp_path):
    root = make_beir(tmp_path)
    raw = (root / "corpus.jsonl").read_bytes()
    (root / "corpus.jsonl").unlink()
    with gzip.open(root / "corpus.jsonl.gz", "wb") as handle:
        handle.write(raw)
    assert len(load_beir(root).corpus) == 3


def test_duplicate_document_id(tmp_path):
    path = write_lines(tmp_path / "corpus.jsonl", [{"_id": "d1", "text": "x"}, {"_id": "d1", "text": "y"}])
    with pytest.raises(DataError) as err:
        load_corpus(path)
    message = str(err.value)
    assert "corpus.jsonl" in message and "line 2" in message and "duplicate" in message and "line 1" in message


def test_duplicate_query_id(tmp_path):
    path = write_lines(tmp_path / "queries.jsonl", [{"_id": "q", "text": "x"}, {"_id": "q", "text": "y"}])
    with pytest.raises(DataError, match="line 2.*duplicate query id"):
        load_queries(path)


def test_qrels_unknown_document(tmp_path):
    root = make_beir(tmp_path, qrels="query-id\tcorpus-id\tscore\nq1\tnope\t1\n")
    with pytest.raises(DataError, match="corpus id 'nope'.*not in corpus.jsonl"):
        load_beir(root)
    # documented escape hatch: skip and count
    root2 = make_beir(tmp_path / "b", qrels="query-id\tcorpus-id\tscore\nq1\tnope\t1\nq2\td2\t1\n")
    data = load_beir(root2, unknown_ids="skip")
    assert data.qrels == {"q2": {"d2": 1}} and data.skipped["qrels_rows"] == 1


def test_qrels_unknown_query(tmp_path):
    root = make_beir(tmp_path, qrels="query-id\tcorpus-id\tscore\nqX\td1\t1\n")
    with pytest.raises(DataError, match="query id 'qX'"):
        load_beir(root)


def test_qrels_missing_header(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text("q1\td1\t1\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_qrels_tsv(path)
    assert "line 1" in str(err.value) and "missing header" in str(err.value) and "Fix" in str(err.value)


def test_qrels_bad_score_and_columns(tmp_path):
    path = tmp_path / "test.tsv"
    path.write_text("query-id\tcorpus-id\tscore\nq1\td1\thigh\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2.*score"):
        load_qrels_tsv(path)
    path.write_text("query-id\tcorpus-id\tscore\nq1 d1 1\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2.*3 tab-separated"):
        load_qrels_tsv(path)


def test_bad_utf8_and_bad_json(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b'{"_id": "d1", "text": "ok"}\n{"_id": "d2", "text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="line 2.*UTF-8"):
        load_corpus(path)
    path.write_text('{"_id": "d1", "text": "ok"}\n{"_id": "d2", "text": }\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2.*invalid JSON"):
        load_corpus(path)


def test_wrong_types(tmp_path):
    path = write_lines(tmp_path / "corpus.jsonl", [{"_id": "d1", "text": ["not", "a", "string"]}])
    with pytest.raises(DataError, match="line 1, field 'text'"):
        load_corpus(path)
    path = write_lines(tmp_path / "c2.jsonl", [{"_id": {"x": 1}, "text": "t"}])
    with pytest.raises(DataError, match="field '_id'"):
        load_corpus(path)
    path = write_lines(tmp_path / "c3.jsonl", [{"_id": "x"}])
    with pytest.raises(DataError, match="missing field 'text'"):
        load_corpus(path)


def test_empty_documents_are_counted_skips(tmp_path):
    root = make_beir(tmp_path, corpus=[{"_id": "d1", "text": "alpha"}, {"_id": "d2", "text": "beta"},
                                       {"_id": "d9", "title": " ", "text": ""}],
                     qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td9\t1\n")
    data = load_beir(root)
    assert data.skipped["documents"] == 1
    assert "q2" not in data.qrels  # its only relevant document was empty
    assert data.skipped["qrels_rows"] == 1


def test_training_jsonl_valid_and_folder(tmp_path):
    write_lines(tmp_path / "a.jsonl", [{"query": "q", "pos": ["p"], "neg": ["n1", "n2"], "neg_scores": [0.1, 0.2]}])
    write_lines(tmp_path / "b.jsonl", [{"query": "q2", "pos": ["p2"], "prompt": "Represent: ", "source": "x"}])
    examples, stats = load_training_data(tmp_path)
    assert [e.query for e in examples] == ["q", "q2"]
    assert examples[0].neg_scores == [0.1, 0.2] and examples[1].neg == [] and examples[1].prompt == "Represent: "
    assert examples[1].extra == {"source": "x"}
    assert stats == {"read": 2, "skipped_empty": 0}


@pytest.mark.parametrize("record, message", [
    ({"pos": ["p"]}, "line 2, field 'query': missing field 'query'"),
    ({"query": 3, "pos": ["p"]}, "field 'query': expected a string"),
    ({"query": "q", "pos": "p"}, "field 'pos': expected a list of strings, got a single string"),
    ({"query": "q"}, "field 'pos': missing field 'pos'"),
    ({"query": "q", "pos": ["p"], "neg": [1, 2]}, "field 'neg': item 0 is int"),
    ({"query": "q", "pos": ["p"], "neg": ["n"], "neg_scores": [1, 2]}, "field 'neg_scores': has 2 scores for 1"),
])
def test_training_jsonl_errors(tmp_path, record, message):
    path = write_lines(tmp_path / "train.jsonl", [{"query": "ok", "pos": ["ok"]}, record])
    with pytest.raises(DataError) as err:
        list(iter_training_examples(path))
    assert str(path) in str(err.value) and message in str(err.value)


def test_training_jsonl_empty_records_are_counted(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [{"query": " ", "pos": ["p"]}, {"query": "q", "pos": [""]},
                                                  {"query": "q", "pos": ["p"], "neg": ["", "n"]}])
    stats: dict = {}
    examples = list(iter_training_examples(path, stats))
    assert len(examples) == 1 and examples[0].neg == ["n"]
    assert stats == {"read": 3, "skipped_empty": 2}


def test_examples_from_beir(tmp_path):
    root = make_beir(tmp_path)
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td3\t1\n", encoding="utf-8")
    examples = examples_from_beir(root, "train")
    assert len(examples) == 1 and examples[0].pos == ["T1 alpha", "gamma"] and examples[0].extra["query_id"] == "q1"


def test_trec_roundtrip(tmp_path):
    run = {"q1": {"d1": 0.5, "d2": 0.9}, "q2": {"d3": 1.0}}
    write_trec_run(tmp_path / "run.trec", run)
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert lines[0].split()[:4] == ["q1", "Q0", "d2", "1"]
    assert read_trec_run(tmp_path / "run.trec") == run
    (tmp_path / "q.txt").write_text("q1 0 d1 2\nq1 0 d2 0\n")
    assert read_trec_qrels(tmp_path / "q.txt") == {"q1": {"d1": 2, "d2": 0}}
    (tmp_path / "bad.txt").write_text("q1 0 d1\n")
    with pytest.raises(DataError, match="line 1.*4 whitespace-separated"):
        read_trec_qrels(tmp_path / "bad.txt")


def test_shared_datasets_load():
    from conftest import SHARED_DATA

    if not SHARED_DATA.exists():
        pytest.skip("no ../shared/data")
    for name, split in [("scifact", "test"), ("scifact", "train"), ("cmrc2018-trial", "test"), ("lcqmc", "dev")]:
        data = load_beir(SHARED_DATA / name, split)
        assert data.queries and data.qrels and len(data.corpus) > 100


def test_bundled_dataset_matches_shared():
    from conftest import SHARED_DATA

    from robustir.resources import dataset_path

    bundled = load_beir(dataset_path("scifact"), "test")
    assert len(bundled.corpus) == 5183 and len(bundled.queries) == 300
    if (SHARED_DATA / "scifact").exists():
        shared = load_beir(SHARED_DATA / "scifact", "test")
        assert shared.corpus.ids == bundled.corpus.ids and shared.qrels == bundled.qrels


def test_document_reader_reads_gzip_text_jsonl_and_beir_folders(tmp_path):
    from robustir.data.documents import read_documents

    with gzip.open(tmp_path / "docs.txt.gz", "wt") as handle:
        handle.write("first block\nstill first\n\nsecond\n")
    assert [d.text for d in read_documents(tmp_path / "docs.txt.gz")] == ["first block\nstill first", "second"]
    beir = tmp_path / "beir"
    beir.mkdir()
    with gzip.open(beir / "corpus.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"_id": "d1", "title": "T", "text": "x"}) + "\n")
    assert [(d.id, d.title, d.text) for d in read_documents(beir)] == [("d1", "T", "x")]
    no_ids = tmp_path / "texts.jsonl.gz"
    with gzip.open(no_ids, "wt") as handle:
        handle.write(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(DataError, match="missing document id"):
        list(read_documents(no_ids))
    assert [d.id for d in read_documents(no_ids, need_ids=False)] == ["L1", "L2"]
