"""robustir.index.store (``robustir index``): the LanceDB index -- build, modes, filters, add / delete / upsert seen
by a live reader (in this process and in another one), a killed build resumed to the same table, damage named by open
and check, and the CLI."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from helpers import DOCS, QUERIES  # noqa: E402  (tests/ is on sys.path)
from robustir.cli.main import main
from robustir.errors import ConfigError, DataError
from robustir.models.encoder import Encoder
from robustir.index.store import AnnConfig, IndexConfig, SearchIndex

pytestmark = pytest.mark.usefixtures("single_torch_thread")
REPO = Path(__file__).resolve().parents[1]

LANGS = {"d1": "en", "d2": "en", "d3": "de", "d4": "fr", "d5": "en", "d6": "de"}
TOPICS = ["sleep", "coffee", "exercise", "protein", "vitamin", "sugar", "memory", "stress"]


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


def write_corpus(path: Path, n: int = 24, start: int = 0, prefix: str = "d") -> Path:
    """``n`` documents, each about one topic word (so BM25 finds it) with a year and a nested field."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(start, start + n):
            topic = TOPICS[i % len(TOPICS)]
            handle.write(json.dumps({"_id": f"{prefix}{i}", "title": f"On {topic} {i}",
                                     "text": f"A study of {topic} and health, number {i}.",
                                     "lang": ["en", "de", "fr"][i % 3], "meta": {"year": 2000 + i}}) + "\n")
    return path


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
    assert manifest["encoder"]["pooling"] == "cls" and manifest["dim"] == 32
    assert manifest["format"] == "robustir-lance-2" and manifest["job"] is None and manifest["documents"] == 6
    assert manifest["ann"]["kind"] == "exact" and not manifest["ann"]["indexed"] and index.kind == "exact"
    assert manifest["fields"] == ["lang"] and manifest["files"]
    assert all(name.startswith("lance/docs.lance/") and len(f["sha256"]) == 64 for name, f in manifest["files"].items())


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
        with pytest.raises(DataError, match=r"1 of 2 id\(s\) to delete are not in the index: 'nope'\n  Fix: check "
                                            "the ids; nothing was deleted"):
            index.delete(["d1", "nope"])
    with SearchIndex.open(tmp_path / "idx") as index:  # untouched, and no unfinished job left behind
        assert index.count == 6


