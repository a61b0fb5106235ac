"""Issue 37: corpus encoding on Ray Data + Lance (`robustir.scale.ray_encode`) gives the single-process path's
vectors, survives a worker killed mid-job with every passage exactly once, and a driver stopped mid-job resumes
without encoding the committed parts again. Skipped where the optional extra ``robustir[scale]`` is not installed."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from extras import require  # noqa: E402  (tests/ is on sys.path)

require("ray", "ray.data", "lance", "lance_ray", extra="scale")  # what robustir.scale.ray_encode imports
import ray  # noqa: E402

from robustir.errors import ConfigError  # noqa: E402
from robustir.scale.ray_encode import _LAST, RayEncodeConfig, encode_with_ray, read_vectors  # noqa: E402

SCIFACT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "scifact"


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One local Ray session for the module (2 CPUs, as the box has)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def _lines(path: Path) -> list[str]:
    """A JSONL file's lines (split on newlines only: a text may hold other Unicode line breaks)."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _corpus(path: Path, n: int) -> Path:
    rows = [{"_id": f"d{i:03d}", "title": f"Title {i}", "text": f"document {i} about subject {i % 7} and more {i * 3}"}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(**kw) -> RayEncodeConfig:
    return RayEncodeConfig(**{"precision": "fp32", "batch_size": 8, "batch_rows": 10, "part_rows": 20,
                              "concurrency": 2, "show_progress": False, **kw})


@pytest.mark.slow
def test_ray_gives_the_single_process_vectors_on_a_scifact_slice(tmp_path):
    """The bundled all-MiniLM-L6-v2 on the first 240 SciFact abstracts: the same ids, cosine >= 0.9999 per row."""
    from robustir.data.beir import load_corpus
    from robustir.models.encoder import Encoder
    from robustir.resources import default_model_path

    lines = _lines(SCIFACT / "corpus.jsonl")[:240]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    options = {"passage_max_length": 128}
    report = encode_with_ray(corpus, default_model_path(), tmp_path / "vectors.lance", encoder_options=options,
                             config=_config(batch_rows=40, part_rows=100, batch_size=16))
    assert (report.rows, report.resumed) == (240, 0) and report.parts >= 2
    ids, vectors = read_vectors(tmp_path / "vectors.lance")
    loaded, _ = load_corpus(corpus)
    single = Encoder.from_pretrained(default_model_path(), **options).encode(
        loaded.texts_for_encoding(), "passage", batch_size=16, precision="fp32")
    order = {doc_id: i for i, doc_id in enumerate(loaded.ids)}
    assert ids == sorted(loaded.ids)
    expected = single[[order[i] for i in ids]]
    cosine = (vectors * expected).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()


def test_a_worker_killed_mid_job_leaves_every_passage_exactly_once(tmp_path, tiny_model_dir):
    corpus = _corpus(tmp_path / "corpus.jsonl", 50)
    marker = tmp_path / "killed-once"

    def kill_once(call: int, ids: list[str]) -> None:  # in an actor: the first to reach its 2nd batch dies (kill -9)
        if call == 2 and not marker.exists():
            marker.write_text("x")
            os.kill(os.getpid(), signal.SIGKILL)

    report = encode_with_ray(corpus, tiny_model_dir, tmp_path / "v.lance", config=_config(), on_batch=kill_once)
    assert marker.exists() and report.rows == 50
    ids, vectors = read_vectors(tmp_path / "v.lance")
    assert ids == [f"d{i:03d}" for i in range(50)]  # each once
    assert vectors.shape == (50, 32) and np.isfinite(vectors).all()


class Stop(Exception):
    pass


def _stop_after_first(part: int) -> None:
    raise Stop


def _fragment_files(out: Path) -> dict:
    import lance

    return {f.fragment_id: [d.path for d in f.data_files()] for f in lance.dataset(str(out)).get_fragments()}


def test_a_stopped_driver_resumes_by_id_whatever_the_part_size(tmp_path, tiny_model_dir):
    """Stopped after its first commit, the job resumes with other --part-rows and --batch-rows (documented as
    operational): the committed rows are kept (their files untouched), the others encoded, none twice."""
    corpus = _corpus(tmp_path / "corpus.jsonl", 50)
    out = tmp_path / "v.lance"
    with pytest.raises(Stop):
        encode_with_ray(corpus, tiny_model_dir, out, config=_config(), on_part=_stop_after_first)
    first = _fragment_files(out)
    committed = read_vectors(out)[0]
    assert 20 <= len(committed) < 50 and len(set(committed)) == len(committed)
    report = encode_with_ray(corpus, tiny_model_dir, out, config=_config(part_rows=7, batch_rows=3))
    assert (report.rows, report.resumed) == (50, len(committed)) and report.parts >= 2
    after = _fragment_files(out)
    assert all(after[k] == v for k, v in first.items())  # the first run's files kept, not written again
    ids = read_vectors(out)[0]
    assert len(ids) == len(set(ids)) == 50 and ids == [f"d{i:03d}" for i in range(50)]  # count == distinct
    again = encode_with_ray(corpus, tiny_model_dir, out, config=_config(concurrency=1))  # operational: reused
    assert again.nothing_to_do
    with pytest.raises(ConfigError, match="other settings or inputs than this run"):
        encode_with_ray(corpus, tiny_model_dir, out, config=_config(precision="bf16"))
    redone = encode_with_ray(corpus, tiny_model_dir, out, config=_config(precision="bf16"), overwrite=True)
    assert (redone.rows, redone.resumed) == (50, 0) and len(read_vectors(out)[0]) == 50


def _data_files(out: Path) -> set[str]:
    return {f.name for f in (out / "data").iterdir()}


def _orphan(out: Path, ids: list[str]) -> str:
    """A fragment written and never committed, as a driver killed between its tasks' writes and its commit leaves
    it: the name of its data file."""
    import lance.fragment
    import pyarrow as pa

    from robustir.scale.ray_encode import _schema

    schema = _schema(32)
    rows = pa.table({"id": ids, "vector": pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(32 * len(ids), np.float32)), 32)}, schema=schema)
    written = lance.fragment.write_fragments(rows, str(out), schema=schema, data_storage_version="stable")
    return Path(written[0].data_files()[0].path).name


