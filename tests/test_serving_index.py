"""robustir.serving.index (``robustir index``): build, resume, add, delete, filters, integrity checks, CLI."""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from helpers import DOCS, QUERIES  # noqa: E402  (tests/ is on sys.path)
from robustir.cli.main import main
from robustir.errors import ConfigError, DataError
from robustir.index.dense import DenseIndexConfig
from robustir.models.encoder import Encoder
from robustir.serving import index as index_module
from robustir.serving.index import IndexConfig, SearchIndex

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LANGS = {"d1": "en", "d2": "en", "d3": "de", "d4": "fr", "d5": "en", "d6": "de"}


def write_beir(root: Path) -> Path:
    """A BEIR folder of helpers.DOCS / QUERIES (query i is about document i) whose documents carry a ``lang`` field."""
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x, "lang": LANGS[i]}) + "\n"
                                               for i, t, x in DOCS), encoding="utf-8")
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES),
                                        encoding="utf-8")
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{i}\t1\n" for i in range(1, 5)), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir)


@pytest.fixture()
def beir(tmp_path) -> Path:
    return write_beir(tmp_path / "beir")


def quiet(**kwargs) -> IndexConfig:
    return IndexConfig(show_progress=False, **kwargs)


def brute_force(encoder, queries: list[str], k: int) -> list[list[tuple[str, float]]]:
    texts = [f"{t} {x}" for _, t, x in DOCS]
    docs = encoder.encode(texts, "passage")
    scores = encoder.encode(queries, "query") @ docs.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[(DOCS[j][0], float(scores[i, j])) for j in row] for i, row in enumerate(order)]


def ids(hits) -> list[list[str]]:
    return [[h.id for h in row] for row in hits]


# ------------------------------------------------------------------------------------------------ build and search

def test_build_searches_like_brute_force_and_writes_a_manifest(tmp_path, beir, tiny_model_dir, encoder):
    index, report = SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet(chunk_size=4))
    with index:
        assert report.added == 6 and report.documents == 6 and index.count == 6
        queries = [q for _, q in QUERIES]
        hits = index.search(queries, top_k=6)
        expected = brute_force(encoder, queries, 6)
        assert ids(hits) == [[d for d, _ in row] for row in expected]
        for row, want in zip(hits, expected):
            np.testing.assert_allclose([h.score for h in row], [s for _, s in want], rtol=0, atol=1e-5)
        first = hits[0][0]
        assert first.title and first.text and first.fields == {"lang": LANGS[first.id]}
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["model"]["path"] == str(Path(tiny_model_dir).resolve())
    assert "model.safetensors" in manifest["model"]["digest"]
    assert manifest["encoder"]["pooling"] == "cls" and manifest["dimension"] == 32
    assert manifest["index"]["kind"] == "flat" and manifest["index"]["deletes"] == "remove_ids"
    assert manifest["counts"] == {"documents": 6, "vectors": 6, "tombstones": 0}
    assert set(manifest["files"]) == {"index-000001.faiss", "meta.sqlite"}
    assert all(f["sha256"].startswith("sha256:") for f in manifest["files"].values())
    assert manifest["robustir_version"] and manifest["fields"] == ["lang"]