@pytest.fixture()
def built(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    index, report = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.added == 24 and index.count == 24
    return index


def table_rows(index: SearchIndex) -> list[tuple]:
    """Every row (a row written twice shows twice), in id order."""
    rows = index._table.to_arrow().to_pylist()
    return sorted((r["id"], r["title"], r["text"], r["fields"], tuple(np.round(r["vector"], 6))) for r in rows)


def test_modes_return_top_k_and_lexical_finds_the_word(built):
    dense = built.search("coffee and health", top_k=5)[0]
    assert len(dense) == 5 and len({h.id for h in dense}) == 5
    lexical = built.search("coffee", top_k=10, mode="lexical")[0]
    assert {h.id for h in lexical} == {f"d{i}" for i in range(24) if TOPICS[i % 8] == "coffee"}
    hybrid = built.search("coffee", top_k=5, mode="hybrid")[0]
    assert len(hybrid) == 5 and hybrid[0].id in {h.id for h in lexical}
    assert all(a.score >= b.score for a, b in zip(hybrid, hybrid[1:]))
    with pytest.raises(ConfigError, match="top_k"):
        built.search("x", top_k=0)
    with pytest.raises(ConfigError, match="mode 'sparse'"):
        built.search("x", mode="sparse")  # type: ignore[arg-type]


def test_a_reader_follows_add_delete_and_upsert_without_reopening(built, tmp_path):
    reader = SearchIndex.open(built.path)
    assert reader.count == 24
    built.add(write_corpus(tmp_path / "more.jsonl", n=3, start=100, prefix="n"), config=quiet())
    assert reader.count == 27
    found = reader.search("vitamin", top_k=30, mode="lexical")[0]  # n100 is about vitamins
    assert "n100" in {h.id for h in found}
    built.delete(["d1", "n100"])
    assert reader.count == 25
    hits = reader.search("anything", top_k=25)[0]
    assert len(hits) == 25 and not {"d1", "n100"} & {h.id for h in hits}  # exactly top_k, none deleted
    update = tmp_path / "up.jsonl"
    update.write_text(json.dumps({"_id": "d2", "title": "Replaced", "text": "zebra crossings", "lang": "xx"}) + "\n")
    built.upsert(update, config=quiet())
    assert reader.count == 25
    zebra = reader.search("zebra", top_k=3, mode="lexical")[0]
    assert [(h.id, h.title, h.fields) for h in zebra] == [("d2", "Replaced", {"lang": "xx"})]
    with pytest.raises(DataError, match="not in the index: 'nope'"):
        built.delete(["nope"])
    with pytest.raises(DataError, match="duplicate document id 'd3' \\(already in the index\\)"):
        built.add(write_corpus(tmp_path / "dup.jsonl", n=1, start=3), config=quiet())


def test_a_reader_in_another_process_sees_each_commit(built, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'src')!r})
        from robustir.index.store import SearchIndex
        index = SearchIndex.open({str(built.path)!r})
        for line in sys.stdin:
            hits = index.search("protein", top_k=50, mode="lexical")[0]
            print(index.count, sorted(h.id for h in hits if h.id.startswith("n")), flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        def ask() -> str:
            child.stdin.write("?\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        assert ask() == "24 []"
        built.add(write_corpus(tmp_path / "more.jsonl", n=8, start=100, prefix="n"), config=quiet())
        assert ask() == "32 ['n107']"  # n107 is about protein
        built.delete(["n107"])
        assert ask() == "31 []"
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_a_killed_build_resumes_to_the_same_table(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    whole, _ = SearchIndex.build(tmp_path / "whole", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    # a real kill -9 after the second chunk was committed
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO / 'src')!r})
        from robustir.index.store import IndexConfig, SearchIndex
        def kill(position):
            if position >= 10:
                os.kill(os.getpid(), signal.SIGKILL)
        SearchIndex.build({str(tmp_path / 'killed')!r}, {tiny_model_dir!r}, {str(corpus)!r},
                         config=IndexConfig(show_progress=False, chunk_size=5), on_chunk=kill)
    """)
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    with pytest.raises(DataError, match="did not finish \\(after 10 input records\\)"):
        SearchIndex.open(tmp_path / "killed")
    resumed, report = SearchIndex.build(tmp_path / "killed", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.resumed_from == 10 and report.added == 14
    assert table_rows(resumed) == table_rows(whole)


def test_a_kill_between_the_commit_and_the_manifest_leaves_no_extra_rows(tmp_path, tiny_model_dir, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    whole, _ = SearchIndex.build(tmp_path / "whole", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    saves = {"n": 0}
    original = SearchIndex._save_job

    def save(self, job):
        saves["n"] += 1
        if saves["n"] == 4:  # the start, two chunks recorded, then the third chunk is committed but not recorded
            raise KeyboardInterrupt
        original(self, job)

    monkeypatch.setattr(SearchIndex, "_save_job", save)
    with pytest.raises(KeyboardInterrupt):
        SearchIndex.build(tmp_path / "cut", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    monkeypatch.setattr(SearchIndex, "_save_job", original)
    resumed, report = SearchIndex.build(tmp_path / "cut", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.resumed_from == 10
    assert table_rows(resumed) == table_rows(whole)  # the third chunk's rows were written once, not twice


def test_one_writer_at_a_time_and_readers_open_during_a_running_job(built, tmp_path):
    seen = []

    def during(position):
        if position == 5:
            reader = SearchIndex.open(built.path)  # the add is running: its first chunk is committed, not served
            seen.append(reader.count)  # (issue 53, item 7: readers serve the last complete state; it served 29)
            with pytest.raises(ConfigError, match="is being changed by another process"):
                SearchIndex.open(built.path, writable=True)
            reader.close()

    built.add(write_corpus(tmp_path / "more.jsonl", n=8, start=100, prefix="n"), config=quiet(chunk_size=5),
              on_chunk=during)
    assert seen == [24] and built.count == 32
    with pytest.raises(ConfigError, match="is being changed by another process"):
        SearchIndex.open(built.path, writable=True)  # ``built`` still holds the lock
    built.close()
    with SearchIndex.open(built.path, writable=True) as again:  # released by close()
        assert again.count == 32


def test_a_first_build_and_an_add_are_served_only_once_complete(tmp_path, tiny_model_dir):
    """Issue 53, item 7, on a folder: while a first build runs a reader sees no document (never 10 of 24), a reader
    that was open follows the build's end; an add killed after a committed chunk leaves the index served at its last
    complete state (24), by a reader opened after, while the add waits to be resumed -- and resumed, it is whole."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    seen, readers = [], []

    def during(position):
        if position == 10:
            readers.append(SearchIndex.open(tmp_path / "idx"))
            seen.append((readers[0].count, readers[0].search_vectors(np.ones(32, np.float32), top_k=5)[0]))

    built, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(chunk_size=5),
                                 on_chunk=during)
    assert seen == [(0, [])] and readers[0].count == 24
    more = write_corpus(tmp_path / "more.jsonl", n=8, start=100, prefix="n")

    def killed(position):
        if position == 5:
            raise KeyboardInterrupt  # a kill after the first chunk's commit: the job stays in the manifest

    with pytest.raises(KeyboardInterrupt):
        built.add(more, config=quiet(chunk_size=5), on_chunk=killed)
    built.close()  # the writer is gone (its lock released): nobody works on the add
    with SearchIndex.open(tmp_path / "idx") as replica:
        assert replica.count == 24 and not replica.get(["n100"]) and readers[0].count == 24
        with pytest.raises(DataError, match="did not finish .after 5 input records. and no process is working"):
            replica.check()  # robustir index --check names the job waiting (and fails)
        with SearchIndex.open(tmp_path / "idx", writable=True) as writer:
            assert writer.add(more, config=quiet(chunk_size=5)).resumed_from == 5
        assert replica.count == 32 and replica.get(["n100"])[0].id == "n100"
    readers[0].close()


@pytest.mark.parametrize("edit, message", [
    ({"dim": "32"}, "field 'dim' is missing or not a int"),
    ({"format": "robustir-2"}, "index format 'robustir-2'"),
    ({"documents": 99}, "holds 24 documents but its manifest says 99"),
    ({"dim": 64}, "holds 32-d vectors but the manifest says 64"),
    ({"job": {"kind": "x"}}, "its unfinished job is malformed"),
    ({"job": 7}, "field 'job' is not a dict"),
    ({"files": []}, "field 'files' is missing or not a dict"),
    ({"files": {"lance/x": 3}}, "the record of data file 'lance/x' is malformed"),
    ({"model": "m"}, "field 'model' is missing or not a dict"),
    ({"ann": {"kind": "annoy"}}, "its settings are malformed (kind: 'annoy' is not one of"),
    ({"encoder": {"pooling": "max"}}, "its settings are malformed (pooling: 'max'"),
    ({"fields": [1]}, "field 'fields' holds a non-string name"),
    ({"version": "one"}, "field 'version' is not a int"),
])
def test_a_tampered_manifest_is_named_never_a_traceback(built, edit, message):
    """An edit is refused by the manifest's digest; the same edit with the digest made again (a forgery, or a bug
    of ours) is still refused by the check of that part."""
    from robustir.index.store.manifest import _manifest_digest

    built.close()
    file = built.path / "manifest.json"
    original = json.loads(file.read_text())
    edited = {**original, **edit}
    file.write_text(json.dumps(edited))
    for writable in (False, True):  # a top-level field of the wrong type is named before the digest is compared
        with pytest.raises(DataError) as exc:
            SearchIndex.open(built.path, writable=writable)
        assert (message in str(exc.value) or "was edited after robustir wrote it" in str(exc.value)) \
            and str(built.path) in str(exc.value), str(exc.value)
    if "format" not in edit:
        file.write_text(json.dumps({**edited, "digest": _manifest_digest(edited)}))
        for writable in (False, True):
            with pytest.raises(DataError) as exc:
                SearchIndex.open(built.path, writable=writable)
            assert message in str(exc.value) and str(built.path) in str(exc.value), str(exc.value)