def test_a_killed_drivers_uncommitted_fragment_files_are_removed_on_resume(tmp_path, tiny_model_dir, monkeypatch):
    """Fragment files a killed driver's tasks wrote and it never committed -- before its first commit and after
    it -- are removed when the job resumes (Lance's cleanup), and every file left is in the dataset."""
    import lance

    corpus = _corpus(tmp_path / "corpus.jsonl", 30)
    out = tmp_path / "v.lance"
    with monkeypatch.context() as patch:  # the driver dies at its first commit: its tasks' files, no dataset
        patch.setattr(lance.LanceDataset, "commit", lambda *a, **k: _stop_after_first(0))
        with pytest.raises(Stop):
            encode_with_ray(corpus, tiny_model_dir, out, config=_config())
    before = _data_files(out)
    assert before and not any((out / "_versions").glob("*"))
    with pytest.raises(Stop):  # resumed, then stopped after its first commit
        encode_with_ray(corpus, tiny_model_dir, out, config=_config(), on_part=_stop_after_first)
    assert not before & _data_files(out)  # the first run's files: removed before the second wrote its own
    after = _orphan(out, ["y1"])  # and one more never committed (the second run's pending ones may be there too)
    report = encode_with_ray(corpus, tiny_model_dir, out, config=_config())
    assert report.rows == 30 and report.resumed >= 20
    referenced = {Path(path).name for paths in _fragment_files(out).values() for path in paths}
    assert after not in _data_files(out) and _data_files(out) == referenced
    assert read_vectors(out)[0] == [f"d{i:03d}" for i in range(30)]


def test_a_second_driver_on_the_same_output_is_refused_naming_the_first(tmp_path, tiny_model_dir):
    """Two drivers on one output: the second is refused with the holder named (pid, host), before it encodes or
    writes anything; the first's output holds every row once. The lock goes with the holder's process."""
    import threading

    from robustir.scale.job import OutputJob

    corpus = _corpus(tmp_path / "corpus.jsonl", 30)
    out = tmp_path / "v.lance"
    refused: list[Exception] = []
    entered, release = threading.Event(), threading.Event()

    def second_driver(part: int) -> None:  # in the first driver, after its first commit: a second one starts
        if part == 0:
            try:
                encode_with_ray(corpus, tiny_model_dir, out, config=_config())
            except ConfigError as exc:
                refused.append(exc)

    report = encode_with_ray(corpus, tiny_model_dir, out, config=_config(), on_part=second_driver)
    assert report.rows == 30 and len(refused) == 1
    assert f"being written by another driver (pid {os.getpid()} on " in str(refused[0])
    ids = read_vectors(out)[0]
    assert len(ids) == len(set(ids)) == 30

    def hold() -> None:
        with OutputJob(out).lock():
            entered.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait()
    try:
        with pytest.raises(ConfigError, match="being written by another driver"):
            encode_with_ray(corpus, tiny_model_dir, out, config=_config(), overwrite=True)
    finally:
        release.set()
        holder.join()
    assert encode_with_ray(corpus, tiny_model_dir, out, config=_config()).nothing_to_do  # released: free again