def test_plain_text_and_gzipped_jsonl_corpora(tmp_path, tiny_model_dir):
    text = tmp_path / "passages.txt.gz"
    with gzip.open(text, "wt", encoding="utf-8") as handle:
        handle.write("first passage about cats\n\nsecond passage about dogs\nthird about fish\n")
    with SearchIndex.build(tmp_path / "t", tiny_model_dir, text, config=quiet())[0] as index:
        hits = index.search("dogs", top_k=3)[0]
        assert sorted(h.id for h in hits) == ["0", "1", "2"]  # ids: 0-based line numbers of non-empty lines
        assert {h.text for h in hits} == {"first passage about cats", "second passage about dogs", "third about fish"}
    records = tmp_path / "passages.jsonl.gz"
    with gzip.open(records, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": 7, "text": "a passage", "doc_id": "D1", "start": 0}) + "\n")
        handle.write(json.dumps({"id": 8, "title": "", "text": "   "}) + "\n")  # empty: skipped, as load_corpus does
    index, report = SearchIndex.build(tmp_path / "p", tiny_model_dir, records, config=quiet())
    with index:
        assert report.skipped_empty == 1 and index.count == 1
        assert index.search("passage", top_k=5)[0][0].fields == {"doc_id": "D1", "start": 0}


def test_filters_select_in_sqlite_exactly_or_through_a_faiss_selector(tmp_path, beir, tiny_model_dir, monkeypatch):
    with SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0] as index:
        query = ["sleep and exercise"]
        assert {h.id for h in index.search(query, 6, {"lang": "de"})[0]} == {"d3", "d6"}
        assert {h.id for h in index.search(query, 6, {"lang": ["de", "fr"]})[0]} == {"d3", "d4", "d6"}
        assert [h.id for h in index.search(query, 6, {"title": "Coffee"})[0]] == ["d5"]
        assert [h.id for h in index.search(query, 6, {"id": "d2", "lang": "en"})[0]] == ["d2"]
        assert index.search(query, 6, {"lang": "xx"})[0] == []
        exact = index.search(query, 2, {"lang": "en"})[0]
        monkeypatch.setattr(index_module, "EXACT_FILTER_LIMIT", 0)  # the FAISS ID-selector path
        selected = index.search(query, 2, {"lang": "en"})[0]
        assert [h.id for h in selected] == [h.id for h in exact]
        np.testing.assert_allclose([h.score for h in selected], [h.score for h in exact], atol=1e-5)
        with pytest.raises(ConfigError, match="'colour' is in no document.*fields: id, title, lang"):
            index.search(query, 3, {"colour": "red"})
        assert {h.id for h in index.search(query, 6, {"lang": {"$ne": "en"}})[0]} == {"d3", "d4", "d6"}
        with pytest.raises(ConfigError, match=r"filter\.lang\.\$eq: expected a string, a finite number"):
            index.search(query, 3, {"lang": {"$eq": {"en": 1}}})
        with pytest.raises(ConfigError, match="top_k"):
            index.search(query, 0)


# ------------------------------------------------------------------------------------------------ resume

class Killed(Exception):
    pass


def test_a_killed_build_resumes_where_it_stopped(tmp_path, beir, tiny_model_dir, monkeypatch):
    encoder = Encoder.from_pretrained(tiny_model_dir)
    encoded: list[int] = []
    original = Encoder.encode

    def counting(self, texts, kind="passage", **kwargs):
        if kind == "passage":
            encoded.append(len(texts))
        return original(self, texts, kind, **kwargs)

    monkeypatch.setattr(Encoder, "encode", counting)

    def kill_after_first_chunk(position: int) -> None:
        raise Killed(position)

    with pytest.raises(Killed):
        SearchIndex.build(tmp_path / "idx", encoder, beir, config=quiet(chunk_size=2), on_chunk=kill_after_first_chunk)
    assert encoded == [2]
    with pytest.raises(DataError, match="unfinished: a build of .* stopped after 2 input records"):
        SearchIndex.open(tmp_path / "idx")
    with pytest.raises(ConfigError, match="unfinished build .* other settings.*kind"):
        SearchIndex.build(tmp_path / "idx", encoder, beir, config=quiet(chunk_size=2, index=DenseIndexConfig(kind="hnsw")))
    index, report = SearchIndex.build(tmp_path / "idx", encoder, beir, config=quiet(chunk_size=2))
    assert encoded == [2, 2, 2] and report.resumed_from == 2 and report.added == 4
    index.close()
    with SearchIndex.build(tmp_path / "whole", encoder, beir, config=quiet(chunk_size=100))[0] as whole, \
            SearchIndex.open(tmp_path / "idx", model=encoder) as resumed:
        queries = [q for _, q in QUERIES]
        a, b = whole.search(queries, 6), resumed.search(queries, 6)
        assert ids(a) == ids(b)
        np.testing.assert_allclose([[h.score for h in r] for r in a], [[h.score for h in r] for r in b], atol=1e-5)
    again, report = SearchIndex.build(tmp_path / "idx", encoder, beir, config=quiet(chunk_size=2))
    again.close()
    assert report.nothing_to_do