def test_damage_is_named_by_open_and_check(built, tmp_path, tiny_model_dir):
    path = built.path
    assert "data files verified" in built.check()
    data = sorted(p for p in (path / "lance").rglob("*.lance") if p.is_file())
    assert data
    # a row edited: one byte of a data file flipped
    victim = data[0]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    built.close()
    for writable in (False, True):  # open names it (a server never starts on it), and so does check
        with pytest.raises(DataError, match="was edited after it was written"):
            SearchIndex.open(path, writable=writable)
    victim.write_bytes(bytes(blob[:len(blob) // 3]))  # vectors truncated
    with pytest.raises(DataError, match="truncated or overwritten"):
        SearchIndex.open(path)
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))  # repaired by hand: the index opens again
    assert SearchIndex.open(path).count == 24
    # a wrong model: same architecture, other weights
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    with pytest.raises(ConfigError, match="is not the model index .* was built with"):
        SearchIndex.open(path, model=str(other))
    # the manifest gone
    (path / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json.*is missing"):
        SearchIndex.open(path)


def test_non_finite_metadata_is_refused_at_build(tmp_path, tiny_model_dir):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"_id": "a", "text": "x", "score": NaN}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 1.*not a finite number"):
        SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())


def test_filtered_search_is_exact_in_every_mode_and_hostile_filters_are_refused_or_literal(built):
    from robustir.index.store.filters import matches, parse_filter

    rows = built._table.to_arrow().to_pylist()
    records = {r["id"]: {"id": r["id"], "title": r["title"], **json.loads(r["fields"])} for r in rows}
    for flt in [{"lang": "de"}, {"meta.year": {"$gte": 2010, "$lt": 2020}}, {"lang": {"$ne": "en"}},
                {"$or": [{"lang": "fr"}, {"meta.year": {"$lt": 2003}}]}, {"id": {"$in": ["d1", "d2", "nope"]}}]:
        wanted = {i for i, rec in records.items() if matches(parse_filter(flt, ["id", "title", "lang", "meta"]), rec)}
        for mode in ("dense", "hybrid"):
            hits = built.search("health study", top_k=5, filter=flt, mode=mode)[0]
            assert {h.id for h in hits} <= wanted and len(hits) == min(5, len(wanted)), (flt, mode)
        lexical = built.search("health", top_k=30, filter=flt, mode="lexical")[0]
        assert {h.id for h in lexical} == wanted, flt  # every document says "health"
    # a value that looks like SQL is a value; the table is intact
    assert built.search("x", top_k=3, filter={"lang": "en' OR '1'='1"})[0] == []
    assert built.count == 24
    with pytest.raises(ConfigError, match="'colour' is in no document"):
        built.search("x", top_k=3, filter={"colour": "red"})
    with pytest.raises(ConfigError, match="unknown operator '\\$gtt'"):
        built.search("x", top_k=3, filter={"meta.year": {"$gtt": 1}})


def test_discard_an_interrupted_add_and_compact(built, tmp_path, caplog):
    def stop(position):
        if position >= 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        built.add(write_corpus(tmp_path / "more.jsonl", n=12, start=100, prefix="n"), config=quiet(chunk_size=5),
                  on_chunk=stop)
    assert built.count == 29  # the first chunk is committed (the writer sees it)
    assert SearchIndex.open(built.path).count == 24  # the writer still holds the lock: readers serve the last
    built.close()  # the writer is gone                   complete state (issue 53, item 7)
    with caplog.at_level("WARNING"), SearchIndex.open(built.path) as replica:  # was refused; now served, and told
        assert replica.count == 24
    assert re.search("its add of .* did not finish .* and no process is working on it", caplog.text)
    built = SearchIndex.open(built.path, writable=True)
    assert built.discard_unfinished() == 5 and built.count == 24
    assert built.discard_unfinished() == 0
    reader = SearchIndex.open(built.path)
    built.delete([f"d{i}" for i in range(10)])
    files_before = len(list((built.path / "lance").rglob("*.lance")))
    with pytest.warns(UserWarning, match="removes every version except the latest"):
        report = built.compact(keep=timedelta(0))  # no other process works on this table
    assert report.documents == 14 and reader.count == 14
    assert len(list((built.path / "lance").rglob("*.lance"))) < files_before  # merged, old versions dropped
    assert "data files verified" in SearchIndex.open(built.path).check()
    assert {h.id for h in reader.search("coffee", top_k=20, mode="lexical")[0]} == {"d17"}


def test_an_ann_index_from_the_threshold_on(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=300)
    exact, _ = SearchIndex.build(tmp_path / "exact", tiny_model_dir, corpus, config=quiet(chunk_size=100))
    index, _ = SearchIndex.build(tmp_path / "ann", tiny_model_dir, corpus, config=quiet(chunk_size=100, ann=AnnConfig(kind="auto", threshold=200)))
    assert not exact.manifest["ann"]["indexed"]
    assert index.manifest["ann"]["indexed"] and index.manifest["ann"]["kind_built"] == "ivf_hnsw_sq"
    assert "IvfHnswSq" in {i.index_type for i in index._table.list_indices()}
    hits = index.search("coffee and health", top_k=10, filter={"lang": "de"})[0]
    assert len(hits) == 10 and all(h.fields["lang"] == "de" for h in hits)
    reopened = SearchIndex.open(index.path)  # the manifest says how to search it
    assert len(reopened.search("coffee", top_k=7)[0]) == 7
    with pytest.raises(ConfigError, match="kind: 'ivf' is not one of"):
        AnnConfig(kind="ivf")  # type: ignore[arg-type]