def test_a_batch_that_kills_its_actor_every_time_ends_in_an_error_naming_it(tmp_path, tiny_model_dir):
    """A poison batch (its actor dies with kill -9 whenever it meets d013): after max_retries restarts the job stops
    with the batch's ids named, not an endless restart loop; the commits before it are kept."""
    corpus = _corpus(tmp_path / "corpus.jsonl", 30)
    tries = tmp_path / "tries"
    tries.mkdir()

    def poison(call: int, ids: list[str]) -> None:
        if "d013" in ids:
            (tries / f"{os.getpid()}-{call}").write_text(json.dumps(ids))
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(ConfigError, match=r"the batch d\d{3} \.\. d\d{3} \(\d+ rows\) killed its encoder actor 3 "
                                          r"times \(max_retries 2") as refused:
        encode_with_ray(corpus, tiny_model_dir, tmp_path / "v.lance", config=_config(max_retries=2),
                        on_batch=poison)
    named = str(refused.value).split("the batch ")[1].split(" killed")[0]
    poisoned = {json.dumps(sorted(json.loads(f.read_text()))) for f in tries.iterdir()}
    assert len(poisoned) == 1 and len(list(tries.iterdir())) == 3  # one batch: the first try and two retries
    ids = json.loads(poisoned.pop())
    assert named == f"{ids[0]} .. {ids[-1]} ({len(ids)} rows)"  # its smallest and largest id, whatever the order


def test_the_cli_encodes_with_ray_and_refuses_what_it_cannot_do(tmp_path, tiny_model_dir, capsys):
    from robustir.cli.main import main

    corpus = _corpus(tmp_path / "corpus.jsonl", 30)
    out = tmp_path / "v.lance"
    args = ["encode", "--engine", "ray", "--model", tiny_model_dir, "--input", str(corpus), "--precision", "fp32",
            "--concurrency", "1", "--max-concurrency", "2", "--part-rows", "20", "--output", str(out)]
    assert main(args) == 0  # an autoscaling pool of 1 to 2 actors
    assert 1 <= _LAST["model_loads"] <= 2
    assert re.search(r"30 rows in \d+ parts", capsys.readouterr().out)
    assert read_vectors(out)[0] == [f"d{i:03d}" for i in range(30)]
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert main([*args[:-1], str(tmp_path / "v")]) == 2  # not a .lance name
    assert "name it with .lance" in capsys.readouterr().err
    assert main([*args, "--num-gpus", "-1"]) == 2
    assert "num_gpus" in capsys.readouterr().err
    three = [("3" if a == "1" and b == "--concurrency" else a) for b, a in zip(["", *args], args)]
    assert main(three) == 2  # above --max-concurrency: refused before any work
    assert "max_concurrency (2) is below concurrency (3)" in capsys.readouterr().err
    assert main(["encode", "--input", str(corpus), "--output", str(tmp_path / "e"), "--concurrency", "2"]) == 2
    assert "go with --engine ray" in capsys.readouterr().err


def _scifact_slice(target: Path, queries: int = 40, extra_docs: int = 160) -> Path:
    """A BEIR folder: the first SciFact train queries, their positives and the first other abstracts."""
    qrels = (SCIFACT / "qrels" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    kept = {}
    for line in qrels:
        qid, did, _ = line.split("\t")
        if qid in kept or len(kept) < queries:
            kept.setdefault(qid, []).append(did)
    wanted = {d for ds in kept.values() for d in ds}
    docs, others = [], 0
    for line in _lines(SCIFACT / "corpus.jsonl"):
        doc_id = json.loads(line)["_id"]
        if doc_id in wanted or others < extra_docs:
            others += doc_id not in wanted
            docs.append(line)
    (target / "qrels").mkdir(parents=True)
    (target / "corpus.jsonl").write_text("\n".join(docs) + "\n", encoding="utf-8")
    queries_text = [line for line in _lines(SCIFACT / "queries.jsonl")
                    if json.loads(line)["_id"] in kept]
    (target / "queries.jsonl").write_text("\n".join(queries_text) + "\n", encoding="utf-8")
    (target / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, ds in kept.items() for d in ds), encoding="utf-8")
    return target


