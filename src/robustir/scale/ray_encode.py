"""Corpus (or query) encoding on a Ray cluster, with Lance as the data plane: ``robustir encode --engine ray``.

The corpus is read by the driver (robustir's own readers: the same ids and the same text -- title and text joined
as :func:`robustir.data.beir.encoding_text` does -- as the single-process path); the rows the output already holds
(by id) are left out, and the rest goes through **one** Ray Data pipeline for the whole job::

    from_arrow(blocks of batch_rows) -> map_batches(_EncodeBatch, ActorPoolStrategy(concurrency), num_cpus, num_gpus)
        -> map_batches(lance_ray.LanceFragmentWriter)        # fragment files written by Ray tasks, not the driver
        -> driver: one Lance commit (Append) per ``part_rows`` rows of fragment metadata

``_EncodeBatch`` is an actor: it loads the model once for the job and encodes every batch it is given with
:meth:`robustir.models.encoder.Encoder.encode` (length-sorted, the same code as one process). The driver sees only
the fragments' metadata (a few hundred bytes each), never a vector. A committed fragment is in the dataset whole;
a killed driver started again reads the ids the dataset holds and encodes only the others, so changing
``part_rows`` (or ``batch_rows``) between runs duplicates nothing. A worker killed mid-batch is retried by Ray at
most ``max_retries`` times (its actor restarted); a batch that kills its actor every time ends the job with an
error naming the batch (its first and last id), not an endless restart loop.

The output is a Lance dataset (``id``: string, ``vector``: fixed-size list of float32) at an absolute path or an
``s3://`` URI (:mod:`robustir.scale.job`: one driver per output, paths every node sees), beside its record (the
settings, the input's and the model's content, :class:`robustir.runs.Artifact`); another model or input is refused
(or, with ``overwrite``, made again), the same one finished is reused.

Ray Data, pylance and lance-ray are the optional extra ``robustir[scale]``.
"""

from __future__ import annotations

import logging
import os
import pickle
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

__all__ = ["RayEncodeConfig", "RayEncodeReport", "RayEncoderPool", "encode_documents_with_ray", "encode_with_ray",
           "read_vectors", "require_scale_extra"]

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
    """Encoder actors (one model load each, for the whole job)."""
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
    """How many times each batch was started and not finished (a plain Ray actor, no CPU): what names the batch
    that kills its actor every time, since Ray's error only says that an actor died."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.loads = 0

    def loaded(self) -> None:
        self.loads += 1

    def started(self, batch: str) -> int:
        self.open[batch] = self.open.get(batch, 0) + 1
        return self.open[batch]

    def finished(self, batch: str) -> None:
        self.open.pop(batch, None)

    def worst(self) -> tuple[str, int] | None:
        return max(self.open.items(), key=lambda item: item[1]) if self.open else None

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
        ray.get(ledger.loaded.remote())

    def __call__(self, batch):
        import pyarrow as pa
        import ray

        ids = batch.column("id")
        name = f"{ids[0].as_py()} .. {ids[-1].as_py()} ({len(ids)} rows)"
        ray.get(self.ledger.started.remote(name))  # recorded before the work that may kill this process
        self.batches += 1
        if self.on_batch is not None:  # progress, or a fault injected by a test
            self.on_batch(self.batches, ids.to_pylist())
        vectors = self.encode(batch.column("text").to_pylist(), self.kind, self.batch_size, self.precision)
        self.ledger.finished.remote(name)
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
        self.max_retries = max_retries
        self.actors = [remote.remote(model, options, device, on_call) for _ in range(actors)]

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


def _read(path: str, kind: str) -> tuple[list[str], list[str]]:
    if kind == "query":
        from ..data.beir import load_queries

        queries, _ = load_queries(path)
        return list(queries), list(queries.values())
    from ..data.beir import load_corpus

    corpus, _ = load_corpus(path)
    return list(corpus.ids), corpus.texts_for_encoding()


def _held_ids(job: OutputJob) -> set[str]:
    """The ids the dataset holds (a fragment is committed whole or not at all)."""
    import lance

    if not job.exists():
        return set()
    held: set[str] = set()
    for batch in lance.dataset(job.uri, storage_options=job.options).to_batches(columns=["id"]):
        held.update(batch.column("id").to_pylist())
    return held


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
    input_path = absolute(input_path, "--input")
    local_model = absolute(resolve_model_path(model), "--model")
    inputs = {"input": input_path, "model": local_model}
    return _encode(lambda: _read(input_path, kind), inputs, local_model, job, kind, config, encoder_options,
                   overwrite, device, on_batch, on_part, paths={"input": input_path, "model folder": local_model})


def encode_documents_with_ray(encoder: Any, texts: Callable[[], list[str]], digest: str, output: Path,
                              config: RayEncodeConfig, device: str | None = None) -> np.ndarray:
    """Passage vectors of ``texts()`` (in their order) encoded on Ray with ``encoder``'s model and settings, through
    the resumable Lance dataset ``output`` (dense mining's corpus embeddings, ``MiningConfig.engine: ray``; two
    miners sharing the cache folder: the second waits for the first and reuses its vectors).
    ``digest`` stands for the texts' content in the record (they are not a file)."""
    import dataclasses

    from ..models.encoder import resolve_model_path

    local_model = absolute(resolve_model_path(encoder.source), "model")
    options = dataclasses.asdict(encoder.config)

    def rows() -> tuple[list[str], list[str]]:
        values = texts()
        return [f"{i:012d}" for i in range(len(values))], values  # ids in row order: read back sorted

    job = OutputJob(output)
    _encode(rows, {"model": local_model}, local_model, job, "passage", config, options, False, device,
            None, None, extra={"texts": digest}, paths={"model folder": local_model}, wait=True)
    return read_vectors(job.uri)[1]