def test_a_kill_between_the_faiss_file_and_the_commit_leaves_the_old_generation(tmp_path, beir, tiny_model_dir,
                                                                                 monkeypatch):
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0].close()
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "n1", "text": "a new note on coffee and sleep"}) + "\n")
    original = SearchIndex._set_state

    def crash_on_commit(self, key, value):
        if key == "generation":
            raise Killed("after the FAISS file was written, before the commit")
        return original(self, key, value)

    with SearchIndex.open(tmp_path / "idx", writable=True) as index:
        monkeypatch.setattr(SearchIndex, "_set_state", crash_on_commit)
        with pytest.raises(Killed):
            index.add(more, config=quiet())
        monkeypatch.setattr(SearchIndex, "_set_state", original)
    assert (tmp_path / "idx" / "index-000002.faiss").exists()  # written, never committed
    with pytest.raises(DataError, match="unfinished: an add"):
        SearchIndex.open(tmp_path / "idx")
    with SearchIndex.open(tmp_path / "idx", writable=True) as index:
        assert not (tmp_path / "idx" / "index-000002.faiss").exists()  # the stale generation is dropped
        report = index.add(more, config=quiet())
        assert report.added == 0 and report.documents == 7  # the committed chunk is not encoded again
    with SearchIndex.open(tmp_path / "idx") as index:
        assert index.count == 7 and index.manifest["counts"]["vectors"] == 7
        assert index.search("coffee sleep note", 1, {"id": "n1"})[0][0].id == "n1"


def test_an_interrupted_save_is_reported_and_finished_by_check(tmp_path, beir, tiny_model_dir, monkeypatch):
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0].close()
    with SearchIndex.open(tmp_path / "idx", writable=True) as index:
        monkeypatch.setattr(SearchIndex, "_write_manifest", lambda self: (_ for _ in ()).throw(Killed("manifest")))
        with pytest.raises(Killed):
            index.delete(["d2"])
        monkeypatch.undo()
    with pytest.raises(DataError, match="(?s)stopped while saving.*--check"):
        SearchIndex.open(tmp_path / "idx")
    assert main(["index", "--check", "--output", str(tmp_path / "idx")]) == 0
    with SearchIndex.open(tmp_path / "idx") as index:
        assert index.count == 5


# ------------------------------------------------------------------------------------------------ add and delete

@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_add_and_delete_without_a_rebuild(tmp_path, beir, tiny_model_dir, kind):
    config = quiet(index=DenseIndexConfig(kind=kind))
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"_id": f"n{i}", "text": f"new note {i} about tea", "lang": "it"}) + "\n"
                            for i in range(3)))
    with SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=config)[0] as index:
        report = index.add(more, config=config)
        assert report.added == 3 and index.count == 9
        assert {h.id for h in index.search("tea", 9)[0]} == {d for d, _, _ in DOCS} | {"n0", "n1", "n2"}
        assert {h.id for h in index.search("tea", 9, {"lang": "it"})[0]} == {"n0", "n1", "n2"}
        before = index.search("tea", 9)[0]
        index.delete(["n1", "d2"])
        after = index.search("tea", 9)[0]
        assert {h.id for h in after} == {h.id for h in before} - {"n1", "d2"}
        assert len(after) == 7
    with SearchIndex.open(tmp_path / "idx", model=tiny_model_dir) as index:
        counts = index.manifest["counts"]
        assert counts["documents"] == 7
        assert counts["tombstones"] == (2 if kind == "hnsw" else 0)
        assert counts["vectors"] == (9 if kind == "hnsw" else 7)
        assert "n1" not in {h.id for h in index.search("tea", 9)[0]}
    if kind == "hnsw":  # FAISS cannot remove from HNSW: tombstones until compacted
        with SearchIndex.open(tmp_path / "idx", writable=True) as index:
            index.compact()
        with SearchIndex.open(tmp_path / "idx") as index:
            assert index.manifest["counts"] == {"documents": 7, "vectors": 7, "tombstones": 0}
            assert {h.id for h in index.search("tea", 9)[0]} == {h.id for h in after}


def test_bad_input_is_refused_before_anything_changes(tmp_path, beir, tiny_model_dir):
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0].close()
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps({"_id": "n1", "text": "new"}) + "\n" + json.dumps({"_id": "d4", "text": "again"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"_id": "n1", "text": "new"}) + "\n{not json\n")
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"_id": "n1", "text": "a"}) + "\n" + json.dumps({"_id": "n1", "text": "b"}) + "\n")
    with SearchIndex.open(tmp_path / "idx", writable=True) as index:
        with pytest.raises(DataError, match=r"dup.jsonl, line 2, field '_id': duplicate document id 'd4' \(already"):
            index.add(dup, config=quiet())
        with pytest.raises(DataError, match=r"bad.jsonl, line 2: invalid JSON"):
            index.add(bad, config=quiet())
        with pytest.raises(DataError, match=r"twice.jsonl, line 2, field '_id': duplicate document id 'n1' \(also on "
                                            r"line 1\)"):
            index.add(twice, config=quiet())
        with pytest.raises(DataError, match=r"1 of 2 id\(s\) to delete are not in the index: 'nope'; nothing was "
                                            "deleted"):
            index.delete(["d1", "nope"])
    with SearchIndex.open(tmp_path / "idx") as index:  # untouched, and no unfinished job left behind
        assert index.count == 6


