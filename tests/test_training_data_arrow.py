"""Training data as a memory-mapped Arrow dataset: the conversion (same records, same errors as the list reader),
its cache (reused, invalidated, a killed conversion redone), row / pair / pool access by index across record
batches, the sampler on it (the batches robustir always gave for a seed) and resume on it."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
from pathlib import Path

import pytest

from robustir.data import arrow_store
from robustir.data.arrow_store import convert_training_files
from robustir.data.training_data import TrainingExample, load_training_data
from robustir.errors import ConfigError, DataError
from robustir.training.data import GroupSampler

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def write_lines(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode("utf-8")))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def varied_records(n: int, start: int = 0) -> list[dict]:
    """Records with 1-3 positives, 0-3 negatives, scores, prompts, metadata and skipped ones."""
    records = []
    for i in range(start, start + n):
        record: dict = {"query": f"query {i} é", "pos": [f"pos {i} a"] + [f"pos {i} {c}" for c in "bc"[: i % 3]]}
        if i % 4:
            record["neg"] = [f"neg {i} {j}" for j in range(i % 4)]
            record["neg_scores"] = [0.5 + j for j in range(i % 4)]
        if i % 5 == 0:
            record["prompt"] = "Represent this: "
        if i % 6 == 0:
            record["query_id"] = f"q{i}"
        if i % 11 == 0:
            record["pos"] = ["  "]  # skipped: no non-empty positive
        records.append(record)
    return records


def golden_examples() -> list[TrainingExample]:
    """The data whose batches were pinned with the list-based sampler, before training data moved to Arrow."""
    examples = []
    for i in range(37):
        pos = [f"pos {i} a"] + ([f"pos {i} b"] if i % 3 == 0 else []) + ([f"pos {i} c"] if i % 7 == 0 else [])
        neg = [f"neg {i} {j}" for j in range(i % 4)]  # none, a few, enough
        examples.append(TrainingExample(f"query {i}", pos, neg, prompt="P: " if i % 5 == 0 else None))
    return examples


def batches_digest(sampler: GroupSampler, world: int) -> str:
    batches = [[(g.query, g.prompt, g.passages, list(g.positives)) for g in sampler.batch(step, r)]
               for step in range(3 * sampler.steps_per_epoch + 1) for r in range(world)]
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16]


#: batches of golden_examples() (seed 11, batch 4, 3 epochs and a step) from the list-based GroupSampler that
#: robustir had before the Arrow data: the Arrow path must give exactly these
PINNED = {"pairs-0-1": "91b7ba5f8584c753", "pairs-0-2": "0b1c2cbb80a86d09", "pairs-2-1": "a44850023f84506d",
          "pairs-2-2": "77c6ccba20aea75e", "pairs-3-1": "de03ec2fdfa1e885", "pairs-3-2": "318fef6b1ac72c0d",
          "queries-0-1": "8668256963ef4993", "queries-0-2": "ced686f77d2cedfb", "queries-2-1": "a31572b1f607c70d",
          "queries-2-2": "089b8efb8bb8d6f9", "queries-3-1": "9cfd243222896608", "queries-3-2": "1fb6edb85011bc60"}


@pytest.fixture
def small_batches(monkeypatch):
    """Record batches of 5 rows, so that every lookup crosses batch (chunk) boundaries."""
    monkeypatch.setattr(arrow_store, "BATCH_ROWS", 5)


# ---------------------------------------------------------------------------- conversion

def test_conversion_holds_what_the_list_reader_reads(tmp_path, small_batches):
    folder = tmp_path / "data"
    write_lines(folder / "a.jsonl", varied_records(30))
    write_lines(folder / "b.jsonl.gz", varied_records(17, start=30))
    examples, stats = load_training_data(folder)
    rows = convert_training_files(folder, tmp_path / "cache")
    assert len(rows) == len(examples) and rows.stats["read"] == stats["read"] == 47
    assert rows.stats["skipped_empty"] == stats["skipped_empty"] == 5
    assert [r.to_json() for r in rows] == [e.to_json() for e in examples]  # streamed, batch by batch
    assert [rows[i].to_json() for i in range(len(rows))] == [e.to_json() for e in examples]  # by index
    assert rows[-1].to_json() == examples[-1].to_json()
    assert [rows.row(i) for i in range(len(rows))] == [(e.query, e.pos, e.neg, e.prompt) for e in examples]
    assert rows._table.column("query").num_chunks > 5  # the lookups above crossed record batches
    dataset = rows.dataset  # the same file through the datasets API
    assert len(dataset) == len(rows)
    assert (dataset[7]["query"], dataset[7]["pos"]) == (examples[7].query, examples[7].pos)
    # pairs: row by row, positive by positive; the pool: every positive, then every negative
    pairs = [(i, j) for i, e in enumerate(examples) for j in range(len(e.pos))]
    assert rows.num_pairs == len(pairs) and [rows.pair(n) for n in range(len(pairs))] == pairs
    pool = [p for e in examples for p in e.pos] + [n for e in examples for n in e.neg]
    assert rows.pool_size == len(pool) and [rows.pool_passage(i) for i in range(len(pool))] == pool
    assert list(rows.rows_without_negatives()) == [i for i, e in enumerate(examples) if not e.neg]
    own = set(examples[0].pos)
    outside = rows.pool_outside(own)
    assert len(outside) == sum(p not in own for p in pool) and list(outside) == [p for p in pool if p not in own]
    with pytest.raises(IndexError):
        rows.pair(len(pairs))


@pytest.mark.parametrize("record, message", [
    ({"pos": ["p"]}, "line 2, field 'query': missing field 'query'"),
    ({"query": "q", "pos": "p"}, "field 'pos': expected a list of strings, got a single string"),
    ({"query": "q", "pos": ["p"], "neg": ["n"], "neg_scores": [1, 2]}, "field 'neg_scores': has 2 scores for 1"),
])
def test_conversion_errors_are_the_list_readers(tmp_path, record, message):
    path = write_lines(tmp_path / "train.jsonl", [{"query": "ok", "pos": ["ok"]}, record])
    with pytest.raises(DataError) as listed:
        load_training_data(path)
    with pytest.raises(DataError) as converted:
        convert_training_files(path, tmp_path / "cache")
    assert str(converted.value) == str(listed.value) and message in str(converted.value)
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written is left to be used
    empty = write_lines(tmp_path / "empty.jsonl", [{"query": " ", "pos": ["p"]}])
    with pytest.raises(DataError, match="no usable training example"):
        convert_training_files(empty, tmp_path / "cache")


def test_cache_is_reused_and_invalidated_when_the_file_changes(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "train.jsonl", varied_records(12))
    builds = []
    original = arrow_store._build
    monkeypatch.setattr(arrow_store, "_build", lambda folder, *a: (builds.append(folder), original(folder, *a)))
    first = convert_training_files(path, tmp_path / "cache")
    again = convert_training_files(path, tmp_path / "cache")
    assert len(builds) == 1 and again.folder == first.folder  # reused, not converted again
    copy = write_lines(tmp_path / "elsewhere" / "train.jsonl", varied_records(12))
    assert convert_training_files(copy, tmp_path / "cache").folder == first.folder and len(builds) == 1  # by content
    write_lines(path, varied_records(13))  # the file changes: a new conversion
    changed = convert_training_files(path, tmp_path / "cache")
    assert len(builds) == 2 and changed.folder != first.folder and len(changed) == len(load_training_data(path)[0])
    assert len(first) == len(load_training_data(copy)[0])  # the old entry is intact for the old content


def test_a_killed_conversion_is_redone_not_half_used(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "train.jsonl", varied_records(40))
    cache = tmp_path / "cache"
    original = arrow_store._Writer.add
    calls = []

    def dies(self, *args):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt  # killed in the middle of the conversion
        return original(self, *args)

    monkeypatch.setattr(arrow_store._Writer, "add", dies)
    with pytest.raises(KeyboardInterrupt):
        convert_training_files(path, cache)
    monkeypatch.setattr(arrow_store._Writer, "add", original)
    assert not list(cache.iterdir())  # no entry, no partial folder
    # a hard kill (no clean-up ran): a partial folder of a dead process and an entry without its complete record
    rows = convert_training_files(path, cache)
    key = rows.folder.name
    (cache / f"{key}.run.json").unlink()
    (cache / f"{key}.partial-999999999").mkdir()
    again = convert_training_files(path, cache)
    assert arrow_store.is_complete(again.folder) and not (cache / f"{key}.partial-999999999").exists()
    assert [r.to_json() for r in again] == [e.to_json() for e in load_training_data(path)[0]]


def _damage(kind: str, data: Path, stats: Path, batch_end: int) -> None:
    raw = data.read_bytes()
    if kind == "truncated at a batch boundary":
        data.write_bytes(raw[:batch_end])
    elif kind == "truncated mid-batch":
        data.write_bytes(raw[: batch_end + 40])
    elif kind == "bytes flipped":
        middle = len(raw) // 2
        data.write_bytes(raw[:middle] + bytes(b ^ 0xFF for b in raw[middle:middle + 8]) + raw[middle + 8:])
    elif kind == "empty":
        data.write_bytes(b"")
    elif kind == "random":
        data.write_bytes(bytes(range(256)) * (len(raw) // 256 + 1))
    elif kind == "bad stats.json":
        stats.write_text('{"rows": "many"')


@pytest.mark.parametrize("kind", ["truncated at a batch boundary", "truncated mid-batch", "bytes flipped", "empty",
                                  "random", "bad stats.json"])
def test_a_damaged_cache_is_converted_again_never_used(kind, tmp_path, monkeypatch, caplog):
    """Every kind of damage is caught against the record written with the entry: converted again with one
    warning, all rows back, no traceback. (On 5245875 a cut at a batch boundary trained on the rows before it
    with exit 0, flipped bytes were trained on, and the other damages raised a traceback on every re-run.)"""
    import pyarrow as pa

    monkeypatch.setattr(arrow_store, "BATCH_ROWS", 8)  # several record batches from a small file
    path = write_lines(tmp_path / "train.jsonl", varied_records(40))
    expected = [e.to_json() for e in load_training_data(path)[0]]
    first = convert_training_files(path, tmp_path / "cache")
    assert len(first) == len(expected) > 16
    data, stats = first.folder / "data.arrow", first.folder / "stats.json"
    with pa.ipc.open_stream(data.read_bytes()) as reader:  # where the first record batch ends
        first_batch = reader.read_next_batch()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, first_batch.schema) as writer:
        writer.write_batch(first_batch)
    batch_end = sink.getvalue().size - 8  # the stream's schema + first batch, without the end-of-stream marker
    del first
    _damage(kind, data, stats, batch_end)
    caplog.clear()
    with caplog.at_level("WARNING", logger="robustir"):
        again = convert_training_files(path, tmp_path / "cache")
    assert [r.to_json() for r in again] == expected
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "damaged" in r.getMessage()]
    assert len(warnings) == 1 and str(again.folder) in warnings[0].getMessage()


# ---------------------------------------------------------------------------- the sampler on Arrow rows

@pytest.mark.parametrize("unit", ["pairs", "queries"])
@pytest.mark.parametrize("k", [0, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_batches_are_the_ones_robustir_always_gave(tmp_path, small_batches, unit, k, world):
    examples = golden_examples()
    listed = GroupSampler(examples, k, 4, world, seed=11, epoch_unit=unit)
    path = write_lines(tmp_path / "golden.jsonl", [e.to_json() for e in examples])
    rows = convert_training_files(path, tmp_path / "cache")
    mapped = GroupSampler(rows, k, 4, world, seed=11, epoch_unit=unit)
    assert batches_digest(mapped, world) == batches_digest(listed, world) == PINNED[f"{unit}-{k}-{world}"]


def test_sampler_holds_no_list_of_the_data(tmp_path):
    """What the sampler holds (and a DataLoader worker receives) does not grow with the data: the rows pickle as
    their folder, the pool is read by index."""
    sizes = []
    for n in (200, 4000):
        path = write_lines(tmp_path / f"train-{n}.jsonl", [{"query": f"q{i}", "pos": [f"p{i}"]} for i in range(n)])
        sampler = GroupSampler(convert_training_files(path, tmp_path / "cache"), 1, 8, 1, seed=0, epoch_unit="pairs")
        group = sampler.batch(3, 0)[0]
        assert group.passages[1] != group.passages[0]  # drawn from the pool of other examples' passages
        blob = pickle.dumps(sampler)
        assert pickle.loads(blob).batch(3, 0) == sampler.batch(3, 0)
        sizes.append(len(blob))
    assert sizes[1] < sizes[0] + 200, sizes


def test_pool_check_without_materialising_the_pool(tmp_path):
    # one query whose 70 positives are the whole pool (more than the conversion's sample of distinct passages)
    own = [f"passage {j}" for j in range(70)]
    records = [{"query": "greedy", "pos": own}] + [{"query": f"q{i}", "pos": [own[i]]} for i in range(7)]
    path = write_lines(tmp_path / "covered.jsonl", records)
    rows = convert_training_files(path, tmp_path / "cache")
    assert not rows.stats["pool_sample_complete"]
    with pytest.raises(ConfigError, match=r"training example 1 \(query 'greedy'\) has no hard negatives"):
        GroupSampler(rows, 1, 4, 1, seed=0)
    records.append({"query": "other", "pos": ["a passage of its own"]})
    rows = convert_training_files(write_lines(tmp_path / "fine.jsonl", records), tmp_path / "cache")
    group = GroupSampler(rows, 2, 4, 1, seed=0, epoch_unit="queries").group(0, epoch=0)
    assert group.passages[1:] == ["a passage of its own"] * 2  # the only passage outside its own positives


def test_resume_in_the_middle_of_an_epoch_on_arrow_data(tiny_model_dir, tmp_path):
    """Arrow rows (the trainer's only path): 30 pairs, batch 4 -> 7 steps an epoch; stop after 3, resume to 5."""
    from safetensors.torch import load_file

    from robustir.training.arguments import TrainConfig
    from robustir.training.trainer import train

    records = [{"query": f"what does report {i} say", "pos": [f"report {i} explains topic {i % 5}"] * (1 + i % 2),
                "neg": [f"unrelated text {i}"]} for i in range(20)]
    data = write_lines(tmp_path / "train.jsonl", records)

    def config(output: str) -> TrainConfig:
        return TrainConfig(model=tiny_model_dir, train_data=str(data), output=str(tmp_path / output), batch_size=4,
                           max_steps=5, save_steps=10, passage_max_length=32, query_max_length=16, probe_size=4,
                           lr=1e-3, seed=3, report=False)

    full = train(config("full"))
    assert train(config("resumed"), stop_after=3).steps == 3
    resumed = train(config("resumed"))
    a = load_file(str(full.model_path / "model.safetensors"))
    b = load_file(str(resumed.model_path / "model.safetensors"))
    assert all(a[k].equal(b[k]) for k in a)
    logs = [[json.loads(x)["loss"] for x in (tmp_path / o / "train_log.jsonl").read_text().splitlines()]
            for o in ("full", "resumed")]
    assert logs[0] == pytest.approx(logs[1], rel=1e-6)
    entries = [p for p in (tmp_path / "full" / "data-cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and arrow_store.is_complete(entries[0])  # converted once, under <output>/data-cache


def test_beir_split_is_converted_and_reused(tmp_path, monkeypatch):
    from robustir.data.training_data import examples_from_beir
    from robustir.training.arguments import TrainConfig
    from robustir.training.trainer import prepare_examples

    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    write_lines(root / "corpus.jsonl", [{"_id": f"d{i}", "title": f"t{i}", "text": f"document {i}"} for i in range(9)])
    write_lines(root / "queries.jsonl", [{"_id": f"q{i}", "text": f"question {i}"} for i in range(6)])
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                              "".join(f"q{i}\td{i}\t1\nq{i}\td{i + 3}\t2\n" for i in range(6)))
    config = TrainConfig(train_data=str(root), mine="none", output=str(tmp_path / "run"))
    builds = []
    original = arrow_store._build
    monkeypatch.setattr(arrow_store, "_build", lambda folder, *a: (builds.append(folder), original(folder, *a)))
    (first,) = prepare_examples(config, None, True, lambda: None)
    (again,) = prepare_examples(config, None, True, lambda: None)
    assert len(builds) == 1 and again.rows.folder == first.rows.folder
    assert first.rows.folder.parent == tmp_path / "run" / "data-cache"
    assert [r.to_json() for r in first.rows] == [e.to_json() for e in examples_from_beir(root, "train")]
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")  # another split content
    (changed,) = prepare_examples(config, None, True, lambda: None)
    assert len(builds) == 2 and len(changed.rows) == 1