@pytest.mark.slow
def test_dense_mining_with_ray_gives_the_single_process_negatives(tmp_path):
    """`mine --method dense` on a SciFact slice (40 train queries, about 200 abstracts, the bundled model): the
    corpus encoded by two Ray actors gives the same records -- the same negatives, ids and scores -- as one process."""
    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import MiningConfig, mine_beir
    from robustir.resources import default_model_path

    data = _scifact_slice(tmp_path / "slice")
    encoder = Encoder.from_pretrained(default_model_path(), passage_max_length=128)
    common = dict(method="dense", num_negatives=5, range_max=30, precision="fp32", relative_margin=0.05)
    mine_beir(data, "train", tmp_path / "process.jsonl", MiningConfig(**common), encoder=encoder)
    mine_beir(data, "train", tmp_path / "ray.jsonl",
              MiningConfig(**common, engine="ray", ray_actors=2, cache_dir=str(tmp_path / "cache")), encoder=encoder)
    process = [json.loads(x) for x in (tmp_path / "process.jsonl").read_text().splitlines()]
    on_ray = [json.loads(x) for x in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert len(process) == 40 and [r["query_id"] for r in on_ray] == [r["query_id"] for r in process]
    assert [r["neg_ids"] for r in on_ray] == [r["neg_ids"] for r in process]
    assert sum(len(r["neg_ids"]) for r in process) > 150
    for a, b in zip(on_ray, process):
        assert a["neg_scores"] == pytest.approx(b["neg_scores"], abs=1e-4)
        assert a["pos_scores"] == pytest.approx(b["pos_scores"], abs=1e-4)
    assert list((tmp_path / "cache").glob("*.lance"))  # the resumable Lance dataset the actors wrote


def test_mining_reads_a_corpus_file_in_ray_tasks_and_only_added_texts_in_the_driver(tmp_path, monkeypatch,
                                                                                     caplog):
    """Dense mining's rows for the Ray actors (``_mining_rows``): a plain corpus file's rows are read by Ray tasks
    (the driver's own reader is made to fail), texts only the driver has (positives added from a training file)
    are put by it; every row once, with its row number and the single-process text; a resumed job's rows (a
    bitmap) left out; a corpus a node cannot see is read by the driver, with a warning; a file changed since it
    was indexed is robustir's error naming it, not Ray's traceback."""
    import logging

    import pyarrow as pa

    from robustir.data.beir import CorpusFile
    from robustir.errors import DataError
    from robustir.negatives.mining import FileDocuments
    from robustir.scale.ray_encode import _mining_rows, _robustir_error

    lines = ['\ufeff{"_id": "a", "title": "T", "text": "first"}', "", '{"_id": "empty", "text": "  "}']
    lines += [json.dumps({"_id": f"d{i}", "text": f"doc {i}"}) for i in range(25)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    documents = FileDocuments(CorpusFile(corpus), spill_dir=tmp_path)
    for text in ("added one", "added two", "added three"):
        documents.add(text)
    documents.finish()
    expected = documents.texts(0, len(documents))
    assert len(expected) == 29 and expected[0] == "T first"

    def read(held=None):
        table = pa.concat_tables(_mining_rows(documents, 4, held).iter_batches(batch_size=None, batch_format="pyarrow"))
        return dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))

    corpus_texts, corpus_documents = CorpusFile.texts, CorpusFile.documents
    monkeypatch.setattr(CorpusFile, "texts", lambda *a, **k: pytest.fail("the driver read corpus texts"))
    monkeypatch.setattr(CorpusFile, "documents", lambda *a, **k: pytest.fail("the driver read corpus texts"))
    got = read()
    assert got == {f"{i:012d}": text for i, text in enumerate(expected)}

    from robustir.scale import ray_encode

    monkeypatch.setattr(ray_encode, "MAX_PIECES", 3)  # a large corpus: ranges of several batches, 3 at most
    assert read() == got
    monkeypatch.setattr(ray_encode, "MAX_PIECES", 4096)
    held = np.zeros(29, bool)
    held[[0, 3, 4, 5, 6, 17, 27]] = True  # rows a killed run committed: whole ranges, parts of ranges, added ones
    got = read((np.packbits(held), int(held.sum())))
    assert sorted(got) == [f"{i:012d}" for i in range(29) if not held[i]]
    assert all(got[f"{i:012d}"] == expected[i] for i in range(29) if not held[i])

    def unseen(paths, output=None):
        raise ConfigError(f"node 10.0.0.9 does not see the corpus {paths['corpus']}.")

    monkeypatch.setattr(CorpusFile, "texts", corpus_texts)
    monkeypatch.setattr(CorpusFile, "documents", corpus_documents)
    monkeypatch.setattr(ray_encode, "check_cluster_sees", unseen)  # a node without the file: the driver reads it
    with caplog.at_level(logging.WARNING, logger="robustir.scale.ray_encode"):
        assert read() == {f"{i:012d}": text for i, text in enumerate(expected)}
    assert "does not see the corpus" in caplog.text and "does not scale" in caplog.text
    monkeypatch.undo()
    corpus.write_text("\n".join(lines[:10] + ['{"_id": "x", "text": ""}'] + lines[11:]) + "\n", encoding="utf-8")
    with pytest.raises(Exception) as caught:
        read()
    error = _robustir_error(caught.value)
    assert isinstance(error, DataError) and "changed while it was being read" in str(error)
    assert str(corpus) in str(error)
    documents.close()


def test_ray_is_for_dense_mining_only():
    from robustir.negatives.mining import MiningConfig

    with pytest.raises(ConfigError, match="engine: ray encodes the corpus for dense mining"):
        MiningConfig(method="bm25", engine="ray").validate()