# ------------------------------------------------------------------------------------------------ integrity

@pytest.fixture()
def built(tmp_path, beir, tiny_model_dir) -> Path:
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0].close()
    return tmp_path / "idx"


def test_a_truncated_faiss_file_is_an_error(built):
    faiss_file = built / "index-000001.faiss"
    faiss_file.write_bytes(faiss_file.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"index-000001.faiss: has \d+ bytes; the manifest says \d+ \(truncated"):
        SearchIndex.open(built)


def test_an_edited_metadata_store_is_an_error(built):
    with sqlite3.connect(built / "meta.sqlite") as db:
        db.execute("UPDATE docs SET text = 'something else' WHERE doc_id = 'd1'")
    db.close()
    with pytest.raises(DataError, match="meta.sqlite: content differs from its checksum in the manifest"):
        SearchIndex.open(built)


def test_another_model_than_the_manifest_says_is_an_error(built, minilm_path):
    with pytest.raises(ConfigError, match=r"was built with model .*tiny-bert.*, not .*content of .* changed"):
        SearchIndex.open(built, model=minilm_path)


def test_counts_that_do_not_add_up_are_an_error(built):
    manifest = json.loads((built / "manifest.json").read_text())
    manifest["counts"]["documents"] = 5
    (built / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="counts do not match: the manifest says 5 documents, the metadata holds 6"):
        SearchIndex.open(built)


def test_a_missing_manifest_or_folder_is_an_error(built, tmp_path):
    (built / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json: missing"):
        SearchIndex.open(built)
    with pytest.raises(DataError, match="no index here"):
        SearchIndex.open(tmp_path / "nowhere")
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="is not a robustir index"):
        SearchIndex.open(tmp_path / "stuff")


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_build_add_delete_check(tmp_path, beir, tiny_model_dir, capsys):
    out = str(tmp_path / "idx")
    assert main(["index", "--model", tiny_model_dir, "--corpus", str(beir), "--output", out, "--chunk-size", "4"]) == 0
    assert "build: 6 documents in the index, 6 added" in capsys.readouterr().out
    assert main(["index", "--model", tiny_model_dir, "--corpus", str(beir), "--output", out]) == 0
    assert "is complete; nothing to do" in capsys.readouterr().out
    more = tmp_path / "more.txt"
    more.write_text("one more passage\n")
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("d1\n\nd2\n")
    assert main(["index", "--add", str(more), "--output", out, "--format", "text"]) == 0
    assert "add: 7 documents in the index, 1 added" in capsys.readouterr().out
    assert main(["index", "--delete", str(ids_file), "--delete-id", "d3", "--output", out]) == 0
    assert "delete: 4 documents in the index, 3 deleted" in capsys.readouterr().out
    assert main(["index", "--check", "--output", out]) == 0
    assert "checked (checksums, counts, dimension)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--output", "X"], "give one of --corpus (build), --add"),
    (["--corpus", "C", "--add", "D", "--output", "X"], "--corpus and --add cannot go together"),
    (["--add", "D", "--index", "ivf", "--output", "IDX"], "--index can only be set when the index is built"),
    (["--delete-id", "nope", "--output", "IDX"], "1 of 1 id(s) to delete are not in the index: 'nope'"),
    (["--corpus", "missing.jsonl", "--output", "NEW"], "missing.jsonl: file not found"),
    (["--corpus", "BEIR", "--output", "NEW", "--chunk-size", "0"], "chunk_size = 0 is out of range"),
    (["--check", "--output", "nowhere"], "nowhere: no index here"),
])
def test_cli_errors_are_one_message_without_traceback(built, beir, tmp_path, capsys, argv, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [{"IDX": str(built), "BEIR": str(beir), "NEW": str(tmp_path / "new")}.get(a, a) for a in argv]
    assert main(["index", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robustir index: error: ") and message in err and "Traceback" not in err


def test_cli_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["index", "--help"])
    assert exc.value.code == 0 and "--delete-id" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["index", "--corpus", "c", "--output", "o", "--index", "annoy"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice: 'annoy'" in err and "Traceback" not in err
