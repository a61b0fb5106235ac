"""robustir.serving.lance_store: the LanceDB index -- build, modes, add / delete / upsert seen by a live reader (in
this process and in another one), a killed build resumed to the same table, damage named by open / check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lancedb")

from robustir.errors import ConfigError, DataError  # noqa: E402
from robustir.serving.index import IndexConfig  # noqa: E402
from robustir.serving.lance_store import LanceIndex  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")
REPO = Path(__file__).resolve().parents[1]

TOPICS = ["sleep", "coffee", "exercise", "protein", "vitamin", "sugar", "memory", "stress"]


def write_corpus(path: Path, n: int = 24, start: int = 0, prefix: str = "d") -> Path:
    """``n`` documents, each about one topic word (so BM25 finds it) with a year and a nested field."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(start, start + n):
            topic = TOPICS[i % len(TOPICS)]
            handle.write(json.dumps({"_id": f"{prefix}{i}", "title": f"On {topic} {i}",
                                     "text": f"A study of {topic} and health, number {i}.",
                                     "lang": ["en", "de", "fr"][i % 3], "meta": {"year": 2000 + i}}) + "\n")
    return path


def quiet(**kwargs) -> IndexConfig:
    return IndexConfig(show_progress=False, **kwargs)


@pytest.fixture()
def built(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    index, report = LanceIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.added == 24 and index.count == 24
    return index


def table_rows(index: LanceIndex) -> list[tuple]:
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
    reader = LanceIndex.open(built.path)
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
        from robustir.serving.lance_store import LanceIndex
        index = LanceIndex.open({str(built.path)!r})
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
    whole, _ = LanceIndex.build(tmp_path / "whole", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    # a real kill -9 after the second chunk was committed
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO / 'src')!r})
        from robustir.serving.index import IndexConfig
        from robustir.serving.lance_store import LanceIndex
        def kill(position):
            if position >= 10:
                os.kill(os.getpid(), signal.SIGKILL)
        LanceIndex.build({str(tmp_path / 'killed')!r}, {tiny_model_dir!r}, {str(corpus)!r},
                         config=IndexConfig(show_progress=False, chunk_size=5), on_chunk=kill)
    """)
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    with pytest.raises(DataError, match="did not finish \\(after 10 input records\\)"):
        LanceIndex.open(tmp_path / "killed")
    resumed, report = LanceIndex.build(tmp_path / "killed", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.resumed_from == 10 and report.added == 14
    assert table_rows(resumed) == table_rows(whole)


def test_a_kill_between_the_commit_and_the_manifest_leaves_no_extra_rows(tmp_path, tiny_model_dir, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    whole, _ = LanceIndex.build(tmp_path / "whole", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    saves = {"n": 0}
    original = LanceIndex._save_job

    def save(self, job):
        saves["n"] += 1
        if saves["n"] == 4:  # the start, two chunks recorded, then the third chunk is committed but not recorded
            raise KeyboardInterrupt
        original(self, job)

    monkeypatch.setattr(LanceIndex, "_save_job", save)
    with pytest.raises(KeyboardInterrupt):
        LanceIndex.build(tmp_path / "cut", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    monkeypatch.setattr(LanceIndex, "_save_job", original)
    resumed, report = LanceIndex.build(tmp_path / "cut", tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.resumed_from == 10
    assert table_rows(resumed) == table_rows(whole)  # the third chunk's rows were written once, not twice


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
    with pytest.raises(DataError, match="was edited after it was written"):
        LanceIndex.open(path).check()
    victim.write_bytes(bytes(blob[:len(blob) // 3]))  # vectors truncated
    with pytest.raises(DataError, match="truncated or overwritten"):
        LanceIndex.open(path).check()
    # a wrong model: same architecture, other weights
    other = tmp_path / "other-model"
    import shutil

    shutil.copytree(tiny_model_dir, other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    with pytest.raises(ConfigError, match="is not the model index .* was built with"):
        LanceIndex.open(path, model=str(other))
    # the manifest gone
    (path / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json.*is missing"):
        LanceIndex.open(path)


def test_non_finite_metadata_is_refused_at_build(tmp_path, tiny_model_dir):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"_id": "a", "text": "x", "score": NaN}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 1.*not a finite number"):
        LanceIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())


def test_filtered_search_is_exact_in_every_mode_and_hostile_filters_are_refused_or_literal(built):
    from robustir.serving.filters import matches, parse_filter

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


def test_discard_an_interrupted_add_and_compact(built, tmp_path):
    def stop(position):
        if position >= 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        built.add(write_corpus(tmp_path / "more.jsonl", n=12, start=100, prefix="n"), config=quiet(chunk_size=5),
                  on_chunk=stop)
    assert built.count == 29  # the first chunk is committed (and a reader would see it)
    with pytest.raises(DataError, match="its add of .* did not finish"):
        LanceIndex.open(built.path)
    assert built.discard_unfinished() == 5 and built.count == 24
    assert built.discard_unfinished() == 0
    reader = LanceIndex.open(built.path)
    built.delete([f"d{i}" for i in range(10)])
    files_before = len(list((built.path / "lance").rglob("*.lance")))
    from datetime import timedelta

    with pytest.warns(UserWarning, match="removes every version except the latest"):
        report = built.compact(keep=timedelta(0))  # no other process works on this table
    assert report.documents == 14 and reader.count == 14
    assert len(list((built.path / "lance").rglob("*.lance"))) < files_before  # merged, old versions dropped
    assert "data files verified" in LanceIndex.open(built.path).check()
    assert {h.id for h in reader.search("coffee", top_k=20, mode="lexical")[0]} == {"d17"}


def test_an_ann_index_from_the_threshold_on(tmp_path, tiny_model_dir):
    from robustir.serving.lance_store import AnnConfig

    corpus = write_corpus(tmp_path / "corpus.jsonl", n=300)
    exact, _ = LanceIndex.build(tmp_path / "exact", tiny_model_dir, corpus, config=quiet(chunk_size=100))
    index, _ = LanceIndex.build(tmp_path / "ann", tiny_model_dir, corpus, config=quiet(chunk_size=100),
                                ann=AnnConfig(kind="auto", threshold=200))
    assert not exact.manifest["ann"]["indexed"]
    assert index.manifest["ann"]["indexed"] and index.manifest["ann"]["kind_built"] == "ivf_hnsw_sq"
    assert "IvfHnswSq" in {i.index_type for i in index._table.list_indices()}
    hits = index.search("coffee and health", top_k=10, filter={"lang": "de"})[0]
    assert len(hits) == 10 and all(h.fields["lang"] == "de" for h in hits)
    reopened = LanceIndex.open(index.path)  # the manifest says how to search it
    assert len(reopened.search("coffee", top_k=7)[0]) == 7
    with pytest.raises(ConfigError, match="kind: 'ivf' is not one of"):
        AnnConfig(kind="ivf")  # type: ignore[arg-type]


def test_a_build_over_an_index_of_another_corpus_is_refused_not_reported_done(built, tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus.jsonl"
    again, report = LanceIndex.build(built.path, tiny_model_dir, corpus, config=quiet(chunk_size=5))
    assert report.nothing_to_do and again.count == 24  # the same corpus: done
    with open(corpus, "a", encoding="utf-8") as handle:  # the same path, edited
        handle.write(json.dumps({"_id": "late", "text": "a late document"}) + "\n")
    with pytest.raises(ConfigError, match="another corpus or model \\(corpus .* differs\\).*--add / --upsert"):
        LanceIndex.build(built.path, tiny_model_dir, corpus, config=quiet(chunk_size=5))
    other = write_corpus(tmp_path / "other.jsonl", n=3)
    with pytest.raises(ConfigError, match="corpus .*corpus.jsonl -> .*other.jsonl"):
        LanceIndex.build(built.path, tiny_model_dir, other, config=quiet())
    rebuilt, report = LanceIndex.build(built.path, tiny_model_dir, other, config=quiet(), overwrite=True)
    assert rebuilt.count == 3 and not report.nothing_to_do