def test_a_build_over_an_index_of_another_corpus_is_refused_not_reported_done(built, tmp_path, tiny_model_dir):
    built.close()  # the writer that built it is done
    corpus = tmp_path / "corpus.jsonl"
    again, report = SearchIndex.build(built.path, tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.nothing_to_do and again.count == 24  # the same corpus: done
    again.close()
    with open(corpus, "a", encoding="utf-8") as handle:  # the same path, edited
        handle.write(json.dumps({"_id": "late", "text": "a late document"}) + "\n")
    with pytest.raises(ConfigError, match=r"other settings or inputs than this run: input corpus \(.*corpus.jsonl\): "
                       r"content of corpus.jsonl changed.*--add / --upsert"):
        SearchIndex.build(built.path, tiny_model_dir, corpus, config=quiet(chunk_size=5))
    other = write_corpus(tmp_path / "other.jsonl", n=3)
    with pytest.raises(ConfigError, match=r'corpus: ".*corpus.jsonl" -> ".*other.jsonl"'):
        SearchIndex.build(built.path, tiny_model_dir, other, config=quiet())
    rebuilt, report = SearchIndex.build(built.path, tiny_model_dir, other, config=quiet(), overwrite=True)
    assert rebuilt.count == 3 and not report.nothing_to_do


@pytest.fixture()
def built_beir(tmp_path, beir, tiny_model_dir) -> Path:
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, beir, config=quiet())[0].close()
    return tmp_path / "idx"


def test_filters_on_the_beir_fields(built_beir):
    with SearchIndex.open(built_beir) as index:
        query = ["sleep and exercise"]
        assert {h.id for h in index.search(query, 6, {"lang": "de"})[0]} == {"d3", "d6"}
        assert {h.id for h in index.search(query, 6, {"lang": ["de", "fr"]})[0]} == {"d3", "d4", "d6"}
        assert [h.id for h in index.search(query, 6, {"title": "Coffee"})[0]] == ["d5"]
        assert [h.id for h in index.search(query, 6, {"_id": "d2", "lang": "en"})[0]] == ["d2"]
        assert index.search(query, 6, {"lang": "xx"})[0] == []
        assert {h.id for h in index.search(query, 6, {"lang": {"$ne": "en"}})[0]} == {"d3", "d4", "d6"}
        with pytest.raises(ConfigError, match="'colour' is in no document.*fields: id, title, lang"):
            index.search(query, 3, {"colour": "red"})
        with pytest.raises(ConfigError, match=r"filter\.lang\.\$eq: expected a string, a finite number"):
            index.search(query, 3, {"lang": {"$eq": {"en": 1}}})


def test_a_reader_filters_on_a_field_a_writer_added_after_it_opened(built_beir, tmp_path):
    reader = SearchIndex.open(built_beir)
    assert reader.field_names == ["lang"]
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "n1", "text": "green tea and sleep", "colour": "green"}) + "\n")
    with SearchIndex.open(built_beir, writable=True) as writer:
        writer.add(more, config=quiet())
    hits = reader.search("tea", top_k=3, filter={"colour": "green"})[0]
    assert [h.id for h in hits] == ["n1"] and reader.field_names == ["colour", "lang"]


def test_a_missing_manifest_or_folder_is_an_error(built_beir, tmp_path):
    (built_beir / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json: is missing: this folder is not a robustir index"):
        SearchIndex.open(built_beir)
    with pytest.raises(DataError, match="no index here"):
        SearchIndex.open(tmp_path / "nowhere")
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="is not a robustir index"):
        SearchIndex.open(tmp_path / "stuff")


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_build_add_upsert_delete_compact_check(tmp_path, beir, tiny_model_dir, capsys):
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
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps({"_id": "d4", "title": "Tea", "text": "green tea", "lang": "en"}) + "\n"
                       + json.dumps({"_id": "n9", "text": "a new one"}) + "\n")
    assert main(["index", "--upsert", str(changed), "--output", out]) == 0
    assert "upsert: 8 documents in the index, 2 inserted or replaced" in capsys.readouterr().out
    assert main(["index", "--delete", str(ids_file), "--delete-id", "d3", "--output", out]) == 0
    assert "delete: 5 documents in the index, 3 deleted" in capsys.readouterr().out
    assert main(["index", "--compact", "--output", out]) == 0
    assert "compact: 5 documents in the index" in capsys.readouterr().out
    assert main(["index", "--check", "--output", out]) == 0
    printed = capsys.readouterr().out
    assert "checked " in printed and "5 documents" in printed and "data files verified" in printed
    with SearchIndex.open(out) as index:
        assert [(h.id, h.title) for h in index.search("green tea", 1, mode="lexical")[0]] == [("d4", "Tea")]