def test_an_index_built_with_ray_actors_holds_the_single_process_vectors(tmp_path, tiny_model_dir):
    """`robustir index --engine ray`: every chunk split among two actors; the same rows and vectors as a build in
    this process, the same search hits, and a re-run finds it complete."""
    from robustir.cli.index import ray_pool  # what `robustir index --engine ray` gives the index
    from robustir.index.store import IndexConfig, SearchIndex

    corpus = _corpus(tmp_path / "corpus.jsonl", 50)
    vectors = {}
    for engine in ("process", "ray"):
        config = IndexConfig(chunk_size=20, precision="fp32", show_progress=False, engine=engine, ray_actors=2)
        index, report = SearchIndex.build(tmp_path / engine, tiny_model_dir, corpus, config=config,
                                          encoder_pool=ray_pool)
        with index:
            table = index._table.to_arrow().sort_by("id")
            vectors[engine] = (table.column("id").to_pylist(), np.stack(table.column("vector").to_numpy(False)))
            hits = [h.id for h in index.search(["subject 3 document"], top_k=5)[0]]
        assert report.documents == 50
        vectors[engine + "-hits"] = hits
    assert vectors["process"][0] == vectors["ray"][0] == [f"d{i:03d}" for i in range(50)]
    np.testing.assert_allclose(vectors["ray"][1], vectors["process"][1], atol=1e-5)
    assert vectors["ray-hits"] == vectors["process-hits"]
    again, report = SearchIndex.build(tmp_path / "ray", tiny_model_dir, corpus,
                                      config=IndexConfig(precision="fp32", show_progress=False, engine="ray"),
                                      encoder_pool=ray_pool)
    again.close()
    assert report.nothing_to_do


def test_an_index_built_with_ray_gets_its_ann_index_from_lance_ray(tmp_path, monkeypatch):
    """`robustir index --engine ray --ann ivf_pq`: a large table's ANN index is built on the cluster by lance-ray's
    distributed create_index (recorded so in the manifest, under LanceDB's own index name) and LanceDB searches with
    it, most hits the exact ones (the bundled model, 600 SciFact abstracts, the size bound lowered); a table below
    the bound gets LanceDB's own build, as without Ray."""
    from robustir.cli.index import ray_pool
    from robustir.index.store import AnnConfig, IndexConfig, SearchIndex
    from robustir.resources import default_model_path
    from robustir.scale import ray_encode

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(_lines(SCIFACT / "corpus.jsonl")[:600]) + "\n", encoding="utf-8")
    queries = [json.loads(line)["text"] for line in _lines(SCIFACT / "queries.jsonl")[:20]]
    hits = {}
    for name, kind, bound in (("exact", "exact", None), ("small", "ivf_pq", None), ("ray", "ivf_pq", 500)):
        if bound is not None:
            monkeypatch.setattr(ray_encode, "DISTRIBUTED_ANN_MIN_ROWS", bound)
        config = IndexConfig(chunk_size=300, precision="fp32", show_progress=False, engine="ray", ray_actors=2,
                             ann=AnnConfig(kind=kind, nprobes=8))
        index, _ = SearchIndex.build(tmp_path / name, default_model_path(), corpus, config=config,
                                     encoder_pool=ray_pool)
        with index:
            hits[name] = [[h.id for h in row] for row in index.search(queries, top_k=10, mode="dense")]
            ann = index.manifest["ann"]
            if kind != "exact":
                assert (ann["built_by"], ann["kind_built"]) == ("lance-ray" if bound else "lancedb", kind)
                built = [(i.name, i.index_type) for i in index._table.list_indices() if i.columns == ["vector"]]
                assert built == [("vector_idx", "IvfPq")]
    recall = {name: np.mean([len(set(a) & set(b)) / 10 for a, b in zip(hits[name], hits["exact"])])
              for name in ("ray", "small")}
    assert recall["ray"] >= 0.8 and recall["small"] >= 0.9, recall


def test_the_encoder_pool_survives_a_killed_actor(tmp_path, tiny_model_dir):
    from robustir.models.encoder import Encoder
    from robustir.scale.ray_encode import RayEncoderPool

    marker = tmp_path / "killed-once"

    def kill_once(call: int) -> None:  # in an actor: the first one to be called dies (kill -9), once
        if not marker.exists():
            marker.write_text("x")
            os.kill(os.getpid(), signal.SIGKILL)

    encoder = Encoder.from_pretrained(tiny_model_dir)
    texts = [f"passage number {i} about topic {i % 5}" for i in range(40)]
    pool = RayEncoderPool(encoder, actors=2, on_call=kill_once)
    try:
        got = pool.encode(texts, "passage", batch_size=8, precision="fp32")
    finally:
        pool.close()
    assert marker.exists()
    np.testing.assert_allclose(got, encoder.encode(texts, "passage", batch_size=8, precision="fp32"), atol=1e-5)


def test_shards_start_on_faiss_blocks_and_cover_every_row():
    from robustir.scale.ray_search import shard_bounds

    assert shard_bounds(2540, 3) == [(0, 1024), (1024, 2048), (2048, 2540)]
    assert shard_bounds(2540, 2) == [(0, 2048), (2048, 2540)]
    assert shard_bounds(500, 4) == [(0, 500)]
    assert shard_bounds(10_000, 7)[-1][1] == 10_000 and all(a % 1024 == 0 for a, _ in shard_bounds(10_000, 7))
    with pytest.raises(ConfigError, match="search shards"):
        shard_bounds(10, 0)