def _encode(rows: Callable[[], tuple[list[str], list[str]]], inputs: dict, model: str, job: OutputJob, kind: str,
            config: RayEncodeConfig, encoder_options: dict | None, overwrite: bool, device: str | None,
            on_batch: Callable[[int, list[str]], None] | None, on_part: Callable[[int], None] | None,
            extra: dict | None = None, paths: dict | None = None, wait: bool = False) -> RayEncodeReport:
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
            return RayEncodeReport(record.report.get("rows", 0), record.report.get("parts", 0), 0, 0.0,
                                   nothing_to_do=True)
        if decision.state == "fresh":
            record.clear()
            record.start(made)
        _init_ray(config.address)
        check_cluster_sees(paths or {}, None if job.remote else job.uri)
        ids, texts = rows()
        if not ids:
            raise ConfigError(f"no {kind}s to encode")
        held = _held_ids(job) if decision.state == "resume" else set()
        if held:
            logger.info("%s: %d rows were committed by an earlier run; encoding the other %d", job.uri, len(held),
                        len(ids) - len(held))
        todo = [i for i, doc_id in enumerate(ids) if doc_id not in held] if held else range(len(ids))
        dim = int(AutoConfig.from_pretrained(model).hidden_size)  # Encoder.dim, without loading the weights here
        parts = _run(job, [ids[i] for i in todo], [texts[i] for i in todo], model, kind, dim, config,
                     encoder_options, device or ("cuda" if config.num_gpus else "cpu"), on_batch, on_part)
        del ids, texts
        stored = _count(job)
        total = len(held) + len(todo)
        if stored != total:  # the lock keeps other writers out: a mismatch is a bug or a hand edit, never kept quiet
            raise ConfigError(f"{job.uri} holds {stored} rows after the job, {total} were expected; run it again "
                              "with --overwrite")
        seconds = time.perf_counter() - started
        record.finish({"rows": total, "parts": parts, "dim": dim, "seconds": round(seconds, 1)}, files=[])
    return RayEncodeReport(total, parts, len(held), seconds)


def _count(job: OutputJob) -> int:
    import lance

    return lance.dataset(job.uri, storage_options=job.options).count_rows()


def _run(job: OutputJob, ids: list[str], texts: list[str], model: str, kind: str, dim: int,
         config: RayEncodeConfig, encoder_options: dict, device: str,
         on_batch: Callable[[int, list[str]], None] | None,
         on_part: Callable[[int], None] | None) -> int:
    """One Ray Data pipeline for the rows left to encode; the driver commits the fragments' metadata every
    ``part_rows`` rows. Returns the number of commits."""
    import lance
    import pyarrow as pa
    import ray
    import ray.data
    from lance_ray import LanceFragmentWriter

    if not ids:
        return 0
    ray.data.DataContext.get_current().enable_progress_bars = config.show_progress
    blocks = [pa.table({"id": ids[a:a + config.batch_rows], "text": texts[a:a + config.batch_rows]})
              for a in range(0, len(ids), config.batch_rows)]
    ledger = ray.remote(num_cpus=0)(_Ledger).remote()
    retries = {"max_restarts": config.max_retries, "max_task_retries": config.max_retries}
    # the write tasks ask for no CPU: the encoder actors may hold every CPU of the cluster (Ray Data warns that the
    # job would hang), and writing a fragment is light next to encoding it. A write task takes a few encoded
    # batches (not a whole part: one task buffering a 100k-row part held the actors back-pressured, measured)
    dataset = ray.data.from_arrow(blocks).map_batches(
        _EncodeBatch, batch_size=config.batch_rows, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=config.concurrency),
        num_gpus=config.num_gpus or None, num_cpus=config.num_cpus,
        fn_constructor_kwargs={"model": model, "kind": kind, "options": encoder_options,
                               "precision": config.precision, "batch_size": config.batch_size,
                               "device": device, "ledger": ledger, "on_batch": on_batch}, **retries,
    ).map_batches(LanceFragmentWriter(job.uri, schema=_schema(dim), storage_options=job.options,
                                      data_storage_version="stable"),
                  batch_size=min(config.part_rows, 4 * config.batch_rows), batch_format="pyarrow", num_cpus=0)
    pending: list[Any] = []
    rows = commits = 0

    def commit() -> None:
        nonlocal pending, rows, commits
        if job.exists():
            current = lance.dataset(job.uri, storage_options=job.options)
            operation, version = lance.LanceOperation.Append(pending), current.version
        else:
            operation, version = lance.LanceOperation.Overwrite(_schema(dim), pending), None
        lance.LanceDataset.commit(job.uri, operation, read_version=version, storage_options=job.options)
        if on_part is not None:
            on_part(commits)
        pending, rows, commits = [], 0, commits + 1

    try:
        for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            for blob in batch.column("fragment").to_pylist():
                fragment = pickle.loads(blob)
                pending.append(fragment)
                rows += fragment.physical_rows
            if rows >= config.part_rows:
                commit()
        if pending:
            commit()
    except (ray.exceptions.RayError, RuntimeError) as error:
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
    return commits


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
