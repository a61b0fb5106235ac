"""Corpus (or query) encoding on a Ray cluster, with Lance as the data plane: ``robustir encode --engine ray``.

The corpus is read by Ray tasks (:mod:`robustir.scale.ray_inputs`: JSONL -- a large file in ranges of whole lines --, parquet, a
Hugging Face ``datasets`` folder or ``hf://datasets/ORG/NAME`` from the local cache; local or ``s3://``), each
applying robustir's checks (the same ids and text -- title and text joined as
:func:`robustir.data.beir.encoding_text` does -- as the single-process path); the rows the output already holds
(by id) are left out, and the rest goes through **one** Ray Data pipeline for the whole job::

    read tasks -> map_batches(_EncodeBatch, ActorPoolStrategy(concurrency .. max_concurrency), num_cpus, num_gpus)
        -> map_batches(_FragmentWriter)                      # fragment files written by Ray tasks, not the driver
        -> driver: one Lance commit (Append) per ``part_rows`` rows of fragment metadata

``_EncodeBatch`` is an actor: it loads the model once for the job and encodes every batch it is given with
:meth:`robustir.models.encoder.Encoder.encode` (length-sorted, the same code as one process). The driver sees only
the fragments' metadata (a few hundred bytes each), never a vector. A committed fragment is in the dataset whole;
a killed driver started again reads the ids the dataset holds and encodes only the others, so changing
``part_rows`` (or ``batch_rows``) between runs duplicates nothing, and the fragment files it wrote and never
committed are removed first (:func:`_remove_orphans`). A worker killed mid-batch is retried by Ray at most
``max_retries`` times (its actor restarted); a batch that kills its actor every time ends the job with an error
naming the batch (its smallest and largest id, :class:`_Ledger`), not an endless restart loop.

The output is a Lance dataset (``id``: string, ``vector``: fixed-size list of float32) at an absolute path or an
``s3://`` URI (:mod:`robustir.scale.job`: one driver per output, paths every node sees), beside its record (the
settings, the input's and the model's content, :class:`robustir.runs.Artifact`); another model or input is refused
(or, with ``overwrite``, made again), the same one finished is reused.

Ray Data, pylance and lance-ray are the optional extra ``robustir[scale]``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping

import numpy as np

from ..errors import ConfigError
from ..precision import Precision
from ..runs import fingerprint, operational
from ..validation import PositiveInt, Range, config_dataclass
from .job import OutputJob, absolute, check_cluster_sees
from .ray_inputs import READ_TASKS, _InputError, _parse_rows, _stream, id_digests, resolve_input

__all__ = ["RayEncodeConfig", "RayEncodeReport", "RayEncoderPool", "encode_documents_with_ray", "encode_with_ray",
           "read_vectors", "require_scale_extra", "write_in_row_order"]

logger = logging.getLogger(__name__)

#: the dataset's layout (in the record's fingerprint): 2 = id + vector, resumed by id (1 had a part column)
LAYOUT = 2


@config_dataclass
class RayEncodeConfig:
    """How the Ray engine encodes: the precision decides the vectors; the rest is how the work is spread."""

    precision: Precision = "auto"
    """Forward-pass precision on each actor's device; auto: bf16 where native, else fp32."""
    batch_size: PositiveInt = operational(64)
    """Texts per forward pass inside an actor."""
    batch_rows: PositiveInt = operational(2048)
    """Rows per Ray Data batch handed to an actor (each is length-sorted inside)."""
    part_rows: PositiveInt = operational(100_000)
    """Rows per Lance commit: a killed driver keeps every committed row and resumes by id (any value on resume)."""
    concurrency: PositiveInt = operational(1)
    """Encoder actors (one model load each, for the whole job); with max_concurrency, the fewest."""
    max_concurrency: PositiveInt | None = operational(None)
    """Autoscaling: Ray Data adds encoder actors up to this many while batches wait for one (and the cluster
    has the CPUs/GPUs), and lets idle ones go down to ``concurrency``; None: exactly ``concurrency``."""
    num_gpus: Annotated[float, Range(ge=0.0)] = operational(0.0)
    """GPUs per actor (0: CPU actors); e.g. 1 on a GPU cluster, 0.5 to pack two actors per GPU."""
    num_cpus: Annotated[float, Range(gt=0.0)] = operational(1.0)
    """CPUs per actor (its torch threads)."""
    max_retries: Annotated[int, Range(ge=0)] = operational(3)
    """Times a batch is retried after its actor died (kill -9, out of memory, a lost node); then the job stops
    with an error naming the batch."""
    address: str | None = operational(None)
    """Ray cluster to join (``ray://host:10001``, ``auto``); None: the running session, else a local one."""
    show_progress: bool = operational(True)
    """Ray Data's progress bars."""

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < self.concurrency:
            raise ConfigError(f"max_concurrency ({self.max_concurrency}) is below concurrency ({self.concurrency}): "
                              "the pool scales between concurrency (the fewest actors) and max_concurrency (the "
                              "most); raise max_concurrency or lower concurrency")

    def pool(self) -> Any:
        """Ray Data's actor pool: ``concurrency`` actors, or from ``concurrency`` to ``max_concurrency``."""
        import ray.data

        most = self.max_concurrency or self.concurrency
        return ray.data.ActorPoolStrategy(min_size=self.concurrency, max_size=most)