def test_mining_with_the_corpus_split_among_search_actors_gives_the_same_negatives(tmp_path, tiny_model_dir):
    """`mine --method dense --engine ray --ray-search-shards 2`: a SciFact slice of ~2,500 abstracts (three FAISS
    blocks, split 2 + 1 between two shards) gives the very records -- negatives, ids, scores -- of the search in the
    driver over the same cached vectors; a shard actor killed between two searches is restarted by Ray and answers
    the same; more shards than the cluster has CPUs is refused rather than waited for."""
    from robustir.index.dense import DenseIndex, DenseIndexConfig, EmbeddingFile
    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import MiningConfig, mine_beir
    from robustir.scale.ray_search import RayShardedFlatIndex

    data = _scifact_slice(tmp_path / "slice", queries=30, extra_docs=2500)
    encoder = Encoder.from_pretrained(tiny_model_dir, passage_max_length=64)
    common = dict(method="dense", num_negatives=5, range_max=30, precision="fp32", engine="ray", ray_actors=2,
                  cache_dir=str(tmp_path / "cache"))
    mine_beir(data, "train", tmp_path / "driver.jsonl", MiningConfig(**common), encoder=encoder)
    mine_beir(data, "train", tmp_path / "sharded.jsonl", MiningConfig(**common, ray_search_shards=2),
              encoder=encoder)  # the same cached vectors: only the search differs
    driver = [json.loads(x) for x in (tmp_path / "driver.jsonl").read_text().splitlines()]
    sharded = [json.loads(x) for x in (tmp_path / "sharded.jsonl").read_text().splitlines()]
    assert len(driver) == 30 and sum(len(r["neg_ids"]) for r in driver) > 100
    assert sharded == driver

    vectors = EmbeddingFile(next((tmp_path / "cache").glob("*.npy")))
    with pytest.raises(ConfigError, match="need 3 CPUs, and the Ray cluster has 2"):
        RayShardedFlatIndex(vectors, 3)
    gone = tmp_path / "elsewhere.npy"  # a node that does not see the cache folder: the file named, not a Ray trace
    with pytest.raises(ConfigError, match=r"could not read the corpus vectors .*elsewhere\.npy: FileNotFoundError"):
        RayShardedFlatIndex(type("Vectors", (), {"path": str(gone), "__len__": lambda self: len(vectors)})(), 2)
    index = RayShardedFlatIndex(vectors, 2)
    queries = np.random.default_rng(0).standard_normal((8, vectors.dim)).astype(np.float32)
    whole = DenseIndex(DenseIndexConfig(), device="cpu").index(vectors.rows(0, len(vectors)))
    expected = whole.search(queries, 20)
    first = index.search(queries, 20)
    ray.kill(index.actors[1], no_restart=False)  # kill -9 of a shard: Ray restarts it, the call is retried
    again = index.search(queries, 20)
    index.close()
    assert index.bounds == [(0, 2048), (2048, len(vectors))]
    np.testing.assert_array_equal(first[1], again[1])
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], expected[1])
    np.testing.assert_array_equal(first[0], expected[0])
    with pytest.raises(ConfigError, match="goes with engine: ray"):
        MiningConfig(method="dense", ray_search_shards=2).validate()
    with pytest.raises(ConfigError, match="flat index"):
        MiningConfig(method="dense", engine="ray", ray_search_shards=2, corpus_chunk=100).validate()


def test_mining_on_a_lance_index_built_by_lance_ray_finds_most_exact_negatives(tmp_path, tiny_model_dir):
    """`mine --engine ray --ray-lance-index IVF_PQ`: the approximate search runs on a Lance IVF_PQ index that
    lance-ray's distributed create_index built over the Ray-encoded vectors (every cell probed, PQ candidates
    reranked by their vectors): most negatives are the exact search's; a second run reuses the index; vectors the
    process engine cached are written into a Lance dataset first."""
    import lance

    from robustir.index.dense import EmbeddingFile
    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import MiningConfig, mine_beir
    from robustir.scale.ray_search import lance_dataset_of

    data = _scifact_slice(tmp_path / "slice", queries=20, extra_docs=1500)
    encoder = Encoder.from_pretrained(tiny_model_dir, passage_max_length=64)
    common = dict(method="dense", num_negatives=5, range_max=30, precision="fp32", engine="ray", ray_actors=2,
                  cache_dir=str(tmp_path / "cache"))
    approximate = MiningConfig(**common, ray_lance_index="IVF_PQ", index={"nlist": 8, "nprobe": 8})
    mine_beir(data, "train", tmp_path / "exact.jsonl", MiningConfig(**common), encoder=encoder)
    mine_beir(data, "train", tmp_path / "ivf.jsonl", approximate, encoder=encoder)
    exact = [json.loads(x) for x in (tmp_path / "exact.jsonl").read_text().splitlines()]
    ivf = [json.loads(x) for x in (tmp_path / "ivf.jsonl").read_text().splitlines()]
    shared = [len(set(a["neg_ids"]) & set(b["neg_ids"])) / len(a["neg_ids"]) for a, b in zip(exact, ivf)]
    # Lance trains the index unseeded (and lance-ray 0.5 discards given centroids), so each fresh build differs:
    # over 13 fresh builds of this slice, 0.59-0.79 of the negatives were the exact ones; with the rerank by exact
    # vectors off (refine_factor 1), 0.10-0.15. 0.45 lies between the two.
    assert len(ivf) == len(exact) == 20 and np.mean(shared) >= 0.45
    dataset = lance.dataset(str(next((tmp_path / "cache").glob("*.lance"))))
    built = [index.name for index in dataset.describe_indices()]
    assert built == ["robustir_ivf_pq_8"]
    mine_beir(data, "train", tmp_path / "again.jsonl", approximate, encoder=encoder)
    assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "ivf.jsonl").read_text()
    assert lance.dataset(dataset.uri).version == dataset.version  # reused, not built again

    vectors = EmbeddingFile(next((tmp_path / "cache").glob("*.npy")))
    uri = lance_dataset_of(vectors, str(tmp_path / "from-npy.lance"))
    table = lance.dataset(uri).to_table()
    assert table.column("id").to_pylist() == [f"{i:012d}" for i in range(len(vectors))]
    np.testing.assert_array_equal(np.stack(table.column("vector").to_numpy(False)), vectors.rows(0, len(vectors)))
    with pytest.raises(ConfigError, match="set one"):
        MiningConfig(**common, ray_lance_index="IVF_PQ", ray_search_shards=2).validate()


