"""Issue 53: the Ray engine's bookkeeping that needs no Ray cluster (so it runs where Ray is not installed)."""

from __future__ import annotations

from pathlib import Path

from robustir.scale.ray_encode import _Ledger


def test_the_ledger_names_the_batch_whose_actor_died_not_one_only_interrupted():
    """A poison batch kills actor A three times (two restarts, then the job fails); meanwhile another batch, earlier
    by name, was started three times on actor B and interrupted each time without its actor dying (Ray Data
    retried it, then shut the pool down). Counting unfinished starts tied them and named the earlier one."""
    ledger = _Ledger()
    ledger.loaded("A")
    ledger.loaded("B")
    for attempt in range(3):
        ledger.started("d000 .. d009 (10 rows)", "B")  # interrupted, never finished, B alive
        ledger.started("d010 .. d019 (10 rows)", "A")  # A dies running it
        if attempt < 2:
            ledger.loaded("A")  # Ray restarted A under the same id
    assert ledger.worst() == ("d010 .. d019 (10 rows)", 3)
    assert ledger.model_loads() == 4


def test_the_ledger_forgets_finished_batches_and_breaks_ties_by_name():
    ledger = _Ledger()
    assert ledger.worst() is None
    ledger.started("b", "A")
    ledger.finished("b", "A")
    assert ledger.worst() is None  # finished: nothing against it
    for actor, batch in (("A", "y"), ("B", "x")):  # each killed its actor once, then the job failed
        ledger.started(batch, actor)
        ledger.loaded(actor)
    assert ledger.worst() == ("x", 1)  # a tie (same deaths, same tries): the first by name, whatever the order


def test_autoscaling_bounds_are_checked_at_load():
    """The encoder pool's bounds (``concurrency`` .. ``max_concurrency``; mining's ``ray_actors`` ..
    ``ray_max_actors``): inverted bounds and misspelt keys are refused when the config is made, not on the cluster."""
    import pytest

    from robustir.errors import ConfigError
    from robustir.negatives.mining import MiningConfig
    from robustir.scale.ray_encode import RayEncodeConfig

    assert RayEncodeConfig(concurrency=2, max_concurrency=4).max_concurrency == 4
    with pytest.raises(ConfigError, match=r"max_concurrency \(2\) is below concurrency \(3\)"):
        RayEncodeConfig(concurrency=3, max_concurrency=2)
    with pytest.raises(ConfigError, match="did you mean 'max_concurrency'"):
        RayEncodeConfig(max_concurency=2)
    with pytest.raises(ConfigError, match="did you mean 'ray_max_actors'"):
        MiningConfig(method="dense", engine="ray", ray_max_actor=2)
    with pytest.raises(ConfigError, match=r"ray_max_actors \(1\) is below ray_actors \(2\)"):
        MiningConfig(method="dense", engine="ray", ray_actors=2, ray_max_actors=1).validate()
    with pytest.raises(ConfigError, match="ray_max_actors goes with engine: ray"):
        MiningConfig(method="dense", ray_max_actors=2).validate()
    MiningConfig(method="dense", engine="ray", ray_actors=1, ray_max_actors=3).validate()


def test_a_large_jsonl_is_cut_into_ranges_of_whole_lines(tmp_path):
    """The ranges several Ray tasks read a large JSONL by: they cover the file, each starts on a line, and the
    lines they hold are the file's, each once, in order (a long line is never cut)."""
    from robustir.scale.ray_inputs import _jsonl_ranges

    lines = [f'{{"_id": "d{i}", "text": "{"word " * (i % 37)}"}}' for i in range(500)]
    path = tmp_path / "big.jsonl"
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    ranges = _jsonl_ranges(str(path), None, 1000)
    assert len(ranges) > 10 and ranges[0]["start"] == 0 and ranges[-1]["stop"] == len(data)
    assert all(a["stop"] == b["start"] for a, b in zip(ranges, ranges[1:]))
    assert all(data[r["start"] - 1:r["start"]] == b"\n" for r in ranges[1:])
    read = [line for r in ranges for line in data[r["start"]:r["stop"]].decode().split("\n") if line]
    assert read == lines
    assert _jsonl_ranges(str(path), None, 10 ** 9) == [{"path": str(path), "start": 0, "stop": len(data)}]