@dataclass
class RayEncodeReport:
    rows: int
    parts: int  # Lance commits made by this run
    resumed: int  # rows found committed by an earlier (killed) run and not encoded again
    seconds: float
    nothing_to_do: bool = False

    def format(self) -> str:
        if self.nothing_to_do:
            return f"nothing to do: {self.rows} rows already encoded"
        resumed = f", {self.resumed} committed earlier" if self.resumed else ""
        return f"{self.rows} rows in {self.parts} parts{resumed} ({self.seconds:.1f} s)"


class _PoolActor:
    """One model load; :meth:`encode` is :meth:`Encoder.encode` on a piece of the caller's texts."""

    def __init__(self, model: str, options: dict, device: str, on_call: Callable[[int], None] | None) -> None:
        from ..models.encoder import Encoder

        self.encoder = Encoder.from_pretrained(model, device=device, **options)
        self.on_call, self.calls = on_call, 0

    def encode(self, texts: list[str], kind: str, batch_size: int, precision: str) -> np.ndarray:
        self.calls += 1
        if self.on_call is not None:  # progress, or a fault injected by a test
            self.on_call(self.calls)
        return self.encoder.encode(texts, kind, batch_size=batch_size, precision=precision, show_progress=False)


class _Ledger:
    """Which batch each encoder actor is running, and how many times a batch's actor died under it (a plain Ray
    actor, no CPU): what names the batch that kills its actor every time, since Ray's error only says that an
    actor died.

    A Ray Data actor runs one call at a time (its ``max_concurrency`` is 1), so when an actor process dies the batch
    it was running is the one recorded for its actor id: a death counts against that batch only. Ray restarts the
    actor under the same id, and the restarted actor's :meth:`loaded` finds the batch its predecessor left running;
    the last death (no restart left) is the batch still running when the job fails. Counting unfinished *starts*
    instead (as before) also counted a batch that was only interrupted -- by the pool's shutdown, or retried after
    another actor's death -- and a tie then named whichever batch had started first."""

    def __init__(self) -> None:
        self.running: dict[str, str] = {}  # actor id -> the batch it started and has not finished
        self.deaths: dict[str, int] = {}  # batch -> times its actor died running it (seen at the restart)
        self.loads = 0

    def loaded(self, actor: str = "") -> None:
        self.loads += 1
        left = self.running.pop(actor, None)  # a restarted actor: its predecessor died running this batch
        if left is not None:
            self.deaths[left] = self.deaths.get(left, 0) + 1

    def started(self, batch: str, actor: str = "") -> None:
        self.running[actor] = batch

    def finished(self, batch: str, actor: str = "") -> None:
        if self.running.get(actor) == batch:
            del self.running[actor]

    def worst(self) -> tuple[str, int] | None:
        """The batch whose actors died most often, with its tries (the deaths seen at restarts, plus one when it
        was still running as the job failed: the death no restart followed); ties: the first batch by name."""
        running = set(self.running.values())
        tries = {batch: self.deaths.get(batch, 0) + (batch in running) for batch in {*self.deaths, *running}}
        if not tries:
            return None
        batch = min(tries, key=lambda name: (-self.deaths.get(name, 0), -tries[name], name))
        return batch, tries[batch]

    def model_loads(self) -> int:
        return self.loads


class _EncodeBatch(_PoolActor):
    """A Ray Data actor: one model load for the job, then each batch (a pyarrow table of id, text) encoded."""

    def __init__(self, model: str, kind: str, options: dict, precision: str, batch_size: int, device: str,
                 ledger: Any, on_batch: Callable[[int, list[str]], None] | None = None) -> None:
        import ray

        super().__init__(model, options, device, None)
        self.kind, self.precision, self.batch_size, self.ledger = kind, precision, batch_size, ledger
        self.on_batch, self.batches = on_batch, 0
        self.actor = ray.get_runtime_context().get_actor_id() or ""
        ray.get(ledger.loaded.remote(self.actor))

    def __call__(self, batch):
        import pyarrow as pa
        import pyarrow.compute as pc
        import ray

        ids = batch.column("id")
        # by its smallest and largest id: a batch's rows are in no order (Ray Data merges blocks as they come), so
        # its first and last rows need not bracket the one that kills the actor
        low, high = pc.min_max(ids).values()
        name = f"{low.as_py()} .. {high.as_py()} ({len(ids)} rows)"
        ray.get(self.ledger.started.remote(name, self.actor))  # recorded before the work that may kill this process
        self.batches += 1
        if self.on_batch is not None:  # progress, or a fault injected by a test
            self.on_batch(self.batches, ids.to_pylist())
        vectors = self.encode(batch.column("text").to_pylist(), self.kind, self.batch_size, self.precision)
        ray.get(self.ledger.finished.remote(name, self.actor))  # waited for: a kill -9 right after must not lose it
        flat = pa.array(vectors.reshape(-1), type=pa.float32())
        return pa.table({"id": ids, "vector": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})