def test_a_miner_waits_for_another_on_the_shared_cache_then_reuses_its_vectors(tmp_path, tiny_model_dir):
    """Dense mining's Ray path (``encode_documents_with_ray``) on a cache folder a job array shares: while another
    process holds the dataset's lock the miner waits (no "Dataset already exists"), then encodes once; the next
    finds the dataset complete and gets the same vectors through ``then`` (written in row order, a batch at a
    time, as mining's .npy is)."""
    import logging
    import threading

    from robustir.index.dense import EmbeddingFile
    from robustir.models.encoder import Encoder
    from robustir.negatives.mining import ListDocuments
    from robustir.scale.job import OutputJob
    from robustir.scale.ray_encode import encode_documents_with_ray, write_in_row_order

    encoder = Encoder.from_pretrained(tiny_model_dir)
    texts = [f"passage number {i} about topic {i % 5}" for i in range(23)]
    documents = ListDocuments([f"d{i}" for i in range(23)], texts)
    out = tmp_path / "cache" / "key.lance"
    waiting, got = threading.Event(), []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for it" in record.getMessage():
                waiting.set()

    handler = Seen()
    logging.getLogger("robustir.scale.job").addHandler(handler)
    logging.getLogger("robustir.scale.job").setLevel(logging.INFO)
    try:
        with OutputJob(out).lock():  # another miner holds it
            miner = threading.Thread(target=lambda: got.append(encode_documents_with_ray(
                encoder, documents, "digest", out, _config(batch_rows=5))))
            miner.start()
            assert waiting.wait(timeout=120)
            assert miner.is_alive() and not got
        miner.join()
    finally:
        logging.getLogger("robustir.scale.job").removeHandler(handler)
    expected = encoder.encode(texts, "passage", batch_size=8, precision="fp32")
    np.testing.assert_allclose(got[0], expected, atol=1e-5)

    def to_file(uri: str) -> np.ndarray:
        file = EmbeddingFile.create(tmp_path / "rows.npy", 23, 32)
        assert write_in_row_order(uri, file) == 23
        file.close()
        return EmbeddingFile(tmp_path / "rows.npy").rows(0, 23)

    again = encode_documents_with_ray(encoder, documents, "digest", out, _config(), then=to_file)
    np.testing.assert_allclose(again, expected, atol=1e-5)


def test_a_piece_that_kills_the_pool_actor_every_time_ends_in_an_error_naming_it(tmp_path, tiny_model_dir):
    """The index's encoder pool: retries are bounded (``max_retries``); a piece whose actor dies on every try is
    named in the error (its place in the chunk and its first text) instead of restarting forever."""
    from robustir.models.encoder import Encoder
    from robustir.scale.ray_encode import RayEncoderPool

    tries = tmp_path / "tries"
    tries.mkdir()

    def always_die(call: int) -> None:
        (tries / f"{os.getpid()}-{call}").write_text("x")
        os.kill(os.getpid(), signal.SIGKILL)

    pool = RayEncoderPool(Encoder.from_pretrained(tiny_model_dir), actors=1, on_call=always_die, max_retries=1)
    try:
        with pytest.raises(ConfigError, match=r"texts 0\.\.9 of this chunk of 10 \(the first: 'text 0'\) killed "
                                              r"their encoder actor 2 times"):
            pool.encode([f"text {i}" for i in range(10)], "passage")
    finally:
        pool.close()
    assert len(list(tries.iterdir())) == 2