def test_other_processes_read_a_corpus_files_rows_by_range_as_the_index_has_them(tmp_path):
    """Dense mining on Ray reads a corpus file's rows in Ray tasks, a range at a time
    (:meth:`CorpusFile.pieces` + :func:`read_corpus_range`): the ranges cover every row once and give the texts the
    file's index gives -- a byte-order mark, blank lines and skipped empty documents included --; a file changed
    since it was indexed is a DataError saying so; a ``.gz`` corpus has no ranges (only this process has its
    decompressed copy)."""
    import gzip
    import json

    import numpy as np
    import pytest

    from robustir.data.beir import CorpusFile, read_corpus_range
    from robustir.errors import DataError

    lines = ['\ufeff{"_id": "a", "title": "T", "text": "first"}', "", '{"_id": "e", "title": " ", "text": ""}']
    lines += [json.dumps({"_id": f"d{i}", "text": f"doc {i} \u2028 line"}) for i in range(11)] + ["  "]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = CorpusFile(path)
    for rows in (1, 3, 5, 12, 50):
        pieces = corpus.pieces(rows)
        assert pieces["first_row"].tolist() == list(range(0, 12, rows))
        assert int(pieces["rows"].sum()) == len(corpus) == 12
        got = [text for values in zip(*(pieces[k].tolist() for k in ("start", "stop", "first_line", "rows")))
               for text in read_corpus_range(path, *values)]
        assert got == corpus.texts(0, 12)
    pieces = corpus.pieces(4)
    corpus.close()
    path.write_text("\n".join(lines[:5] + ['{"_id": "x", "text": "a longer line than before"}'] + lines[6:]) + "\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match="changed while it was being read") as caught:
        for values in zip(*(pieces[k].tolist() for k in ("start", "stop", "first_line", "rows"))):
            read_corpus_range(path, *values)
    assert str(path) in str(caught.value)
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8")))
    with CorpusFile(gz) as packed:
        assert packed.pieces(4) is None
    assert np.array_equal(CorpusFile(path).pieces(100)["rows"], [12])


def test_a_resumed_mining_encoding_knows_its_rows_by_a_bitmap(tmp_path):
    """The rows a killed mining encoding committed, as 1 bit a row (:func:`_held_rows`), and any range of them
    (:func:`_row_bits`) -- what the read tasks leave out."""
    import numpy as np
    import pytest

    from robustir.scale.ray_encode import _row_bits

    held = np.zeros(77, bool)
    held[[0, 7, 8, 9, 30, 63, 64, 76]] = True
    bits = np.packbits(held)
    for first, count in ((0, 77), (5, 10), (8, 8), (63, 2), (70, 7), (76, 1)):
        assert np.array_equal(_row_bits(bits, first, count), held[first:first + count])
    pytest.importorskip("lance")
    import lance
    import pyarrow as pa

    from robustir.scale.job import OutputJob
    from robustir.scale.ray_encode import _held_rows

    job = OutputJob(tmp_path / "vectors.lance")
    assert _held_rows(job, 77)[1] == 0
    ids = pa.array([f"{i:012d}" for i in np.flatnonzero(held)[::-1]], pa.string())
    lance.write_dataset(pa.table({"id": ids}), job.uri)
    lance.write_dataset(pa.table({"id": pa.array([], pa.string())}), job.uri, mode="append")
    got, count = _held_rows(job, 77)
    assert count == 8 and np.array_equal(got, bits)


def test_a_resumed_encodings_ids_are_left_out_by_their_digests():
    """``encode --engine ray`` resumed: the read tasks leave out the ids the dataset holds by binary search in
    their sorted 128-bit digests (:func:`held_mask`), which Ray's object store holds instead of the driver -- the
    first, last and absent ids, ids with a shared prefix, non-ASCII ids and a lone surrogate included."""
    import numpy as np

    from robustir.io import text_digest
    from robustir.scale.ray_inputs import held_mask

    held_ids = ["a", "doc-1", "doc-10", "é-ü", "\ud800x", "z" * 300]
    held = np.sort(np.array([text_digest(i, 16) for i in held_ids], dtype="S16"))
    asked = ["doc-1", "doc-11", "doc-10", "", "é-ü", "e-u", "\ud800x", "z" * 299, "z" * 300, "a", "b"]
    assert held_mask(asked, held).tolist() == [i in held_ids for i in asked]
    assert held_mask(asked, np.empty(0, "S16")).tolist() == [False] * len(asked)
    assert held_mask([], held).tolist() == []


def test_a_damaged_mining_cache_is_refused_when_its_vectors_are_written_in_row_order(tmp_path):
    """``write_in_row_order`` (mining's ``.npy`` from the Ray encoding's Lance dataset) checks the rows as it writes
    them, since mining skips the duplicate-id check: a row held twice -- in one batch or in two fragments -- or a
    row outside the corpus is a ConfigError saying to delete the cache, never a silently wrong or short ``.npy``."""
    import numpy as np
    import pytest

    pytest.importorskip("lance")
    import lance
    import pyarrow as pa

    from robustir.errors import ConfigError
    from robustir.index.dense import EmbeddingFile
    from robustir.scale.ray_encode import write_in_row_order

    def dataset(name: str, *parts: list[int]) -> str:
        uri = str(tmp_path / f"{name}.lance")
        for i, rows in enumerate(parts):
            vectors = pa.array(np.repeat(np.asarray(rows, np.float32), 4))
            lance.write_dataset(pa.table({"id": pa.array([f"{r:012d}" for r in rows], pa.string()),
                                          "vector": pa.FixedSizeListArray.from_arrays(vectors, 4)}),
                                uri, mode="append" if i else "create")
        return uri

    def write(uri: str, n: int = 6) -> np.ndarray:
        file = EmbeddingFile.create(tmp_path / f"{Path(uri).stem}.npy", n, 4)
        try:
            assert write_in_row_order(uri, file) == n
        finally:
            file.close()
        return EmbeddingFile(tmp_path / f"{Path(uri).stem}.npy").rows(0, n)

    got = write(dataset("good", [4, 0, 5], [2, 1, 3]))
    assert np.array_equal(got[:, 0], np.arange(6, dtype=np.float32))
    for name, parts, message in (("twice-in-a-batch", ([0, 1, 1, 2],), "holds row 1 twice"),
                                 ("twice-in-two-fragments", ([0, 1, 2], [3, 2, 4]), "holds row 2 twice"),
                                 ("outside", ([0, 1, 6],), "holds row 6 of a corpus of 6 rows")):
        with pytest.raises(ConfigError, match=f"{message}; delete it and run again"):
            write(dataset(name, *parts))