def require_scale_extra(what: str) -> None:
    """A :class:`ConfigError` naming the missing package when the optional extra ``robustir[scale]`` is not
    installed (Ray Data, pylance, lance-ray)."""
    import importlib.util

    missing = [name for name in ("ray", "lance", "lance_ray") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{what} needs the optional extra: pip install 'robustir[scale]' ({', '.join(missing)} "
                          "not installed)")


#: tables smaller than this get their ANN index from LanceDB in the driver, not lance-ray: lance-ray trains IVF on
#: ``partitions * sample_rate`` rows and PQ on ``256 * sample_rate`` and refuses fewer, so a smaller table needs a
#: sample rate below Lance's 256 -- measured on 600 SciFact abstracts (bundled model, 24 cells, nprobes 8): recall@10
#: 0.725-0.895 (7 unseeded builds) against the exact hits with sample rate 2, where LanceDB's own build (every row)
#: kept 1.0. From 65,536 rows (256 x 256; the index's sqrt(n) cells need 256 sqrt(n) <= n) both sample 256 rows a
#: cell
DISTRIBUTED_ANN_MIN_ROWS = 65_536


class RayEncoderPool:
    """:meth:`Encoder.encode` spread over Ray actors, for a stage that encodes in chunks of its own and commits and
    resumes them itself (``robustir index --engine ray``): each call's texts are cut into one contiguous piece per
    actor and the vectors come back in order. An actor that dies (kill -9, a lost node) is restarted by Ray and its
    call retried, at most ``max_retries`` times; a piece that kills its actor every time raises a
    :class:`ConfigError` naming it (its first text and its place in the call) instead of restarting forever."""

    def __init__(self, encoder: Any, *, actors: int = 1, num_gpus: float = 0.0, num_cpus: float = 1.0,
                 address: str | None = None, device: str | None = None,
                 on_call: Callable[[int], None] | None = None, max_retries: int = 3) -> None:
        import dataclasses

        import ray

        from ..models.encoder import resolve_model_path

        require_scale_extra("engine: ray")
        _init_ray(address)
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus or None, max_restarts=max_retries,
                            max_task_retries=max_retries)(_PoolActor)
        model, options = absolute(resolve_model_path(encoder.source), "model"), dataclasses.asdict(encoder.config)
        check_cluster_sees({"model folder": model})
        device = device or ("cuda" if num_gpus else "cpu")
        self.max_retries, self.workers = max_retries, actors
        self.actors = [remote.remote(model, options, device, on_call) for _ in range(actors)]

    def build_vector_index(self, uri: str, storage_options: Mapping[str, Any] | None, kind: str,
                           partitions: int, rows: int) -> bool:
        """The index's ANN index (``kind`` ivf_hnsw_sq or ivf_pq, ``partitions`` IVF cells, dot product) built on
        the cluster by lance-ray's distributed ``create_index`` -- IVF (and PQ) trained once, then Ray tasks each
        index a segment of the table's fragments and Lance merges them -- instead of in the driver, under the name
        LanceDB gives its own (``vector_idx``), replacing it. Called once the job's encoding is done and the actors
        are gone (their CPUs free for the tasks). False (nothing built) below :data:`DISTRIBUTED_ANN_MIN_ROWS`: the
        caller builds it with LanceDB in its own process."""
        if rows < DISTRIBUTED_ANN_MIN_ROWS:
            return False
        import lance_ray

        lance_ray.create_index(uri, "vector", {"ivf_hnsw_sq": "IVF_HNSW_SQ", "ivf_pq": "IVF_PQ"}[kind],
                               name="vector_idx", replace=True, metric="dot", num_partitions=partitions,
                               sample_rate=max(2, min(256, rows // max(partitions, 1), rows // 256)),
                               num_workers=max(1, self.workers), storage_options=dict(storage_options or {}) or None)
        return True

    def encode(self, texts: list[str], kind: str = "passage", *, batch_size: int = 64, precision: str = "auto",
               **_: Any) -> np.ndarray:
        import ray

        bounds = np.linspace(0, len(texts), len(self.actors) + 1).astype(int)
        pieces = [(actor, int(a), int(b)) for actor, a, b in zip(self.actors, bounds[:-1], bounds[1:]) if b > a]
        calls = [actor.encode.remote(list(texts[a:b]), kind, batch_size, precision) for actor, a, b in pieces]
        try:
            return np.concatenate(ray.get(calls)) if calls else np.zeros((0, 0), np.float32)
        except ray.exceptions.RayActorError:
            failed = next(i for i, ref in enumerate(calls) if _died(ref))
            _, a, b = pieces[failed]
            raise ConfigError(f"texts {a}..{b - 1} of this chunk of {len(texts)} (the first: {texts[a][:80]!r}) "
                              f"killed their encoder actor {self.max_retries + 1} times (out of memory? a text the "
                              "model cannot take?); the job stopped. Fix the input or give the actors more "
                              "memory, then run it again: it resumes from its last commit") from None

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _died(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 -- only the call whose actor died is asked for
        return False
    return False


def _schema(dim: int):
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("vector", pa.list_(pa.float32(), dim))])


class _FragmentWriter:
    """A Ray Data write task: the encoded rows as Lance fragments (``lance.fragment.write_fragments``), handed to the
    driver as Lance's own JSON fragment metadata, which the driver commits.

    Beside lance-ray's ``LanceFragmentWriter`` for one measured reason: that writer hands its fragments back
    *pickled*, and robustir loads no pickle anywhere (``tests/test_resume_safety.py``); the writing itself is Lance's.
    """

    def __init__(self, uri: str, schema: Any, storage_options: Mapping[str, Any] | None) -> None:
        self.uri, self.schema, self.options = uri, schema, dict(storage_options or {}) or None

    def __call__(self, batch: Any) -> Any:
        import json

        import lance.fragment
        import pyarrow as pa

        if batch.num_rows == 0:
            return pa.table({"fragment": pa.array([], pa.string())})
        written = lance.fragment.write_fragments(batch.select(self.schema.names).cast(self.schema), self.uri,
                                                 schema=self.schema, storage_options=self.options,
                                                 data_storage_version="stable")
        return pa.table({"fragment": [json.dumps(meta.to_json()) for meta in written]})


def _remove_orphans(job: OutputJob) -> None:
    """Remove the fragment files a killed driver left behind: written by its Ray tasks, never committed, so in no
    version of the dataset. Lance's own cleanup (``cleanup_old_versions(delete_unverified=True)``, which removes
    every file no version references, and the versions before the last) does it; it is safe only with no other
    writer on the dataset, which the output's lock guarantees. Before the first commit there is no dataset for
    Lance to clean: the folder holds only such files and is removed."""
    if job.exists():
        from datetime import timedelta

        import lance

        stats = lance.dataset(job.uri, storage_options=job.options).cleanup_old_versions(
            older_than=timedelta(0), delete_unverified=True, error_if_tagged_old_versions=False)
        if stats.bytes_removed:
            logger.info("%s: removed %d bytes of files no commit references (left by a killed driver)", job.uri,
                        stats.bytes_removed)
        return
    from ..index.store.stores import open_store

    parent, _, name = job.uri.rpartition("/")
    open_store(parent, job.options).remove_tree(name)


def _held_ids(job: OutputJob) -> tuple[Any, int]:
    """What a resumed job's dataset holds (a fragment is committed whole or not at all), for the read tasks to
    leave out: the ids' sorted 128-bit digests (:func:`_dataset_id_digests`), made by a Ray task and left in Ray's object
    store -- the driver holds their reference and count, never the ids; every node maps one copy, 16 bytes an id
    (1.6 GB at 100M; before, the ids as an Arrow array in the driver, 13 bytes an id measured, and each read block
    built a hash set of all of them). Their count."""
    import ray

    if not job.exists():
        return None, 0
    digests, count = ray.remote(num_cpus=0, num_returns=2)(_dataset_id_digests).remote(job.uri, job.options)
    return digests, int(ray.get(count))


def _dataset_id_digests(uri: str, options: dict | None) -> tuple[np.ndarray, int]:
    """A Ray task: the sorted 128-bit BLAKE2b digests (``S16``) of the ids of the Lance dataset ``uri``, read a
    batch at a time, and their count."""
    import lance

    parts = [id_digests(batch.column("id").to_pylist())
             for batch in lance.dataset(uri, storage_options=options).to_batches(columns=["id"], batch_size=65536)]
    digests = np.sort(np.concatenate(parts)) if parts else np.empty(0, "S16")
    return digests, len(digests)


def _init_ray(address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)


def encode_with_ray(input_path: str | os.PathLike, model: str, output: str | os.PathLike, *,
                    kind: Literal["passage", "query"] = "passage", config: RayEncodeConfig | None = None,
                    encoder_options: dict | None = None, overwrite: bool = False, device: str | None = None,
                    storage_options: Mapping[str, Any] | None = None,
                    on_batch: Callable[[int, list[str]], None] | None = None,
                    on_part: Callable[[int], None] | None = None) -> RayEncodeReport:
    """Encode ``input_path`` (a corpus.jsonl, or queries.jsonl with ``kind="query"``) with ``model`` into the Lance
    dataset ``output`` (a local path, made absolute, or ``s3://bucket/prefix/NAME.lance`` with
    ``storage_options``) on Ray (see the module docstring). ``device``: each actor's (default: cuda with
    ``num_gpus``, else cpu). ``on_batch(n, ids)`` runs in an actor before its n-th batch, ``on_part(i)`` in the driver
    after commit ``i`` (progress; fault injection in tests)."""
    from ..models.encoder import resolve_model_path

    config = config or RayEncodeConfig()
    job = OutputJob(output, storage_options)
    input_path = resolve_input(str(input_path), kind)
    local_model = absolute(resolve_model_path(model), "--model")
    inputs = {"input": input_path, "model": local_model}
    return _encode(_stream(input_path, kind, job.options), inputs, local_model, job, kind, config,
                   encoder_options, overwrite, device, on_batch, on_part,
                   paths={"input": input_path, "model folder": local_model})


def encode_documents_with_ray(encoder: Any, documents: Any, digest: str, output: Path, config: RayEncodeConfig,
                              device: str | None = None, *, then: Callable[[str], Any] | None = None) -> Any:
    """Passage vectors of ``documents`` (``len``, ``texts(start, stop)`` and ``file_pieces(rows)``: mining's
    :class:`~robustir.negatives.mining.Documents`) encoded on Ray with ``encoder``'s model and settings into the
    resumable Lance dataset ``output`` (dense mining's corpus embeddings, ``MiningConfig.engine: ray``), whose ids are
    the texts' row numbers (``%012d``). ``digest`` stands for the texts' content in the record (they are not a file).

    Who reads the texts (:func:`_mining_rows`): the rows of a plain corpus file every node sees
    (``documents.file_pieces``) are read by Ray tasks, ``batch_rows`` rows a task, never by the driver; the others
    (texts in memory, a ``.gz`` corpus, positives added from a training file, a corpus the cluster cannot see) are
    read by the driver ``batch_rows`` at a time, each block put in Ray's object store before the next is read. A
    resumed job leaves out the rows the dataset holds, known by a bitmap of the rows (:func:`_held_rows`, 1 bit a
    row), not a set of ids.

    ``then(uri)`` runs while this process still holds the output's lock -- after the encoding, or at once when it
    was already complete -- and its result is returned: mining writes its ``.npy`` there
    (:func:`write_in_row_order`), so two miners sharing the cache folder (a job array) encode and write it once:
    the second waits for the first, then finds it done. Without ``then``: the vectors, ``(n, d)`` in row order."""
    import dataclasses

    from ..models.encoder import resolve_model_path

    local_model = absolute(resolve_model_path(encoder.source), "model")
    options = dataclasses.asdict(encoder.config)
    job = OutputJob(output)
    result: list[Any] = []
    _encode(lambda held: _mining_rows(documents, config.batch_rows, held), {"model": local_model}, local_model, job,
            "passage", config, options, False, device, None, None, extra={"texts": digest},
            paths={"model folder": local_model}, wait=True, held_of=lambda job: _held_rows(job, len(documents)),
            check_ids=then is None,
            then=lambda: result.append(then(job.uri) if then is not None else read_vectors(job.uri)[1]))
    return result[0]


def _held_rows(job: OutputJob, n: int) -> tuple[np.ndarray, int]:
    """The rows (ids ``%012d``) a resumed mining encoding holds, as a bitmap of ``n`` rows (``np.packbits``: 12.5 MB
    at 100M rows, where the ids as Arrow strings would be 2 GB), read from the dataset a batch at a time; and their
    count."""
    import lance

    bits, count = np.zeros((n + 7) // 8, dtype=np.uint8), 0
    if job.exists():
        for batch in lance.dataset(job.uri, storage_options=job.options).to_batches(columns=["id"],
                                                                                     batch_size=65536):
            rows = _row_numbers(batch.column("id"))
            np.bitwise_or.at(bits, rows >> 3, _bit_of(rows))
            count += len(rows)
    return bits, count


def _row_numbers(ids: Any) -> np.ndarray:
    """Mining's ids (``%012d``: row numbers) as int64."""
    import pyarrow.compute as pc

    return np.asarray(pc.cast(ids, "int64"))


def _bit_of(rows: np.ndarray) -> np.ndarray:
    """Each row's bit within its byte of a row bitmap, in ``np.packbits``' order (the first row the highest bit)."""
    return (128 >> (rows & 7)).astype(np.uint8)


def _row_bits(bits: np.ndarray, first: int, count: int) -> np.ndarray:
    """Rows ``first`` to ``first + count - 1`` of the bitmap ``bits`` (:func:`_held_rows`), as booleans."""
    low = first // 8
    return np.unpackbits(bits[low:(first + count + 7) // 8 + 1])[first - 8 * low:first - 8 * low + count].astype(bool)


def _mining_rows(documents: Any, rows: int, held: tuple[np.ndarray, int] | None) -> Any:
    """The Ray Data dataset of ``(id, text)`` of mining's documents less the ``held`` rows (see
    :func:`encode_documents_with_ray`): a corpus file's rows read by Ray tasks, ``rows`` rows each, the rest put by the
    driver a block of ``rows`` at a time."""
    import pyarrow as pa
    import ray
    import ray.data

    bits = held[0] if held is not None else None

    def kept(first: int, count: int) -> np.ndarray | None:  # rows first..first+count-1 to encode (None: all)
        if bits is None:
            return None
        return ~_row_bits(bits, first, count)

    n, parts, done = len(documents), [], 0
    size = rows * max(1, -(-n // (rows * MAX_PIECES)))  # a multiple of `rows`, at most MAX_PIECES ranges
    found = documents.file_pieces(size)
    if found is not None:
        path, pieces = found
        try:
            check_cluster_sees({"corpus": path})
        except ConfigError as error:  # it still works, through the driver: say what that costs at scale
            logger.warning("%s The driver reads the corpus and puts its texts in Ray's object store instead, which "
                           "does not scale to a large corpus", error)
            found = None
    if found is not None:
        columns = {name: pa.array(values) for name, values in pieces.items()}
        if bits is not None:  # each range carries its rows' bits: no task gets the whole bitmap
            columns["keep"] = pa.array([np.packbits(kept(int(a), int(c))).tobytes() for a, c in
                                        zip(pieces["first_row"], pieces["rows"])], pa.binary())
        table = pa.table(columns)
        done = int(pieces["rows"].sum())
        # one read task a range, one block each: the blocks one task yields reach the actor pool as one block --
        # Ray Data merges a task's outputs up to its block size -- which one actor encodes whole (measured: 16 ranges
        # a task kept one of two actors busy, 377 s against 229 s for 20k passages). The read tasks ask for no CPU
        # (the actors may hold every CPU: a 1-CPU read waited forever behind two actors on 2 CPUs, measured), so
        # their concurrency is bounded instead: 0-CPU tasks are otherwise all started at once, a Python worker each
        parts.append(ray.data.read_datasource(_CorpusRanges(path, table), num_cpus=0, concurrency=READ_TASKS,
                                              override_num_blocks=table.num_rows))
    blocks = []
    for first in range(done, n, rows):  # only the driver can read these: one block at a time
        texts = documents.texts(first, min(n, first + rows))
        ids = pa.array([f"{i:012d}" for i in range(first, first + len(texts))], pa.string())
        block = _parse_rows(pa.table({"_id": ids, "text": texts}), "passage", "the texts to mine")
        keep = kept(first, len(texts))
        if keep is not None:
            block = block.filter(pa.array(keep))
        if block.num_rows:
            blocks.append(ray.put(block))
    if blocks or not parts:
        parts.append(ray.data.from_arrow_refs(blocks) if blocks else
                     ray.data.from_arrow(pa.table({"id": pa.array([], pa.string()),
                                                   "text": pa.array([], pa.string())})))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


#: at most this many ranges of the corpus file (each ``batch_rows`` rows or a multiple): Ray Data's driver-side
#: state is ~8-15 KB a read task (measured: 5,000 one-block tasks, +39 MiB heap, +73 MiB peak), so 100M passages in
#: ranges of 2,048 rows (49k tasks) would cost the driver ~0.5 GB and ~15 min of task starts on 2 cores
MAX_PIECES = 4096


class _CorpusRanges:
    """A Ray Data datasource (``ray.data.Datasource``'s interface): one read task a range of the corpus file ``path``
    (a row of ``pieces``: :meth:`~robustir.data.beir.CorpusFile.pieces`, with the ``keep`` bits of a resumed job),
    read by :func:`~robustir.data.beir.read_corpus_range` into one block of ``(id, text)``. A read task carries its
    range's few numbers, so the driver holds no table per range; a bad or changed file is carried to the driver as
    :class:`_InputError`."""

    def __new__(cls, path: str, pieces: Any) -> Any:
        from ray.data import Datasource

        class CorpusRanges(Datasource):  # defined here: Ray is an optional extra
            def estimate_inmemory_data_size(self) -> int | None:
                return int(sum(pieces.column("stop").to_pylist()) - sum(pieces.column("start").to_pylist()))

            def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                               data_context: Any = None) -> list:
                from ray.data import ReadTask
                from ray.data.block import BlockMetadata

                tasks = []
                for piece in pieces.to_pylist():
                    meta = BlockMetadata(num_rows=piece["rows"], size_bytes=piece["stop"] - piece["start"],
                                         exec_stats=None, input_files=(path,))
                    tasks.append(ReadTask(lambda piece=piece: [_read_corpus_range(path, piece)], meta))
                return tasks

        return CorpusRanges()


def _read_corpus_range(path: str, piece: dict) -> Any:
    """A read task of :class:`_CorpusRanges`: one range's ``(id, text)``, less the rows its ``keep`` bits leave out."""
    import json

    import pyarrow as pa

    from ..data.beir import read_corpus_range
    from ..errors import RobustIRError

    start, stop, first, count, line = (piece[k] for k in ("start", "stop", "first_row", "rows", "first_line"))
    try:
        texts = read_corpus_range(path, start, stop, line, count)
    except RobustIRError as error:  # robustir's errors do not pickle: their fields cross to the driver
        fields = {name: getattr(error, name, None) for name in ("path", "problem", "line", "field", "fix")}
        fields["path"] = str(fields["path"])
        raise _InputError(str(error), json.dumps(fields)) from None
    table = pa.table({"id": pa.array([f"{i:012d}" for i in range(first, first + count)], pa.string()),
                      "text": pa.array(texts, pa.string())})
    if piece.get("keep") is not None:
        table = table.filter(pa.array(np.unpackbits(np.frombuffer(piece["keep"], np.uint8), count=count)
                                      .astype(bool)))
    return table


#: the bytes Lance's scan may hold read ahead while the driver writes the ``.npy``. Measured driver heap after the
#: write (RssAnon): 100k / 300k 384-dim rows +158 / +183 MiB with Lance's default, +110 / +159 MiB with this; with
#: 128 dims +54, +54, +39 MiB at 100k, 300k, 1M rows -- bounded, not growing with the corpus
READ_BUFFER = 32 << 20


def write_in_row_order(output: str, file: Any) -> int:
    """Write the vectors of ``output`` (a dataset of :func:`encode_documents_with_ray`: ids are row numbers) into
    the :class:`~robustir.index.dense.EmbeddingFile` ``file`` at their rows, one Lance batch at a time (two read
    ahead): the driver holds a few batches and a bitmap of the rows written (1 bit a row), never the corpus's
    vectors. Returns the rows written; a row the dataset holds twice, or outside the file, is a :class:`ConfigError`
    (the check :func:`_refuse_duplicates` makes of other outputs, here without reading the ids into the driver)."""
    import lance

    written, n = 0, len(file)
    seen = np.zeros((n + 7) // 8, dtype=np.uint8)
    for batch in lance.dataset(output).to_batches(columns=["id", "vector"], batch_size=8192, batch_readahead=2,
                                                  fragment_readahead=1, io_buffer_size=READ_BUFFER):
        rows = _row_numbers(batch.column("id"))
        column = batch.column("vector")
        vectors = np.asarray(column.flatten()).reshape(len(rows), column.type.list_size)
        order = np.argsort(rows, kind="stable")
        rows, vectors = rows[order], vectors[order]
        twice = rows[:-1][rows[1:] == rows[:-1]]
        if len(rows) and (rows[0] < 0 or rows[-1] >= n):
            raise ConfigError(f"{output} holds row {int(rows[0] if rows[0] < 0 else rows[-1])} of a corpus of {n} "
                              "rows; delete it and run again")
        bits = _bit_of(rows)
        if len(twice) or (seen[rows >> 3] & bits).any():
            row = int(twice[0]) if len(twice) else int(rows[(seen[rows >> 3] & bits) != 0][0])
            raise ConfigError(f"{output} holds row {row} twice; delete it and run again")
        np.bitwise_or.at(seen, rows >> 3, bits)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # runs of consecutive rows: one write each
        for run_rows, run in zip(np.split(rows, breaks), np.split(vectors, breaks)):
            file.write(int(run_rows[0]), run)
        written += len(rows)
    return written


def _encode(source: Callable[[Any], Any], inputs: dict, model: str, job: OutputJob, kind: str,
            config: RayEncodeConfig, encoder_options: dict | None, overwrite: bool, device: str | None,
            on_batch: Callable[[int, list[str]], None] | None, on_part: Callable[[int], None] | None,
            extra: dict | None = None, paths: dict | None = None, wait: bool = False,
            then: Callable[[], Any] | None = None,
            held_of: Callable[[OutputJob], tuple[Any, int]] | None = None,
            check_ids: bool = True) -> RayEncodeReport:
    """``source(held)``: the Ray Data dataset of ``(id, text)`` to encode, less what a resumed job ``held``:
    ``held_of(job)``'s first value (default: the ids' digests in the object store, :func:`_held_ids`), None on a
    fresh job.
    ``check_ids``: refuse repeated ids after the job (:func:`_refuse_duplicates`); mining's ids are row numbers it
    made, checked while ``then`` writes them (:func:`write_in_row_order`)."""
    from transformers import AutoConfig

    encoder_options = {k: v for k, v in (encoder_options or {}).items() if v is not None}
    started = time.perf_counter()
    made = fingerprint("encode-ray", {"kind": kind, "options": config, "encoder": encoder_options,
                                      "layout": LAYOUT, **(extra or {})}, inputs)
    with job.lock(wait=wait):
        record = job.record
        # a dataset without its record (written by hand, or by an older robustir) is never taken over
        decision = record.decide(made, on_change="refuse", overwrite=overwrite,
                                 work=["a Lance dataset"] if job.exists() else [])
        if decision.state == "reuse":
            if then is not None:
                then()
            return RayEncodeReport(record.report.get("rows", 0), record.report.get("parts", 0), 0, 0.0,
                                   nothing_to_do=True)
        if decision.state == "fresh":
            record.clear()
            record.start(made)
        _init_ray(config.address)
        check_cluster_sees(paths or {}, None if job.remote else job.uri)
        if decision.state == "resume":
            _remove_orphans(job)
        held, resumed = (held_of or _held_ids)(job) if decision.state == "resume" else (None, 0)
        if resumed:
            logger.info("%s: %d rows were committed by an earlier run; encoding the others", job.uri, resumed)
        dim = int(AutoConfig.from_pretrained(model).hidden_size)  # Encoder.dim, without loading the weights here
        import ray.data

        context = ray.data.DataContext.get_current()  # copied into each dataset when it is made: set before
        raised, context.raise_original_map_exception = context.raise_original_map_exception, True
        try:  # a bad input's own message reaches the driver, not "UDF failed to process a data block"
            parts, encoded = _run(job, source(held), model, kind, dim, config, encoder_options,
                                  device or ("cuda" if config.num_gpus else "cpu"), on_batch, on_part)
        finally:
            context.raise_original_map_exception = raised  # the driver's other Ray Data jobs as they were
        total, stored = resumed + encoded, _count(job)
        if total == 0:
            raise ConfigError(f"no {kind}s to encode in {inputs.get('input', 'the input')}")
        if stored != total:  # the lock keeps other writers out: a mismatch is a bug or a hand edit, never kept quiet
            raise ConfigError(f"{job.uri} holds {stored} rows after the job, {total} were expected; run it again "
                              "with --overwrite")
        if check_ids:
            _refuse_duplicates(job, inputs.get("input"), total)
        seconds = time.perf_counter() - started
        record.finish({"rows": total, "parts": parts, "dim": dim, "seconds": round(seconds, 1)}, files=[])
        if then is not None:
            then()
    return RayEncodeReport(total, parts, resumed, seconds)


#: up to this many rows the duplicate-id check reads the id column into the driver and counts it there (Arrow:
#: measured 104-115 bytes an id at the peak for 13-character ids, 1M and 3M rows -- ~110 MB at this bound); above,
#: a Ray Data group-by finds them (measured 7-10 s of fixed cost a job on 2 busy cores, so not for small jobs)
DISTINCT_IN_DRIVER = 1_000_000


def _refuse_duplicates(job: OutputJob, source: str | None, rows: int) -> None:
    """Refuse an input that holds an id twice (robustir's readers refuse it line by line; the stream is read by
    many tasks, so it is checked on the output: in the driver for a small one, else by a Ray Data group-by on the
    id column, of which only repeated ids reach the driver)."""
    import lance
    import pyarrow.compute as pc

    if rows <= DISTINCT_IN_DRIVER:
        ids = lance.dataset(job.uri, storage_options=job.options).to_table(columns=["id"]).column("id")
        counts = pc.value_counts(ids)
        repeated = [{"id": v["values"]} for v in counts.filter(pc.greater(counts.field("counts"), 1))
                    .to_pylist()[:3]]
    else:
        import lance_ray

        repeated = lance_ray.read_lance(job.uri, columns=["id"], storage_options=job.options) \
            .groupby("id").count().filter(lambda row: row["count()"] > 1).take(3)
    if repeated:
        from ..errors import DataError

        ids = ", ".join(repr(row["id"]) for row in repeated)
        raise DataError(source or job.uri, f"duplicate ids ({ids}, ...): the output {job.uri} is not usable",
                        field="_id", fix="make the ids unique, then run again with --overwrite")


def _count(job: OutputJob) -> int:
    import lance

    return lance.dataset(job.uri, storage_options=job.options).count_rows()


def _run(job: OutputJob, rows: Any, model: str, kind: str, dim: int, config: RayEncodeConfig,
         encoder_options: dict, device: str, on_batch: Callable[[int, list[str]], None] | None,
         on_part: Callable[[int], None] | None) -> tuple[int, int]:
    """One Ray Data pipeline for the rows left to encode; the driver commits the fragments' metadata every
    ``part_rows`` rows. Returns the number of commits and of rows committed."""
    import lance
    import ray
    import ray.data
    from lance.fragment import FragmentMetadata

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = config.show_progress
    ledger = ray.remote(num_cpus=0)(_Ledger).remote()
    retries = {"max_restarts": config.max_retries, "max_task_retries": config.max_retries}
    # the write tasks ask for no CPU: the encoder actors may hold every CPU of the cluster (Ray Data warns that the
    # job would hang), and writing a fragment is light next to encoding it. A write task takes a few encoded
    # batches (not a whole part: one task buffering a 100k-row part held the actors back-pressured, measured)
    dataset = rows.map_batches(
        _EncodeBatch, batch_size=config.batch_rows, batch_format="pyarrow",
        compute=config.pool(),
        num_gpus=config.num_gpus or None, num_cpus=config.num_cpus,
        fn_constructor_kwargs={"model": model, "kind": kind, "options": encoder_options,
                               "precision": config.precision, "batch_size": config.batch_size,
                               "device": device, "ledger": ledger, "on_batch": on_batch}, **retries,
    ).map_batches(_FragmentWriter(job.uri, _schema(dim), job.options),
                  batch_size=min(config.part_rows, 4 * config.batch_rows), batch_format="pyarrow", num_cpus=0)
    pending: list[Any] = []
    rows = commits = total = 0

    def commit() -> None:
        nonlocal pending, rows, commits, total
        if job.exists():
            current = lance.dataset(job.uri, storage_options=job.options)
            operation, version = lance.LanceOperation.Append(pending), current.version
        else:
            operation, version = lance.LanceOperation.Overwrite(_schema(dim), pending), None
        lance.LanceDataset.commit(job.uri, operation, read_version=version, storage_options=job.options)
        if on_part is not None:
            on_part(commits)
        pending, rows, commits, total = [], 0, commits + 1, total + rows

    try:
        for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            for text in batch.column("fragment").to_pylist():
                fragment = FragmentMetadata.from_json(text)
                pending.append(fragment)
                rows += fragment.physical_rows
            if rows >= config.part_rows:
                commit()
        if pending:
            commit()
    except (ray.exceptions.RayError, RuntimeError) as error:
        cause = _robustir_error(error)
        if cause is not None:  # bad input found by a read task: robustir's own message, not Ray's traceback
            raise cause from None
        worst = _ask(ledger, "worst")
        if worst is not None and worst[1] > config.max_retries:
            raise ConfigError(f"{job.uri}: the batch {worst[0]} killed its encoder actor {worst[1]} times "
                              f"(max_retries {config.max_retries}; out of memory? a text the model cannot take?); "
                              "the job stopped with every earlier commit kept. Fix those rows or give the actors "
                              "more memory, then run it again: it resumes by id") from None
        raise error
    finally:
        _LAST["model_loads"] = _ask(ledger, "model_loads")
        ray.kill(ledger)
    return commits, total


def _robustir_error(error: BaseException) -> BaseException | None:
    """The bad input (a bad line, a missing field) a read task found, as robustir's :class:`DataError` with the
    task's message, or None (Ray Data raises the task's own exception: ``raise_original_map_exception``)."""
    from ..errors import DataError

    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, _InputError) and isinstance(seen.args[-1], BaseException):
            seen = seen.args[-1]  # Ray's RayTaskError(_InputError) holds the task's own exception
            continue
        if isinstance(seen, _InputError):
            import json

            fields = json.loads(seen.args[-1])  # the last: Ray Data appends its own text to the first
            return DataError(fields["path"], fields["problem"] or "bad input", line=fields["line"],
                             field=fields["field"], fix=fields["fix"])
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


#: what the last job measured (model loads by its actors): for bench/ray_encode.py and tests
_LAST: dict[str, Any] = {}


def _ask(ledger: Any, method: str) -> Any:
    import ray

    try:
        return ray.get(getattr(ledger, method).remote(), timeout=60)
    except ray.exceptions.RayError:
        return None


def read_vectors(output: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                 ) -> tuple[list[str], np.ndarray]:
    """The ids and vectors (float32, ``(n, d)``) of a Ray-encoded Lance dataset (a path, or ``s3://`` with the
    ``storage_options`` it was written with), sorted by id."""
    import lance

    job = OutputJob(output, storage_options)
    table = lance.dataset(job.uri, storage_options=job.options).to_table(columns=["id", "vector"]).sort_by("id")
    vectors = table.column("vector").combine_chunks()
    dim = vectors.type.list_size
    return table.column("id").to_pylist(), np.asarray(vectors.flatten()).reshape(-1, dim)