def test_the_corpus_streams_from_jsonl_or_parquet_with_robustirs_checks(tmp_path, tiny_model_dir, monkeypatch):
    """The input is read by Ray tasks (never whole in the driver): a BEIR folder's corpus.jsonl and the same rows
    as parquet give the same ids and vectors (title and text joined, an empty document skipped, as
    robustir's reader does); a bad line, a missing text and a repeated id are errors naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import robustir.scale.ray_encode as ray_encode
    from robustir.errors import DataError

    folder = tmp_path / "beir"
    folder.mkdir()
    corpus = _corpus(folder / "corpus.jsonl", 24)
    with corpus.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"_id": "empty", "title": "", "text": "  "}) + "\n\n")
    rows = [json.loads(line) for line in _lines(corpus)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "corpus.parquet")
    from_jsonl = encode_with_ray(folder, tiny_model_dir, tmp_path / "a.lance", config=_config())
    from_parquet = encode_with_ray(tmp_path / "corpus.parquet", tiny_model_dir, tmp_path / "b.lance",
                                   config=_config())
    assert from_jsonl.rows == from_parquet.rows == 24
    ids_a, vectors_a = read_vectors(tmp_path / "a.lance")
    ids_b, vectors_b = read_vectors(tmp_path / "b.lance")
    assert ids_a == ids_b == [f"d{i:03d}" for i in range(24)]
    np.testing.assert_allclose(vectors_a, vectors_b, atol=1e-6)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + '{"_id": "x1", "title": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl.*missing field 'text'"):
        encode_with_ray(bad, tiny_model_dir, tmp_path / "c.lance", config=_config())
    bad.write_text(corpus.read_text() + '{"_id": "x2", "text": "cut\n')
    with pytest.raises(DataError, match=r"bad\.jsonl.*not valid JSON"):
        encode_with_ray(bad, tiny_model_dir, tmp_path / "d.lance", config=_config())
    twice = tmp_path / "twice.jsonl"
    twice.write_text(corpus.read_text() + json.dumps({"_id": "d003", "text": "again"}) + "\n")
    with pytest.raises(DataError, match=r"twice\.jsonl.*duplicate ids \('d003'"):
        encode_with_ray(twice, tiny_model_dir, tmp_path / "e.lance", config=_config())
    monkeypatch.setattr(ray_encode, "DISTINCT_IN_DRIVER", 0)  # the distributed check, for a large output
    with pytest.raises(DataError, match=r"twice\.jsonl.*duplicate ids \('d003'"):
        encode_with_ray(twice, tiny_model_dir, tmp_path / "f.lance", config=_config())


def test_the_corpus_streams_from_a_hf_dataset_and_a_large_jsonl_by_several_tasks(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """A ``datasets`` save_to_disk folder (two Arrow shards, one task each), ``hf://datasets/ORG/NAME`` resolved
    offline in the local Hugging Face cache (parquet files), and a JSONL read in byte ranges by several tasks give
    the JSONL's ids and vectors; a folder of several splits, a dataset not in the cache and a broken Arrow file are
    refused naming what to give."""
    import datasets
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    import robustir.scale.ray_inputs as ray_inputs
    from robustir.errors import DataError

    corpus = _corpus(tmp_path / "corpus.jsonl", 24)
    rows = [json.loads(line) for line in _lines(corpus)]
    expected = encode_with_ray(corpus, tiny_model_dir, tmp_path / "a.lance", config=_config())
    assert expected.rows == 24
    ids, vectors = read_vectors(tmp_path / "a.lance")

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved), num_shards=2)
    hub = tmp_path / "hub"
    snapshot = hub / "datasets--org--corpus" / "snapshots" / ("0" * 40)
    (snapshot / "data").mkdir(parents=True)
    (hub / "datasets--org--corpus" / "refs").mkdir()
    (hub / "datasets--org--corpus" / "refs" / "main").write_text("0" * 40)
    pq.write_table(pa.Table.from_pylist(rows[:12]), snapshot / "data" / "corpus-00000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[12:]), snapshot / "data" / "corpus-00001.parquet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(ray_inputs, "RANGE_BYTES", 300)  # the 24-line JSONL in ~8 ranges
    assert len(ray_inputs._jsonl_ranges(str(corpus), None, 300)) > 4
    for name, source in (("saved", saved), ("hub", "hf://datasets/org/corpus"), ("ranges", corpus)):
        report = encode_with_ray(source, tiny_model_dir, tmp_path / f"{name}.lance", config=_config())
        got_ids, got = read_vectors(tmp_path / f"{name}.lance")
        assert report.rows == 24 and got_ids == ids, name
        np.testing.assert_allclose(got, vectors, atol=1e-6)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}) \
        .save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ConfigError, match=r"the splits train, test; give the split to encode, e\.g\. --input .*"
                                          r"splits/train"):
        encode_with_ray(tmp_path / "splits", tiny_model_dir, tmp_path / "b.lance", config=_config())
    with pytest.raises(ConfigError, match="org/missing is not in the local Hugging Face cache"):
        encode_with_ray("hf://datasets/org/missing", tiny_model_dir, tmp_path / "c.lance", config=_config())
    broken = next(saved.glob("*.arrow"))
    broken.write_bytes(b"not arrow")
    with pytest.raises(DataError, match=rf"{broken.name}: not a readable datasets Arrow file"):
        encode_with_ray(saved, tiny_model_dir, tmp_path / "d.lance", config=_config())
