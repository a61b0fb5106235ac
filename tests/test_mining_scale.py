"""Mining at scale: corpus read from disk, queries streamed, BM25 built by chunk, dense embeddings in a file and
searched chunk by chunk -- and the mined output equal to the in-memory path's, byte for byte."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from robustir.cli.main import main
from robustir.data.beir import CorpusFile, load_beir, load_corpus
from robustir.errors import ConfigError, DataError
from robustir.index.bm25 import BM25Config, BM25Index
from robustir.index.dense import TIE_MARGIN, ChunkedFlatIndex, DenseIndex, DenseIndexConfig, EmbeddingFile, sort_hits
from robustir.negatives import mining as mining_module
from robustir.negatives.mining import (FileDocuments, JsonlMiningSource, MiningConfig, corpus_embeddings,
                                       load_jsonl_for_mining, mine_beir, mine_jsonl, mine_negatives, queries_from_beir)
from robustir.negatives.score_stats import ScoreStats

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WORDS = "cell protein gene virus cancer brain heart lung blood immune tissue enzyme".split()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def corpus_rows(n: int = 60) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(6))
        rows.append({"_id": f"d{i}", "title": f"{WORDS[i % 12]} {i}" if i % 3 else "", "text": f"{words} study {i}"})
    if n > 7:
        rows[7]["text"], rows[7]["title"] = rows[3]["text"], rows[3]["title"]  # a duplicate text under another id
    return rows


def beir_folder(root: Path, n_docs: int = 60, n_queries: int = 25) -> Path:
    (root / "qrels").mkdir(parents=True)
    write_jsonl(root / "corpus.jsonl", corpus_rows(n_docs))
    write_jsonl(root / "queries.jsonl", [{"_id": f"q{i}", "text": f"{WORDS[i % 12]} {WORDS[(i * 5) % 12]}"}
                                         for i in range(n_queries)])
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{(i * 7) % n_docs}\t1\n" + (f"q{i}\td{(i * 11) % n_docs}\t1\n" if i % 4 == 0 else "")
        for i in range(n_queries)))
    return root


def in_memory(data: Path, output: Path, config: MiningConfig, encoder=None) -> bytes:
    """The in-memory path: the whole BEIR folder loaded into lists, mined with mine_negatives."""
    dataset = load_beir(data, "train")
    mine_negatives(queries_from_beir(dataset), dataset.corpus.ids, dataset.corpus.texts_for_encoding(), output,
                   config, encoder, show_progress=False)
    return output.read_bytes()


# ----------------------------------------------------------------------------------------------- corpus file

def test_corpus_file_reads_what_load_corpus_reads(tmp_path):
    rows = corpus_rows(30)
    rows[4] = {"_id": 44, "title": "", "text": "  "}  # empty: skipped by both
    rows[9] = {"id": "nine", "text": "only text, an int-free id given as 'id'"}
    path = write_jsonl(tmp_path / "corpus.jsonl", rows)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n")  # blank lines are allowed
    corpus, skipped = load_corpus(path)
    with CorpusFile(path) as disk:
        assert len(disk) == len(corpus) == 29 and disk.skipped == skipped == 1
        assert disk.texts() == corpus.texts_for_encoding() and disk.texts(5, 9) == corpus.texts_for_encoding()[5:9]
        assert [disk.document(i) for i in range(len(disk))] == list(zip(corpus.ids, corpus.titles, corpus.texts))
        assert all(disk.row(doc_id) == i for i, doc_id in enumerate(corpus.ids))
        assert disk.row("44") is None and "nope" not in disk and "nine" in disk
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    spill = tmp_path / "spill"
    spill.mkdir()
    with CorpusFile(gz, spill_dir=spill) as packed:
        assert packed.texts() == corpus.texts_for_encoding()
        assert len(list(spill.iterdir())) == 1
    assert not list(spill.iterdir())  # the decompressed copy is removed on close


@pytest.mark.parametrize("duplicate_line", [2, 5])
def test_corpus_file_refuses_what_load_corpus_refuses(tmp_path, duplicate_line):
    rows = corpus_rows(6)
    rows[duplicate_line - 1] = {"_id": "d0", "title": "", "text": "" if duplicate_line == 2 else "again"}
    rows.append({"_id": "d3", "text": "third again"})  # a later duplicate: the first one in file order is named
    path = write_jsonl(tmp_path / "corpus.jsonl", rows)
    with pytest.raises(DataError) as expected:
        load_corpus(path)
    with pytest.raises(DataError) as got:
        CorpusFile(path)
    assert str(got.value) == str(expected.value) and "d0" in str(got.value)
    write_jsonl(path, [{"_id": "a", "text": ""}])
    with pytest.raises(DataError, match="no documents"):
        CorpusFile(path)
    path.write_text('{"_id": "a", "text": "x"}\n{"_id": "b"}\n')
    with pytest.raises(DataError, match="line 2.*'text'"):
        CorpusFile(path)


# ------------------------------------------------------------------------------------------- indexes by chunk

def test_bm25_index_from_chunks_is_the_same_index(tmp_path):
    texts = [r["title"] + " " + r["text"] for r in corpus_rows(80)] + ["", "the of and"]  # empty after analysis too
    queries = [f"{WORDS[i]} {WORDS[(i + 3) % 12]} study" for i in range(12)] + ["zzz unknown"]
    for config in (BM25Config(), BM25Config(method="bm25+", stemmer=None, stopwords=None)):
        whole = BM25Index(config).index(texts)
        for size in (1, 7, 1000):
            chunked = BM25Index(config).index_chunks(texts[i:i + size] for i in range(0, len(texts), size))
            for key in ("data", "indices", "indptr"):
                assert np.array_equal(whole._retriever.scores[key], chunked._retriever.scores[key])
            for a, b in zip(whole.search(queries, 20), chunked.search(queries, 20)):
                assert np.array_equal(a, b)


def random_unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("n_queries", [5, 1024])  # few queries: FAISS's own kernel; many: its BLAS path
def test_chunked_flat_search_equals_a_flat_index(tmp_path, n_queries):
    corpus = random_unit_vectors(5200, 384, 0)
    corpus[100] = corpus[2900] = corpus[1500]  # exact ties, across chunks
    np.save(tmp_path / "emb.npy", corpus)
    queries = random_unit_vectors(n_queries, 384, 1)
    queries[0] = corpus[1500]
    expected = sort_hits(*DenseIndex().index(corpus).search(queries, 50 + TIE_MARGIN), 50)
    vectors = EmbeddingFile(tmp_path / "emb.npy")
    read = []
    original = vectors.rows
    vectors.rows = lambda start, stop: read.append(min(stop, len(corpus)) - start) or original(start, stop)
    for chunk, rounded in ((1, 1024), (1025, 2048), (5000, 5120)):
        read.clear()
        index = ChunkedFlatIndex(vectors, chunk)
        got = index.search(queries, 50)
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
        assert index.chunk_rows == rounded  # FAISS's 1024-row blocks: the same kernels as a whole search
        assert max(read) <= rounded and sum(read) == len(corpus)  # one pass over the file, a chunk at a time
    if n_queries >= 1024:  # why the rounding: BLAS rounds a block's scores by where the block starts
        index.chunk_rows = 1000
        assert not np.array_equal(index.search(queries, 50)[0], expected[0])
    assert list(got[1][0][:3]) == [100, 1500, 2900]  # ties by row
    with pytest.raises(ConfigError):
        ChunkedFlatIndex(vectors, 0)


def test_ivf_index_from_a_file_equals_the_in_memory_one(tmp_path):
    corpus = random_unit_vectors(4000, 16, 2)
    np.save(tmp_path / "emb.npy", corpus)
    queries = random_unit_vectors(30, 16, 3)
    config = DenseIndexConfig(kind="ivf", nlist=20, nprobe=4)
    whole = DenseIndex(config).index(corpus).search(queries, 10)
    chunked = DenseIndex(config).index_file(EmbeddingFile(tmp_path / "emb.npy"), chunk_rows=700).search(queries, 10)
    assert np.array_equal(whole[0], chunked[0]) and np.array_equal(whole[1], chunked[1])


def test_embedding_file_checks_and_reads(tmp_path):
    np.save(tmp_path / "f64.npy", np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="float32"):
        EmbeddingFile(tmp_path / "f64.npy")
    data = random_unit_vectors(50, 8, 4)
    target = EmbeddingFile.create(tmp_path / "e.npy", 50, 8)
    target.write(20, data[20:])
    target.write(0, data[:20])
    target.flush()
    assert np.array_equal(np.load(tmp_path / "e.npy"), data)
    rows = np.array([49, 3, 3, 17, 0])
    assert np.array_equal(EmbeddingFile(tmp_path / "e.npy").take(rows, chunk_rows=4), data[rows])


# ------------------------------------------------------------------------------ streamed == in memory, mined

def test_streamed_bm25_mining_equals_in_memory(tmp_path):
    data = beir_folder(tmp_path / "beir")
    for name, config in [("top", MiningConfig(num_negatives=8, range_max=30)),
                         ("random", MiningConfig(num_negatives=4, range_min=2, sampling="random", seed=3,
                                                 relative_margin=0.1, query_batch_size=4))]:
        expected = in_memory(data, tmp_path / f"{name}-memory.jsonl", config)
        mine_beir(data, "train", tmp_path / f"{name}-disk.jsonl", config)
        config.corpus_chunk = 7
        mine_beir(data, "train", tmp_path / f"{name}-chunked.jsonl", config)
        assert (tmp_path / f"{name}-disk.jsonl").read_bytes() == expected
        assert (tmp_path / f"{name}-chunked.jsonl").read_bytes() == expected


def test_streamed_dense_mining_equals_in_memory(tmp_path, tiny_model_dir, monkeypatch):
    from robustir.models import encoder as encoder_module
    from robustir.models.encoder import Encoder

    monkeypatch.setattr(encoder_module, "ENCODE_BLOCK", 500)  # several blocks, as a large corpus would have
    data = beir_folder(tmp_path / "beir", n_docs=2500)  # three chunks of FAISS's 1024-row blocks
    encoder = Encoder.from_pretrained(tiny_model_dir, passage_max_length=32, query_max_length=16)
    config = MiningConfig(method="dense", num_negatives=6, range_max=20, device="cpu", query_batch_size=10)
    expected = in_memory(data, tmp_path / "memory.jsonl", config, encoder)
    read = []
    original = EmbeddingFile.rows
    monkeypatch.setattr(EmbeddingFile, "rows", lambda self, a, b: read.append(min(b, len(self)) - a)
                        or original(self, a, b))
    monkeypatch.setattr(EmbeddingFile, "load", lambda self: pytest.fail("the chunked search loaded every vector"))
    chunked = MiningConfig(**{**config.__dict__, "corpus_chunk": 1000, "cache_dir": str(tmp_path / "cache")})
    mine_beir(data, "train", tmp_path / "chunked.jsonl", chunked, encoder)
    assert (tmp_path / "chunked.jsonl").read_bytes() == expected
    assert read and max(read) <= 1024  # never more than a chunk of vectors at a time (1000 -> FAISS's 1024)


def test_jsonl_source_streams_the_same_queries_and_pool(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [
        {"_id": "a", "title": "Title A", "text": "text of a"}, {"_id": "b", "title": "", "text": "text of b"},
        {"_id": "c", "title": "T", "text": "text of b"}, {"_id": "e", "title": "", "text": "  "}])
    rows = [
        {"query": "q1", "pos": ["Title A text of a"], "neg": ["x"], "qid": "1"},  # matched with its title
        {"query": "q2", "pos": ["text of a ", "new one"], "pos_ids": ["zz", "b"], "qid": "2"},  # raw text; a declared id
        {"query": "q3", "pos": ["text of b", "new two", "new one"], "qid": "3", "keep": [1]},  # first doc of that text
        {"query": "", "pos": ["skipped"]},
        {"query": "q5", "pos": ["new two"], "query_id": "5", "prompt": "Represent: "},
    ]
    source_path = write_jsonl(tmp_path / "train.jsonl", rows)
    queries, ids, texts = load_jsonl_for_mining(source_path, corpus)
    assert ids == ["a", "b", "c", "pos:3", "pos:4"] and texts[3:] == ["new two", "new one"]
    assert [q.query_id for q in queries] == ["1", "2", "3", "5"]
    assert [q.positive_ids for q in queries] == [["a"], ["a", "b"], ["b", "pos:3", "pos:4"], ["pos:3"]]
    assert queries[2].extra == {"qid": "3", "keep": [1]} and queries[3].extra["prompt"] == "Represent: "
    queries, ids, texts = load_jsonl_for_mining(source_path)  # no corpus: the file's own pool
    assert ids == [f"p{i}" for i in range(6)] and texts[:3] == ["Title A text of a", "x", "text of a "]
    assert queries[1].positive_ids == ["p2", "p3"]  # "text of a " and "new one"
    write_jsonl(source_path, rows[:2] + [{**rows[2], "qid": "1"}])  # ids no longer unique: line numbers
    assert [q.query_id for q in load_jsonl_for_mining(source_path)[0]] == ["L1", "L2", "L3"]
    source = JsonlMiningSource(source_path, corpus, spill_dir=tmp_path)
    write_jsonl(source_path, [{"query": "q", "pos": ["changed since the first pass"]}])
    with pytest.raises(DataError, match="changed while"):
        list(source.queries())
    source.documents.close()


@pytest.mark.parametrize("with_corpus", [False, True])
def test_streamed_jsonl_mining_equals_in_memory_and_resumes(tmp_path, monkeypatch, with_corpus):
    data = beir_folder(tmp_path / "beir")
    corpus = data / "corpus.jsonl" if with_corpus else None
    dataset = load_beir(data, "train")
    texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
    rows = [{"query": dataset.queries[q], "pos": [texts[d] for d in judged], "neg": [texts["d1"]], "n": i}
            for i, (q, judged) in enumerate(dataset.qrels.items())]
    rows[3]["pos"].append("a positive no document has")
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    config = MiningConfig(num_negatives=5, query_batch_size=4, corpus_chunk=11)
    queries, ids, pool = load_jsonl_for_mining(source, corpus)
    mine_negatives(queries, ids, pool, tmp_path / "memory.jsonl", config, show_progress=False)
    mine_jsonl(source, tmp_path / "disk.jsonl", config, corpus=corpus)
    expected = (tmp_path / "memory.jsonl").read_bytes()
    assert (tmp_path / "disk.jsonl").read_bytes() == expected

    class Crashing(mining_module.ResumableJsonlWriter):
        def write(self, record: dict) -> None:
            if self.count >= 6:
                raise RuntimeError("simulated crash")
            super().write(record)

    monkeypatch.setattr(mining_module, "ResumableJsonlWriter", Crashing)
    with pytest.raises(RuntimeError):
        mine_jsonl(source, tmp_path / "resumed.jsonl", config, corpus=corpus)
    monkeypatch.undo()
    mine_jsonl(source, tmp_path / "resumed.jsonl", config, corpus=corpus)
    assert (tmp_path / "resumed.jsonl").read_bytes() == expected
    assert not [p for p in tmp_path.iterdir() if ".work-" in p.name]  # temporary files are gone


def test_cli_corpus_chunk_and_shards(tmp_path, capsys):
    data = beir_folder(tmp_path / "beir")
    common = ["mine", "--data", str(data), "--num-negatives", "4", "--corpus-chunk", "13"]
    assert main(common + ["--output", str(tmp_path / "full.jsonl")]) == 0
    for i in (1, 2):
        assert main(common + ["--output", str(tmp_path / "sh.jsonl"), "--shard", f"{i}/2"]) == 0
    assert main(["merge", "--output", str(tmp_path / "sh.jsonl")]) == 0
    key = lambda line: json.loads(line)["query_id"]  # noqa: E731
    assert sorted((tmp_path / "sh.jsonl").read_text().splitlines(), key=key) == \
        sorted((tmp_path / "full.jsonl").read_text().splitlines(), key=key)
    # the chunk is a memory setting: a finished output made with another chunk is not redone
    assert main(common[:-1] + ["50", "--output", str(tmp_path / "full.jsonl")]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(common[:-1] + ["0", "--output", str(tmp_path / "x.jsonl")]) == 2


# ------------------------------------------------------------------------------------ the embeddings file

def test_corpus_embeddings_share_the_encoder_cache_and_resume(tmp_path, tiny_model_dir, monkeypatch):
    from robustir.models import encoder as encoder_module
    from robustir.models.encoder import Encoder

    monkeypatch.setattr(encoder_module, "ENCODE_BLOCK", 8)
    encoder = Encoder.from_pretrained(tiny_model_dir, passage_max_length=32)
    texts = [r["title"] + " " + r["text"] for r in corpus_rows(30)]
    documents = FileDocuments(None, prefix="p", spill_dir=tmp_path)
    for text in texts:
        documents.add(text)
    documents.finish()
    config = MiningConfig(method="dense", cache_dir=str(tmp_path / "cache"), encode_batch_size=4)
    reference = encoder.encode_corpus(texts, cache_dir=tmp_path / "other", batch_size=4, precision="fp32")

    calls = []
    real_encode = Encoder.encode

    def crash_on_third(self, batch, *args, **kwargs):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real_encode(self, batch, *args, **kwargs)

    monkeypatch.setattr(Encoder, "encode", crash_on_third)
    with pytest.raises(RuntimeError):
        corpus_embeddings(encoder, documents, config, tmp_path)
    assert [p.name.split(".", 1)[1] for p in sorted((tmp_path / "cache").glob("*.npy.*"))] == \
        ["npy.lock", "npy.partial", "npy.run.json"]
    calls.clear()
    monkeypatch.setattr(Encoder, "encode", lambda self, batch, *a, **k: calls.append(len(batch))
                        or real_encode(self, batch, *a, **k))
    file = corpus_embeddings(encoder, documents, config, tmp_path)  # resumes at row 16: two blocks left
    assert calls == [8, 6] and np.array_equal(file.load(), reference)
    cached = list((tmp_path / "cache").glob("*.npy"))
    assert len(cached) == 1 and cached[0].name == next((tmp_path / "other").glob("*.npy")).name  # one key
    calls.clear()
    assert np.array_equal(encoder.encode_corpus(texts, cache_dir=tmp_path / "cache", batch_size=4, precision="fp32"),
                          reference)
    assert np.array_equal(corpus_embeddings(encoder, documents, config, tmp_path).load(), reference)
    assert not calls  # both read the one cached file
    # a damaged cache file (cut short, or bytes changed at its full size) is encoded again, never read
    raw = cached[0].read_bytes()
    for damaged in (raw[: len(raw) // 2], raw[:-8] + bytes(8)):
        cached[0].write_bytes(damaged)
        calls.clear()
        assert np.array_equal(corpus_embeddings(encoder, documents, config, tmp_path).load(), reference)
        assert calls == [8, 8, 8, 6]
    cached[0].write_bytes(raw[:-8] + bytes(8))
    assert np.array_equal(encoder.encode_corpus(texts, cache_dir=tmp_path / "cache", batch_size=4, precision="fp32"),
                          reference)
    documents.close()


# -------------------------------------------------------------------------------------------- report memory

def test_score_stats_exact_then_sampled():
    values = [random.Random(1).gauss(0, 1) for _ in range(5000)]
    exact = ScoreStats()
    exact.extend(values)
    arr = np.asarray(values)
    assert exact.summary() == {"count": 5000, "mean": float(arr.mean()), "min": float(arr.min()),
                               "p25": float(np.percentile(arr, 25)), "median": float(np.median(arr)),
                               "p75": float(np.percentile(arr, 75)), "max": float(arr.max())}
    assert exact[:3] == values[:3] and ScoreStats().summary(count=False) == {}
    runs = []
    for _ in range(2):
        small = ScoreStats(limit=500)
        small.extend(values)
        runs.append(small.summary())
    first = runs[0]
    assert runs[0] == runs[1]  # seeded: the same input gives the same report
    assert first["count"] == 5000 and first["quartiles_from_sample"] == 500
    assert first["min"] == arr.min() and first["max"] == arr.max() and first["mean"] == pytest.approx(arr.mean())
    assert abs(first["median"] - np.median(arr)) < 0.2
