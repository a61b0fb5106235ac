"""Training data as a memory-mapped Arrow file, read row by row by index.

PEG trains on 110M pairs; read into Python lists that is tens of GB before the first step. Here FlagEmbedding
JSONL (a file, a folder of ``*.jsonl`` / ``*.jsonl.gz``) is converted **once** into an Arrow file, every record
going through :func:`robustir.data.training_data.parse_example` (so every check and error message is the one the
list reader gives), and training reads rows by index from the memory-mapped file: the memory a run holds no
longer grows with the number of examples. The file is an Arrow IPC stream, the format ``datasets`` keeps its own
cache in: :attr:`TrainingRows.dataset` opens it as a ``datasets.Dataset``; training maps it itself, to advise the
kernel of its random access and to release the pages it has read (:class:`TrainingRows`).

Cache
-----
A conversion is cached by content: ``<cache_dir>/<key>/`` where ``key`` digests the format version and the
SHA-256 of every input file (:func:`robustir.io.input_digest`, the digest the run fingerprint holds too), so a
changed file is converted again and an unchanged one (under any path) is reused. An entry holds::

    data.arrow   Arrow IPC stream, record batches of at most 4,096 rows (and about 64 MB of text)
    stats.json   counts gathered while converting (rows, positives, negatives, records skipped, files, ...)

and its record ``<key>.run.json`` (:class:`robustir.runs.Artifact`), written last: the row count and the size and
SHA-256 of both files. It is built in ``<key>.partial-<pid>/`` and renamed into place before the record is
written, so a killed conversion leaves no usable entry and is redone from the start by the next run. Before an
entry is used its files are checked against the record (the main process verifies the checksums, the others the
sizes): a truncated, emptied or altered entry is converted again, with one warning -- never trained on.

Columns: ``query`` (str), ``pos`` / ``neg`` (list[str]), ``pos_scores`` / ``neg_scores`` (list[float] or null),
``prompt`` (str or null), ``extra`` (JSON text of the record's other fields), ``file`` (index into
``stats["files"]``) and ``line`` (its line number there).

:class:`TrainingRows` is the read side: ``rows[i]`` is a :class:`~robustir.data.training_data.TrainingExample`,
:meth:`TrainingRows.row` the four fields a training group needs, :meth:`TrainingRows.pair` the row and
positive of the ``n``-th (query, positive) pair, and :meth:`TrainingRows.pool_passage` the ``n``-th passage of
the "every positive, then every negative" pool that examples without negatives draw from -- all by index into
the memory-mapped columns, nothing materialised.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..errors import DataError
from ..io import input_digest, write_json
from ..runs import Artifact, fingerprint
from .training_data import TrainingExample, iter_training_records, training_files

__all__ = ["TrainingRows", "convert_training_files", "convert_examples", "passage_hash", "FORMAT"]

logger = logging.getLogger(__name__)

# 2: an empty positive list is an error (or skipped and counted with skip_empty_positives)
FORMAT = 2  # bump when the columns or the stats change: older cache entries are then converted again
DATA_FILE, STATS_FILE = "data.arrow", "stats.json"
BATCH_ROWS = 4096
BATCH_BYTES = 64 << 20  # list<string> offsets are 32-bit: keep every record batch far below 2 GiB of text
#: distinct pool passages remembered at conversion: with more than any row's positives, no row can find its own
#: positives to be the whole pool, so the sampler's construction-time check needs no scan
POOL_SAMPLE = 64
#: row reads between two releases of the mapped pages (:meth:`TrainingRows.release`): bounds the file pages a run
#: keeps mapped (each page fault maps its neighbours too), at the cost of a re-fault (from the page cache) per read
RELEASE_EVERY = 16


def passage_hash(text: str) -> str:
    """A stable 64-bit digest of a passage (hex), for the distinct-passage statistics."""
    from ..io import text_digest

    return text_digest(text).hex()


def _schema():
    import pyarrow as pa

    return pa.schema([("query", pa.string()), ("pos", pa.list_(pa.string())), ("neg", pa.list_(pa.string())),
                      ("pos_scores", pa.list_(pa.float64())), ("neg_scores", pa.list_(pa.float64())),
                      ("prompt", pa.string()), ("extra", pa.string()), ("file", pa.int32()), ("line", pa.int64())])


class _Writer:
    """Streams examples into an Arrow IPC stream in bounded record batches and gathers the stats."""

    def __init__(self, sink: Any) -> None:
        import pyarrow as pa

        self.schema = _schema()
        self.writer = pa.ipc.new_stream(sink, self.schema)
        self.columns: dict[str, list] = {name: [] for name in self.schema.names}
        self.pending_bytes = 0
        self.rows = self.pos_total = self.neg_total = self.rows_without_neg = self.max_pos = 0
        self.pool_sample: dict[str, None] = {}  # insertion-ordered set of passage hashes
        self.pool_complete = True

    def add(self, example: TrainingExample, file: int = 0, line: int = 0) -> None:
        columns = self.columns
        columns["query"].append(example.query)
        columns["pos"].append(example.pos)
        columns["neg"].append(example.neg)
        columns["pos_scores"].append(example.pos_scores)
        columns["neg_scores"].append(example.neg_scores)
        columns["prompt"].append(example.prompt)
        columns["extra"].append(json.dumps(example.extra, ensure_ascii=False) if example.extra else "{}")
        columns["file"].append(file)
        columns["line"].append(line)
        self.rows += 1
        self.pos_total += len(example.pos)
        self.neg_total += len(example.neg)
        self.rows_without_neg += not example.neg
        self.max_pos = max(self.max_pos, len(example.pos))
        if self.pool_complete:
            for text in (*example.pos, *example.neg):
                self.pool_sample[passage_hash(text)] = None
                if len(self.pool_sample) > POOL_SAMPLE:
                    self.pool_complete = False
                    break
        self.pending_bytes += len(example.query) + sum(map(len, example.pos)) + sum(map(len, example.neg))
        if len(columns["query"]) >= BATCH_ROWS or self.pending_bytes >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self.columns["query"]:
            return
        self.writer.write_batch(pa.RecordBatch.from_pydict(self.columns, schema=self.schema))
        self.columns = {name: [] for name in self.schema.names}
        self.pending_bytes = 0

    def close(self) -> dict:
        self.flush()
        self.writer.close()
        return {"rows": self.rows, "pos_total": self.pos_total, "neg_total": self.neg_total,
                "rows_without_neg": self.rows_without_neg, "max_pos": self.max_pos,
                "pool_sample": list(self.pool_sample), "pool_sample_complete": self.pool_complete}


# ---------------------------------------------------------------------------- conversion (cached)

def _cache_key(kind: str, digest: dict, extra: dict | None = None) -> str:
    blob = json.dumps({"format": FORMAT, "kind": kind, "files": digest.get("files", {}), **(extra or {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _entry(folder: Path) -> Artifact:
    return Artifact(folder, what="training-data cache")


def is_complete(folder: Path, *, checksums: bool = True) -> bool:
    """Whether cache entry ``folder`` is complete and its files are what was written (sizes and, with
    ``checksums``, SHA-256 as recorded in ``<folder>.run.json``)."""
    check = _entry(folder).check()
    return check.state == "complete" and not (check.problems if checksums else
                                              [p for p in check.problems if "checksum" not in p])


def _usable(folder: Path, convert: bool) -> bool:
    """The start rule of one entry: a complete, verified entry is used; a damaged one (truncated, bytes flipped, a
    file replaced) is removed with one warning so it is converted again. The main process (``convert``) verifies
    checksums; the others, which open it after the main one did, check sizes only."""
    check = _entry(folder).check()
    problems = check.problems if convert else [p for p in check.problems if "checksum" not in p]
    if check.state == "complete" and not problems:
        return True
    if convert and check.state == "complete":
        logger.warning("%s: the cached conversion is damaged (%s): converting again", folder, "; ".join(problems))
        _entry(folder).clear()
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _build(folder: Path, fill: Callable[[_Writer], dict], describe: str) -> None:
    """Build cache entry ``folder`` through ``<folder>.partial-<pid>``, renamed into place once complete."""
    import pyarrow as pa

    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # no complete record: an entry from a crash or copied in part; never used
        logger.warning("%s: incomplete conversion found (no complete record %s): converting again", folder,
                       _entry(folder).record_path.name)
        _entry(folder).clear()
    for stale in folder.parent.glob(f"{folder.name}.partial-*"):  # left by a killed conversion
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    started = time.perf_counter()
    logger.info("converting %s into a memory-mapped Arrow file (once; cached in %s)", describe, folder)
    try:
        with pa.OSFile(str(partial / DATA_FILE), "wb") as sink:
            writer = _Writer(sink)
            try:
                extra = fill(writer)
            finally:
                stats = writer.close()
        write_json(partial / STATS_FILE, {"format": FORMAT, **stats, **extra})
        try:
            os.rename(partial, folder)
        except OSError:
            if not is_complete(folder):  # not "another process finished the same conversion first"
                raise
            shutil.rmtree(partial, ignore_errors=True)
        else:  # the record, written last, makes the entry complete: sizes and checksums of what was written
            entry = _entry(folder)
            entry.start(fingerprint("arrow-cache", {"format": FORMAT, "source": describe}))
            entry.finish({"rows": stats["rows"], "seconds": round(time.perf_counter() - started, 3)},
                         files=[DATA_FILE, STATS_FILE], checksums=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logger.info("converted %s: %d rows in %.1f s", describe, stats["rows"], time.perf_counter() - started)


def convert_training_files(path: str | Path, cache_dir: str | Path, *, digest: dict | None = None,
                           convert: bool = True, skip_empty_positives: bool = False) -> "TrainingRows":
    """The training JSONL file or folder ``path`` as :class:`TrainingRows`, converted on first use.

    ``digest``: :func:`~robustir.io.input_digest` of ``training_files(path)`` when the caller has it already (the
    run fingerprint's), else computed here. ``convert=False`` (processes other than the main one, after it
    converted): the entry must exist. Raises :class:`~robustir.errors.DataError` for a malformed record (the
    message of :func:`~robustir.data.training_data.parse_example`) and when no record is usable.
    ``skip_empty_positives``: skip records with an empty ``pos`` list instead (part of the cache key: a conversion
    that skipped them is not reused by a run that refuses them).
    """
    files = training_files(path)
    digest = digest if digest is not None else input_digest(files)
    folder = Path(cache_dir) / _cache_key("jsonl", digest, {"skip_empty_positives": True} if skip_empty_positives
                                          else None)
    if not _usable(folder, convert):
        if not convert:
            raise FileNotFoundError(f"{folder}: the converted training data is not there (the main process "
                                    "converts it first)")

        def fill(writer: _Writer) -> dict:
            stats: dict = {}
            for index, line, example in iter_training_records(path, stats, files,
                                                              skip_empty_positives=skip_empty_positives):
                writer.add(example, index, line)
            if not writer.rows:
                raise DataError(path, "no usable training example", fix="each line needs a non-empty query and pos")
            return {**stats, "files": [str(f) for f in files], "digest": digest.get("files", {})}

        _build(folder, fill, str(path))
    else:
        logger.info("training data %s: reusing its Arrow conversion %s", path, folder)
    return TrainingRows.open(folder)


def convert_examples(examples: Callable[[], Iterable[TrainingExample]], cache_dir: str | Path, *, digest: dict,
                     kind: str, describe: str, key_extra: dict | None = None, convert: bool = True) -> "TrainingRows":
    """Examples built in code (a BEIR split's qrels) as :class:`TrainingRows`, cached under ``digest`` (of the files
    they come from) plus ``kind`` and ``key_extra`` (e.g. the split). ``examples()`` is called only to convert."""
    folder = Path(cache_dir) / _cache_key(kind, digest, key_extra)
    if not _usable(folder, convert):
        if not convert:
            raise FileNotFoundError(f"{folder}: the converted training data is not there")

        def fill(writer: _Writer) -> dict:
            for example in examples():
                writer.add(example)
            if not writer.rows:
                raise DataError(describe, "no usable training example")
            return {"read": writer.rows, "skipped_empty": 0, "files": [describe], "digest": digest.get("files", {})}

        _build(folder, fill, describe)
    else:
        logger.info("training data %s: reusing its Arrow conversion %s", describe, folder)
    return TrainingRows.open(folder)


# ---------------------------------------------------------------------------- reading

def _release(mapping: Any) -> None:
    """``MADV_DONTNEED`` on a read-only file mapping: its pages leave this process's resident set (not the page
    cache); the next access maps them again, with the same content."""
    import mmap

    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


class TrainingRows(Sequence):
    """Converted training data, read by row index; ``rows[i]`` is the i-th :class:`TrainingExample`.

    :meth:`open` memory-maps a cache entry: the columns stay in the page cache, not in this process's heap. The
    mapping is advised random access (no read-ahead), and the pages it has mapped are released every
    :data:`RELEASE_EVERY` row reads (``MADV_DONTNEED``: they stay in the page cache, the next read maps its page
    again), so the resident set does not creep up to the file's size over an epoch of random reads.
    :attr:`dataset` opens the same file as a ``datasets.Dataset`` for whoever wants that API.
    :meth:`from_examples` builds the same columns in memory from a list (small data, tests). Both read through the
    same code, so they give the same rows, pairs and pool passages. Pickling a memory-mapped one carries its folder
    only (a DataLoader worker maps the file again).
    """

    def __init__(self, table: Any, stats: dict, folder: Path | None = None, mapping: Any = None) -> None:
        self.folder = folder
        self.stats = stats
        self._mapping = mapping  # the mmap the table's buffers point into (None: in memory)
        self._reads = 0
        self._index(table)
        self.release()

    @classmethod
    def open(cls, folder: str | Path) -> "TrainingRows":
        import mmap

        import pyarrow as pa

        folder = Path(folder)
        if not is_complete(folder, checksums=False):
            raise FileNotFoundError(f"{folder} is not a complete training-data conversion")
        stats = json.loads((folder / STATS_FILE).read_text(encoding="utf-8"))
        with open(folder / DATA_FILE, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)
        reader = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(mapping)))  # zero-copy views into the mapping
        batches = []
        for batch in reader:  # batch by batch: each message header read maps its neighbour pages; drop them
            batches.append(batch)
            if len(batches) % 32 == 0:
                _release(mapping)
        table = pa.Table.from_batches(batches, schema=reader.schema)
        if table.num_rows != stats.get("rows"):  # sizes matched the record, so this is a bug, not damage
            raise DataError(folder / DATA_FILE, f"{table.num_rows} rows where {stats.get('rows')} were written",
                            fix=f"delete {folder} to convert the training data again")
        return cls(table, stats, folder, mapping)

    @property
    def dataset(self) -> Any:
        """The rows as a ``datasets.Dataset`` (memory-mapped by ``datasets``; None for in-memory rows)."""
        if self.folder is None:
            return None
        import datasets

        return datasets.Dataset.from_file(str(self.folder / DATA_FILE), in_memory=False)

    def release(self) -> None:
        """Unmap the file pages this process has touched (they stay in the page cache); reads map them again."""
        self._reads = 0
        if self._mapping is not None:
            _release(self._mapping)

    def _read(self, count: int = 1) -> None:
        self._reads += count
        if self._reads >= RELEASE_EVERY:
            self.release()

    @classmethod
    def from_examples(cls, examples: Iterable[TrainingExample]) -> "TrainingRows":
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        writer = _Writer(sink)
        for example in examples:
            writer.add(example)
        stats = {"format": FORMAT, **writer.close()}
        table = pa.ipc.open_stream(sink.getvalue()).read_all()
        return cls(table, stats)

    def _index(self, table: Any) -> None:
        self._table = table
        column = {name: table.column(name).chunks for name in ("query", "pos", "neg", "prompt")}
        self._query, self._pos, self._neg, self._prompt = (column[n] for n in ("query", "pos", "neg", "prompt"))
        # a record batch without any prompt is not read for one (two fewer pages touched per row)
        self._has_prompt = [chunk.null_count < len(chunk) for chunk in self._prompt]
        self._row_start = np.concatenate([[0], np.cumsum([len(c) for c in self._query], dtype=np.int64)])
        # zero-copy views of the list offsets (memory-mapped): row -> its passages, pair -> its row
        self._pos_offsets, self._neg_offsets, pos_counts, neg_counts = [], [], [], []
        for c, (pos, neg) in enumerate(zip(self._pos, self._neg)):
            for chunk, views, counts in ((pos, self._pos_offsets, pos_counts), (neg, self._neg_offsets, neg_counts)):
                offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[chunk.offset:chunk.offset + len(chunk) + 1]
                views.append(offsets)
                counts.append(int(offsets[-1]) - int(offsets[0]))
            if c % 32 == 31:
                self.release()  # a page of each offsets buffer's two ends was mapped, with its neighbours
        self._pos_start = np.concatenate([[0], np.cumsum(pos_counts, dtype=np.int64)])
        self._neg_start = np.concatenate([[0], np.cumsum(neg_counts, dtype=np.int64)])

    def __getstate__(self) -> dict:
        if self.folder is not None:
            return {"folder": str(self.folder)}
        return {"table": self._table, "stats": self.stats}

    def __setstate__(self, state: dict) -> None:
        if "folder" in state:
            opened = TrainingRows.open(state["folder"])
            self.__dict__.update(opened.__dict__)
        else:
            self.folder, self._mapping, self._reads, self.stats = None, None, 0, state["stats"]
            self._index(state["table"])

    # -------------------------------------------------------------------- sizes

    def __len__(self) -> int:
        return int(self._row_start[-1])

    @property
    def num_pairs(self) -> int:
        """(query, positive) pairs: the sum of every row's positives."""
        return int(self._pos_start[-1])

    @property
    def pool_size(self) -> int:
        """Passages of the pool examples without negatives draw from: every positive, then every negative."""
        return int(self._pos_start[-1] + self._neg_start[-1])

    @property
    def num_negatives(self) -> int:
        return int(self._neg_start[-1])

    # -------------------------------------------------------------------- rows

    def _locate(self, index: int) -> tuple[int, int]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"row {index} of {n}")
        chunk = int(np.searchsorted(self._row_start, index, side="right")) - 1
        return chunk, index - int(self._row_start[chunk])

    def row(self, index: int) -> tuple[str, list[str], list[str], str | None]:
        """``(query, pos, neg, prompt)`` of row ``index``."""
        c, i = self._locate(index)
        self._read()
        return (self._query[c][i].as_py(), self._pos[c][i].as_py(), self._neg[c][i].as_py(),
                self._prompt[c][i].as_py() if self._has_prompt[c] else None)

    def positives(self, index: int) -> list[str]:
        c, i = self._locate(index)
        return self._pos[c][i].as_py()

    def __getitem__(self, index: int) -> TrainingExample:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]  # type: ignore[return-value]
        c, i = self._locate(int(index))
        table_chunk = {name: self._table.column(name).chunk(c) for name in ("pos_scores", "neg_scores", "extra")}
        query, pos, neg, prompt = self.row(index)
        extra = table_chunk["extra"][i].as_py()
        return TrainingExample(query, pos, neg, table_chunk["pos_scores"][i].as_py(),
                               table_chunk["neg_scores"][i].as_py(), prompt,
                               json.loads(extra) if extra and extra != "{}" else {})

    def __iter__(self) -> Iterator[TrainingExample]:
        """Every example in order, one record batch at a time (memory bounded by the batch)."""
        for batch in self._table.to_batches():
            columns = {name: batch.column(name).to_pylist() for name in
                       ("query", "pos", "neg", "pos_scores", "neg_scores", "prompt", "extra")}
            self.release()
            for values in zip(*columns.values()):
                query, pos, neg, pos_scores, neg_scores, prompt, extra = values
                yield TrainingExample(query, pos, neg, pos_scores, neg_scores, prompt,
                                      json.loads(extra) if extra and extra != "{}" else {})

    def rows_without_negatives(self) -> Iterator[int]:
        """Indices of the rows with no negative, streamed from the offsets."""
        for c, offsets in enumerate(self._neg_offsets):
            empty = np.flatnonzero(np.diff(offsets) == 0)
            self._read(len(offsets))
            for i in empty:
                yield int(self._row_start[c] + i)

    # -------------------------------------------------------------------- pairs and the pool

    def pair(self, item: int) -> tuple[int, int]:
        """``(row, j)`` of (query, positive) pair ``item``: pairs are counted row by row, positive by positive."""
        if not 0 <= item < self.num_pairs:
            raise IndexError(f"pair {item} of {self.num_pairs}")
        c = int(np.searchsorted(self._pos_start, item, side="right")) - 1
        offsets = self._pos_offsets[c]
        local = item - int(self._pos_start[c]) + int(offsets[0])
        i = int(np.searchsorted(offsets, local, side="right")) - 1
        return int(self._row_start[c]) + i, local - int(offsets[i])

    def _flat(self, chunks: list, offsets: list[np.ndarray], starts: np.ndarray, index: int) -> str:
        c = int(np.searchsorted(starts, index, side="right")) - 1
        self._read()
        return chunks[c].values[int(offsets[c][0]) + index - int(starts[c])].as_py()

    def pool_passage(self, index: int) -> str:
        """Passage ``index`` of the pool: every row's positives in order, then every row's negatives."""
        positives = self.num_pairs
        if index < positives:
            return self._flat(self._pos, self._pos_offsets, self._pos_start, index)
        return self._flat(self._neg, self._neg_offsets, self._neg_start, index - positives)

    def _pool_chunks(self) -> Iterator[Any]:
        """The pool's passages as Arrow string arrays, in pool order (zero-copy slices)."""
        for chunks, offsets in ((self._pos, self._pos_offsets), (self._neg, self._neg_offsets)):
            for chunk, offs in zip(chunks, offsets):
                yield chunk.values.slice(int(offs[0]), int(offs[-1] - offs[0]))
                self._read(len(offs))

    def pool_outside(self, own: Iterable[str]) -> "PoolOutside":
        """The pool without the passages in ``own``, as a lazy sequence (one scan per access; for the rare
        example whose positives fill most of the pool)."""
        return PoolOutside(self, frozenset(own))

    def pool_within(self, own: Iterable[str]) -> bool:
        """Whether every pool passage is one of ``own`` (a scan that stops at the first other passage)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        value_set = pa.array(sorted(set(own)), type=pa.string())
        for values in self._pool_chunks():
            if len(values) and not pc.all(pc.is_in(values, value_set=value_set)).as_py():
                return False
        return True


class PoolOutside(Sequence):
    """``rows``' pool minus the passages in ``own``: ``len`` and ``[r]`` (the r-th such passage in pool order)
    scan the memory-mapped columns in bounded pieces; nothing is materialised."""

    def __init__(self, rows: TrainingRows, own: frozenset[str]) -> None:
        import pyarrow as pa

        self.rows = rows
        self._value_set = pa.array(sorted(own), type=pa.string())
        self._counts: list[int] | None = None

    def _keep(self, values: Any) -> Any:
        import pyarrow.compute as pc

        return pc.invert(pc.is_in(values, value_set=self._value_set))

    def __len__(self) -> int:
        if self._counts is None:
            import pyarrow.compute as pc

            self._counts = [int(pc.sum(self._keep(v)).as_py() or 0) if len(v) else 0
                            for v in self.rows._pool_chunks()]
        return sum(self._counts)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        total = len(self)
        if not 0 <= index < total:
            raise IndexError(f"passage {index} of {total}")
        assert self._counts is not None
        for values, count in zip(self.rows._pool_chunks(), self._counts):
            if index < count:
                kept = np.flatnonzero(self._keep(values).to_numpy(zero_copy_only=False))
                return values[int(kept[index])].as_py()
            index -= count
        raise AssertionError("unreachable")