@pytest.mark.parametrize("argv, message", [
    (["--output", "X"], "give one of --corpus (build), --add, --upsert"),
    (["--corpus", "C", "--add", "D", "--output", "X"], "--corpus and --add cannot go together"),
    (["--add", "D", "--ann", "auto", "--output", "IDX"], "--ann can only be set when the index is built"),
    (["--upsert", "D", "--pooling", "mean", "--output", "IDX"], "--pooling can only be set when the index is built"),
    (["--delete-id", "nope", "--output", "IDX"], "1 of 1 id(s) to delete are not in the index: 'nope'"),
    (["--corpus", "missing.jsonl", "--output", "NEW"], "missing.jsonl: file not found"),
    (["--corpus", "BEIR", "--output", "NEW", "--chunk-size", "0"], "chunk_size = 0 is out of range"),
    (["--check", "--output", "nowhere"], "nowhere: no index here"),
    (["--upsert", "BEIR", "--output", "IDX", "--overwrite"], "--overwrite goes with --corpus"),
])
def test_cli_errors_are_one_message_without_traceback(built_beir, beir, tmp_path, capsys, argv, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [{"IDX": str(built_beir), "BEIR": str(beir), "NEW": str(tmp_path / "new")}.get(a, a) for a in argv]
    assert main(["index", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robustir index: error: ") and message in err and "Traceback" not in err


def test_cli_check_names_damage_and_changes_nothing(built_beir, capsys):
    data = sorted(p for p in (built_beir / "lance").rglob("*.lance") if p.is_file())
    data[0].write_bytes(data[0].read_bytes()[:-10])
    manifest = (built_beir / "manifest.json").read_bytes()
    assert main(["index", "--check", "--output", str(built_beir)]) == 2
    err = capsys.readouterr().err
    assert "truncated or overwritten" in err and "rebuild it with --overwrite" in err and "Traceback" not in err
    assert (built_beir / "manifest.json").read_bytes() == manifest  # never repaired, never re-recorded


def test_cli_help_and_bad_flags(capsys):
    assert main(["index", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--delete-id" in help_text and "--upsert" in help_text and "--ann" in help_text
    assert main(["index", "--corpus", "c", "--output", "o", "--ann", "annoy"]) == 2
    err = capsys.readouterr().err
    assert "ann.kind: 'annoy' is not one of" in err and "Traceback" not in err


def test_ids_are_byte_exact_in_a_delete_file_and_a_nul_id_is_refused_at_build(tmp_path, tiny_model_dir, capsys):
    """Issue 35: --delete IDS_FILE stripped each line (it deleted 'sp ace' for 'sp ace '); an id with a NUL was
    built and then refused by every other command."""
    from robustir.index.store import read_id_list

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": i, "text": f"passage {n}"}) + "\n"
                              for n, i in enumerate(["sp ace", "sp ace ", " lead", "plain"])))
    out = str(tmp_path / "idx")
    assert main(["index", "--model", tiny_model_dir, "--corpus", str(corpus), "--output", out]) == 0
    ids_file = tmp_path / "ids.txt"
    ids_file.write_bytes(b"sp ace \r\n\n lead\n")
    assert read_id_list(ids_file) == ["sp ace ", " lead"]
    capsys.readouterr()
    assert main(["index", "--delete", str(ids_file), "--output", out]) == 0
    with SearchIndex.open(out) as index:
        left = {h.id for h in index.search("passage", 10, mode="lexical")[0]}
    assert left == {"sp ace", "plain"}
    nul = tmp_path / "nul.jsonl"
    nul.write_text(json.dumps({"_id": "a\u0000b", "text": "x"}) + "\n")
    assert main(["index", "--model", tiny_model_dir, "--corpus", str(nul), "--output", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "line 1, field '_id': the document id holds a NUL character" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ issue 35: integrity

def redigest(path: Path, **edit) -> None:
    """Edit the manifest and write its digest again, as a forger (or a bug of ours) would."""
    from robustir.index.store.manifest import _manifest_digest

    file = path / "manifest.json"
    manifest = {**json.loads(file.read_text()), **edit}
    file.write_text(json.dumps({**manifest, "digest": _manifest_digest(manifest)}))


def test_overwrite_builds_aside_and_swaps_while_a_reader_serves_the_old_index(built, tmp_path, tiny_model_dir):
    """Issue 35: ``--overwrite`` under a running server removed the old index at once and served the partly built new
    one (0, 5, 10 ... documents). Now readers keep the old index until the new one is complete, then follow it."""
    path = built.path
    built.close()
    reader = SearchIndex.open(path)
    old = {h.id for h in reader.search("sleep", 24, mode="lexical")[0]}
    new_corpus = write_corpus(tmp_path / "new.jsonl", n=12, start=500, prefix="n")
    seen = []

    def during(position):  # the rebuild is committing chunks: the reader still answers from the whole old index
        hits = reader.search("sleep", 24, mode="lexical")[0]
        seen.append((reader.count, {h.id for h in hits} == old))

    index, report = SearchIndex.build(path, tiny_model_dir, new_corpus, config=quiet(chunk_size=5), overwrite=True,
                                      on_chunk=during)
    assert seen and all(entry == (24, True) for entry in seen), seen
    assert report.added == 12 and index.count == 12
    assert {h.id for h in reader.search("sleep", 24, mode="lexical")[0]} <= {f"n{i}" for i in range(500, 512)}
    assert reader.count == 12  # followed the swap without a restart
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["data"] == "lance.1" and [r["data"] for r in manifest["retired"]] == ["lance"]
    assert (path / "lance").is_dir() and not (path / "building.json").exists()  # the old folder kept for a while
    index.compact(keep=timedelta(0))  # then removed by a later job
    assert not (path / "lance").exists() and json.loads((path / "manifest.json").read_text())["retired"] == []
    assert reader.count == 12 and "data files verified" in index.check()
    reader.close()
    index.close()


def test_a_killed_overwrite_leaves_the_old_index_served_and_its_rerun_resumes(built, tmp_path, tiny_model_dir):
    path = built.path
    built.close()
    new_corpus = write_corpus(tmp_path / "new.jsonl", n=12, start=500, prefix="n")

    def die(position):
        if position == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        SearchIndex.build(path, tiny_model_dir, new_corpus, config=quiet(chunk_size=5), overwrite=True, on_chunk=die)
    with SearchIndex.open(path) as reader:  # the old index, whole and checked
        assert reader.count == 24 and "data files verified" in reader.check()
    index, report = SearchIndex.build(path, tiny_model_dir, new_corpus, config=quiet(chunk_size=5), overwrite=True)
    assert report.resumed_from == 10 and index.count == 12
    index.close()
    with SearchIndex.open(path) as reader:
        assert reader.count == 12


def test_a_reader_refuses_an_index_rebuilt_with_another_model(built, tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    other = tmp_path / "other-model"
    config = BertConfig(vocab_size=AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size, hidden_size=32,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(1)
    BertModel(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    path = built.path
    built.close()
    reader = SearchIndex.open(path, model=tiny_model_dir)
    assert len(reader.search("sleep", 3)[0]) == 3
    SearchIndex.build(path, str(other), write_corpus(tmp_path / "c2.jsonl", n=6), config=quiet(),
                      overwrite=True)[0].close()
    with pytest.raises(DataError, match="(?s)was rebuilt .* with another model .*restart the server"):
        reader.search("sleep", 3)
    reader.close()


def test_missing_newest_version_files_are_refused_not_served_as_an_older_state(built, tmp_path):
    """Issue 35: with the newest ``_versions/*.manifest`` gone, check said '704 documents verified' of 1,000."""
    path = built.path
    built.add(write_corpus(tmp_path / "more.jsonl", n=6, start=100, prefix="m"), config=quiet())
    built.close()
    versions = sorted((path / "lance" / "docs.lance" / "_versions").glob("*.manifest"))
    newest = max(versions, key=lambda p: p.stat().st_mtime_ns)
    newest.unlink()
    for writable in (False, True):
        with pytest.raises(DataError, match="the newest version files .* are missing"):
            SearchIndex.open(path, writable=writable)


def test_a_forged_manifest_is_refused_by_what_it_forged(built):
    """Issue 35: ``"files": {}`` let --check bless a truncated data file; a hand-written unfinished job with id 1
    made --discard-unfinished delete the whole build; edited encoder settings were trusted."""
    path = built.path
    built.close()
    good = (path / "manifest.json").read_text()
    encoder = {**json.loads(good)["encoder"], "query_max_length": 2, "normalize": False}
    (path / "manifest.json").write_text(json.dumps({**json.loads(good), "encoder": encoder}))
    with pytest.raises(DataError, match="was edited after robustir wrote it"):
        SearchIndex.open(path)
    for edit, message in (({"files": {}}, "but no data file"),
                          ({"job": {"id": 1, "kind": "add", "input": "x", "position": 0}}, "next job's id is")):
        (path / "manifest.json").write_text(good)
        redigest(path, **edit)
        for writable in (False, True):
            with pytest.raises(DataError, match=message):
                SearchIndex.open(path, writable=writable)
    (path / "manifest.json").write_text(good)
    with SearchIndex.open(path) as index:
        assert index.count == 24


def test_a_table_changed_outside_robustir_is_refused(built):
    built._table.delete("id = 'd3'")  # a Lance commit the manifest does not know of
    path = built.path
    built.close()
    with pytest.raises(DataError, match="changed outside robustir"):
        SearchIndex.open(path)


def test_a_large_delete_is_one_commit(tmp_path, tiny_model_dir):
    """Issue 35: a delete of more than 500 ids was several commits; killed midway it stayed half-applied."""
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, write_corpus(tmp_path / "c.jsonl", n=1300),
                                 config=quiet(chunk_size=2000))
    before = index.version
    report = index.delete([f"d{i}" for i in range(1200)])
    assert report.deleted == 1200 and index.count == 100
    assert index.version == before + 1  # one Lance commit (was three)
    index.close()


def test_an_index_built_with_a_relative_model_path_opens_from_another_folder(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 35: a manifest keeping a relative model path was refused from another folder as 'not a hub model'."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    corpus = write_corpus(tmp_path / "c.jsonl", n=6)
    monkeypatch.chdir(tmp_path)
    SearchIndex.build("idx", "models/tiny", corpus, config=quiet())[0].close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with SearchIndex.open(tmp_path / "idx") as index:
        assert len(index.search("sleep", 3)[0]) == 3


def test_a_field_whose_name_begins_with_a_dollar_is_filtered_with_one_more_dollar(tmp_path, tiny_model_dir):
    """Issue 35 ('unclear'): a field named '$price' could not be filtered (a top-level '$' key is an operator)."""
    from robustir.index.store.filters import matches, parse_filter

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"study {i}", "$price": i, "meta": {"$oid": str(i)}})
                              + "\n" for i in range(6)))
    with SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())[0] as index:
        for mode in ("dense", "lexical"):
            hits = index.search("study", 6, {"$$price": {"$gte": 4}}, mode=mode)[0]
            assert sorted(h.id for h in hits) == ["d4", "d5"], mode
        assert [h.id for h in index.search("study", 6, {"meta.$oid": "2"})[0]] == ["d2"]
        with pytest.raises(ConfigError, match="a field named '\\$price' is written '\\$\\$price'"):
            index.search("study", 6, {"$price": 3})
    parsed = parse_filter({"$$price": 3}, ["$price"])
    assert matches(parsed, {"$price": 3}) and not matches(parsed, {"$price": 4})


def test_a_delete_killed_after_its_commit_leaves_a_servable_index_that_the_next_writer_records(built, monkeypatch):
    """A delete is recorded as a job before its one commit: killed after the commit (before the manifest), readers
    still open the index (the table is whole: before or after), and the next writer records it."""
    path = built.path

    def killed(self, keep=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(SearchIndex, "_finish_job", killed)
    with pytest.raises(KeyboardInterrupt):
        built.delete(["d1", "d2"])
    monkeypatch.undo()
    built.close()
    with SearchIndex.open(path) as reader:
        assert reader.count == 22
    with SearchIndex.open(path, writable=True) as writer:
        assert writer.manifest["job"] is None and writer.manifest["documents"] == 22
        assert "data files verified" in writer.check()


def test_the_index_records_its_precision_and_the_server_encodes_queries_in_it(tmp_path, tiny_model_dir, caplog):
    """Issue 36: documents encoded in one precision, queries in another, gave 37/50 exact top-10. The manifest says
    what the documents were encoded in; a later job keeps it (auto) or is refused (another, explicitly); the server
    encodes queries in it (auto), or says what --precision costs."""
    import logging

    from robustir.serving.app import create_app
    from robustir.serving.config import ServeConfig

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(precision="fp32"))
    assert index.manifest["precision"] == "fp32"
    more = write_corpus(tmp_path / "more.jsonl", n=3, start=100, prefix="m")
    with pytest.raises(ConfigError, match="encoded in fp32; adding others in bf16 would mix two precisions.*"
                                          "--precision fp32"):
        index.add(more, config=quiet(precision="bf16"))
    index.add(more, config=quiet())  # auto: the recorded one
    assert index.manifest["precision"] == "fp32" and index.count == 27
    index.close()
    app = create_app(None, tmp_path / "idx", ServeConfig(precision="auto"))
    assert app.state.server.precision == "fp32"  # whatever auto means on this CPU: the documents' precision
    with caplog.at_level(logging.WARNING, logger="robustir"):
        app = create_app(None, tmp_path / "idx", ServeConfig(precision="bf16"))
    assert app.state.server.precision == "bf16" and "was encoded in fp32; queries are encoded in bf16" in caplog.text


def test_a_filter_whose_value_kind_no_document_holds_is_refused_naming_the_field(tmp_path, tiny_model_dir):
    """Issue 36: a numeric range on a string field silently returned 0 hits. The index records the JSON kinds each
    field path holds; a test that can match nothing because of them is a ConfigError (400 over HTTP) naming the
    field and the fix. Mixed kinds, $ne, null tests and indexes built before the kinds were recorded pass as before."""
    corpus = tmp_path / "kinds.jsonl"
    rows = [{"_id": f"k{i}", "text": f"doc {i}", "year": str(2018 + i), "mixed": i if i % 2 else str(i),
             "meta": {"pages": i * 10}} for i in range(6)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())
    assert index.manifest["field_kinds"]["year"] == ["string"] and index.manifest["field_kinds"]["meta.pages"] == \
        ["number"] and index.manifest["field_kinds"]["mixed"] == ["number", "string"]
    with pytest.raises(ConfigError, match=r"filter.year.\$gt: 'year' holds string values in this index, so comparing "
                                          r"it with a number \(2020\) matches no document; compare it with a string"):
        index.search("doc", filter={"year": {"$gt": 2020}})
    with pytest.raises(ConfigError, match=r"filter.meta.pages.\$eq: 'meta.pages' holds number values"):
        index.search("doc", filter={"meta.pages": "10"})
    with pytest.raises(ConfigError, match="'id' holds string values"):
        index.search("doc", filter={"id": {"$in": [1, 2]}})
    assert len(index.search("doc", top_k=6, filter={"year": {"$gt": "2020"}})[0]) == 3
    assert len(index.search("doc", top_k=6, filter={"mixed": {"$gte": 3}})[0]) == 2  # numbers 3, 5
    assert len(index.search("doc", top_k=6, filter={"year": {"$ne": 2020}})[0]) == 6  # $ne: matches by design
    assert len(index.search("doc", top_k=6, filter={"year": None})[0]) == 0
    index.close()


# ------------------------------------------------------------------------------------------------ typed columns

def write_typed_corpus(path: Path, n: int = 30) -> Path:
    """Documents with a string, an int, a float, a bool and a mixed field, one of them now and then missing."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            record = {"_id": f"d{i}", "title": f"On {TOPICS[i % len(TOPICS)]} {i}",
                      "text": f"A study of {TOPICS[i % len(TOPICS)]}, number {i}.", "lang": ["en", "de", "fr"][i % 3],
                      "year": 1990 + i, "score": i / 4, "open": i % 2 == 0, "mixed": i if i % 2 else str(i),
                      "meta": {"year": 2000 + i}}
            if i % 7 == 3:
                del record["year"]
            handle.write(json.dumps(record) + "\n")
    return path


def test_top_level_fields_of_one_kind_get_typed_indexed_columns_and_filter_exactly(tmp_path, tiny_model_dir):
    from robustir.index.store.filters import matches, parse_filter

    corpus = write_typed_corpus(tmp_path / "corpus.jsonl")
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(chunk_size=8))
    with index:
        columns = index.manifest["columns"]
        assert {name: entry["kind"] for name, entry in columns.items()} == {
            "lang": "string", "open": "bool", "score": "float", "year": "int"}  # mixed and the nested meta stay JSON
        assert {name: entry.get("index") for name, entry in columns.items()} == {
            "lang": "BITMAP", "open": "BITMAP", "score": "BTREE", "year": "BTREE"}
        table_columns = set(index._table.schema.names)
        assert {entry["column"] for entry in columns.values()} <= table_columns
        records = [json.loads(line) for line in corpus.read_text().splitlines()]
        fields = ["id", "title", *index.field_names]
        for obj in ({"lang": "de"}, {"year": {"$gte": 2005}}, {"year": None}, {"score": {"$lt": 2.5}},
                    {"open": True}, {"$or": [{"lang": "fr"}, {"score": 7.0}]}, {"mixed": {"$gt": 10}},
                    {"year": {"$exists": False}}, {"meta.year": {"$lt": 2010}}, {"lang": {"$ne": "en"}, "open": False}):
            f = parse_filter(obj, fields)
            expected = sorted(r["_id"] for r in records if matches(f, {"id": r["_id"], "title": r["title"], **{
                k: v for k, v in r.items() if k not in ("_id", "title", "text")}}))
            hits = index.search("a study", top_k=30, filter=obj)[0]
            assert sorted(h.id for h in hits) == expected, obj
        assert index._where({"lang": "de"}) == "coalesce(t0 = 'de', false)"  # columns t0.. in the fields' order
        assert "fields" not in index._where({"year": {"$gte": 2005}})  # the typed column, not the JSON


def test_an_upsert_whose_value_does_not_fit_moves_the_field_back_to_json_and_stays_exact(tmp_path, tiny_model_dir):
    corpus = write_typed_corpus(tmp_path / "corpus.jsonl", n=12)
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())
    index.close()
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "new", "title": "t", "text": "a study of year strings", "year": "MMXX"}) + "\n"
                    + json.dumps({"_id": "d1", "title": "t", "text": "replaced", "year": 1991, "lang": "de"}) + "\n")
    writer = SearchIndex.open(tmp_path / "idx", writable=True, model=tiny_model_dir)
    writer.upsert(more, config=quiet())
    writer.close()
    reader = SearchIndex.open(tmp_path / "idx")
    with reader:
        assert reader.manifest["columns"]["year"]["usable"] is False and "year" not in reader.typed_columns
        assert "lang" in reader.typed_columns  # the values that fit keep their column
        assert [h.id for h in reader.search("study", top_k=20, filter={"year": "MMXX"})[0]] == ["new"]
        assert sorted(h.id for h in reader.search("study", top_k=20, filter={"year": {"$lt": 1993}})[0]) == \
            ["d0", "d1", "d2"]
        assert "fields" in reader._where({"year": 1991})  # read from the JSON column now
        assert sorted(h.id for h in reader.search("study", top_k=20, filter={"lang": "de"})[0]) == \
            ["d1", "d10", "d4", "d7"]


def test_a_field_name_sql_could_not_hold_is_filtered_through_its_typed_column(tmp_path, tiny_model_dir):
    # the column is named by the index (t0, t1, ...): the field's name never reaches the SQL, not even quoted
    name = "x') OR 1=1 -- it's"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"a study {i}", name: ["a", "b"][i % 2]}) + "\n"
                              for i in range(6)))
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())
    with index:
        assert index.typed_columns == {name: ("t0", "string")}
        where = index._where({name: "b"})
        assert where == "coalesce(t0 = 'b', false)" and "OR 1=1" not in where
        assert sorted(h.id for h in index.search("study", top_k=6, filter={name: "b"})[0]) == ["d1", "d3", "d5"]


# ------------------------------------------------------------------------------------------------ issue 51: the pool

def test_an_engine_pool_is_given_to_the_index_and_used_for_every_chunk(tmp_path, tiny_model_dir):
    """``engine: ray`` splits chunks among a pool the caller gives (``encoder_pool``; the CLI gives Ray's): the index
    imports no engine. A fake pool here (Ray is not needed to check the protocol): it encodes every chunk, is closed
    at the end, and the table holds the vectors a build in this process makes. Without one: refused before anything
    is written."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=10)
    made = []

    class Pool:
        def __init__(self, encoder, config):
            self.encoder, self.chunks, self.closed = encoder, [], False
            made.append(self)

        def encode(self, texts, kind, *, batch_size, precision):
            self.chunks.append(len(texts))
            return self.encoder.encode(texts, kind, batch_size=batch_size, precision=precision, show_progress=False)

        def close(self):
            self.closed = True

    config = IndexConfig(chunk_size=4, precision="fp32", show_progress=False, engine="ray")
    with pytest.raises(ConfigError, match="encodes with a pool the caller gives"):
        SearchIndex.build(tmp_path / "none", tiny_model_dir, corpus, config=config)
    assert not (tmp_path / "none").exists()
    pooled, _ = SearchIndex.build(tmp_path / "pooled", tiny_model_dir, corpus, config=config, encoder_pool=Pool)
    here, _ = SearchIndex.build(tmp_path / "here", tiny_model_dir, corpus,
                                config=IndexConfig(chunk_size=4, precision="fp32", show_progress=False))
    assert len(made) == 1 and made[0].chunks == [4, 4, 2] and made[0].closed
    with pooled, here:
        a, b = (i._table.to_arrow().sort_by("id") for i in (pooled, here))
        assert a.column("id").to_pylist() == b.column("id").to_pylist()
        np.testing.assert_allclose(np.stack(a.column("vector").to_numpy(False)),
                                   np.stack(b.column("vector").to_numpy(False)), atol=1e-5)


def test_a_corpus_record_brings_its_own_vector(tmp_path, tiny_model_dir):
    """Issue 55, item 2 (the index side): a record's "vector" is stored as its vector (not encoded, not a field);
    one of another dimension or with a non-number is refused naming its line and the field, before the index
    changes (an add) or when its chunk is reached (a build: it reads the corpus before the model)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=6)
    index, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))
    index.close()
    writer = SearchIndex.open(tmp_path / "idx", writable=True, model=tiny_model_dir)
    own = np.zeros(writer.dim, dtype=np.float32)
    own[0] = 1.0
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"_id": "mine", "text": "my own vector", "vector": own.tolist(), "lang": "en"}) + "\n")
    writer.add(extra, config=IndexConfig(show_progress=False))
    hit = writer.search_vectors(own[None, :], top_k=1)[0][0]
    assert hit.id == "mine" and hit.score == pytest.approx(1.0, abs=1e-6) and hit.fields == {"lang": "en"}
    for vector, words in ((own.tolist()[:-1], f"has {writer.dim - 1} numbers"), ([*own.tolist()[:-1], "x"],
                                                                                  "not a finite number")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"_id": "ok", "text": "fine"}) + "\n"
                       + json.dumps({"_id": "b", "text": "t", "vector": vector}) + "\n")
        with pytest.raises(DataError, match=words) as caught:
            writer.add(bad, config=IndexConfig(show_progress=False))
        assert caught.value.line == 2 and caught.value.field == "vector"
    assert writer.count == 7
    writer.close()
