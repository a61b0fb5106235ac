"""Corpus (or query) encoding on a Ray cluster, with Lance as the data plane: ``robustir encode --engine ray``.

The corpus is read once by the driver (robustir's own readers: the same ids and the same text -- title and text
joined as :func:`robustir.data.beir.encoding_text` does -- as the single-process path) and cut into *parts* of
``part_rows`` rows. Each part is one Ray Data job::

    from_arrow(blocks of batch_rows) -> map_batches(_EncodeBatch, concurrency=N, num_gpus=G)
        -> lance_ray.write_lance(append)

``_EncodeBatch`` is an actor: it loads the model once and encodes every batch it is given with
:meth:`robustir.models.encoder.Encoder.encode` (length-sorted, the same code as one process). ``write_lance`` writes
the part's fragments in parallel and the driver commits them in one Lance commit, so a part is in the dataset whole
or not at all. Every row carries its part number; a killed driver started again reads which parts the dataset holds
and encodes only the others (nothing finished is encoded twice, nothing is written twice). A worker killed mid-part
is Ray Data's to retry: only the fragments of the task that finished are committed, so every passage is there once.

The output is a Lance dataset (``id``: string, ``part``: int32, ``vector``: fixed-size list of float32) beside its
record ``<output>.run.json`` (:class:`robustir.runs.Artifact`): the settings, the input's and the model's content;
another model or input is refused (or, with ``overwrite``, made again), the same one finished is reused.

Ray Data, pylance and lance-ray are the optional extra ``robustir[scale]``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import numpy as np

from ..errors import ConfigError
from ..precision import Precision
from ..runs import Artifact, fingerprint, operational
from ..validation import PositiveInt, Range, config_dataclass

__all__ = ["RayEncodeConfig", "RayEncodeReport", "RayEncoderPool", "encode_documents_with_ray", "encode_with_ray",
           "read_vectors", "require_scale_extra"]

logger = logging.getLogger(__name__)


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
    """Rows per part: one Lance commit each; a killed driver resumes at the first part not committed."""
    concurrency: PositiveInt = operational(1)
    """Encoder actors (one model load each)."""
    num_gpus: Annotated[float, Range(ge=0.0)] = operational(0.0)
    """GPUs per actor (0: CPU actors); e.g. 1 on a GPU cluster, 0.5 to pack two actors per GPU."""
    num_cpus: Annotated[float, Range(gt=0.0)] = operational(1.0)
    """CPUs per actor (its torch threads)."""
    address: str | None = operational(None)
    """Ray cluster to join (``ray://host:10001``, ``auto``); None: the running session, else a local one."""
    show_progress: bool = operational(True)
    """Ray Data's progress bars."""


@dataclass
class RayEncodeReport:
    rows: int
    parts: int
    parts_resumed: int  # parts found committed by an earlier (killed) run and not encoded again
    seconds: float
    nothing_to_do: bool = False

    def format(self) -> str:
        if self.nothing_to_do:
            return f"nothing to do: {self.rows} rows in {self.parts} parts already encoded"
        resumed = f", {self.parts_resumed} committed earlier" if self.parts_resumed else ""
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


class _EncodeBatch(_PoolActor):
    """A Ray Data actor: one model load, then each batch (a pyarrow table of id, text, part) encoded."""

    def __init__(self, model: str, kind: str, options: dict, precision: str, batch_size: int, device: str,
                 on_batch: Callable[[int], None] | None = None) -> None:
        super().__init__(model, options, device, on_batch)
        self.kind, self.precision, self.batch_size = kind, precision, batch_size

    def __call__(self, batch):
        import pyarrow as pa

        vectors = self.encode(batch.column("text").to_pylist(), self.kind, self.batch_size, self.precision)
        flat = pa.array(vectors.reshape(-1), type=pa.float32())
        return pa.table({"id": batch.column("id"), "part": batch.column("part"),
                         "vector": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})


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
    actor and the vectors come back in order. The actors are restarted by Ray when they die (kill -9, a lost node)
    and the call is retried on them (``max_restarts`` / ``max_task_retries`` -1), so a killed worker costs a retry."""

    def __init__(self, encoder: Any, *, actors: int = 1, num_gpus: float = 0.0, num_cpus: float = 1.0,
                 address: str | None = None, device: str | None = None,
                 on_call: Callable[[int], None] | None = None) -> None:
        import dataclasses

        import ray

        from ..models.encoder import resolve_model_path

        require_scale_extra("engine: ray")
        _init_ray(address)
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus or None, max_restarts=-1,
                            max_task_retries=-1)(_PoolActor)
        model, options = str(resolve_model_path(encoder.source)), dataclasses.asdict(encoder.config)
        device = device or ("cuda" if num_gpus else "cpu")
        self.actors = [remote.remote(model, options, device, on_call) for _ in range(actors)]

    def encode(self, texts: list[str], kind: str = "passage", *, batch_size: int = 64, precision: str = "auto",
               **_: Any) -> np.ndarray:
        import ray

        bounds = np.linspace(0, len(texts), len(self.actors) + 1).astype(int)
        calls = [actor.encode.remote(list(texts[a:b]), kind, batch_size, precision)
                 for actor, a, b in zip(self.actors, bounds[:-1], bounds[1:]) if b > a]
        return np.concatenate(ray.get(calls)) if calls else np.zeros((0, 0), np.float32)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _schema(dim: int):
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("part", pa.int32()), ("vector", pa.list_(pa.float32(), dim))])


def _read(path: str, kind: str) -> tuple[list[str], list[str]]:
    if kind == "query":
        from ..data.beir import load_queries

        queries, _ = load_queries(path)
        return list(queries), list(queries.values())
    from ..data.beir import load_corpus

    corpus, _ = load_corpus(path)
    return list(corpus.ids), corpus.texts_for_encoding()


def _committed_parts(output: Path) -> set[int]:
    """The parts a Lance dataset holds (a part is committed whole or not at all)."""
    import lance
    import pyarrow.compute as pc

    if not output.exists():
        return set()
    parts: set[int] = set()
    for batch in lance.dataset(str(output)).to_batches(columns=["part"]):
        parts.update(pc.unique(batch.column("part")).to_pylist())
    return parts


def _init_ray(address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)


def encode_with_ray(input_path: str | os.PathLike, model: str, output: str | os.PathLike, *,
                    kind: Literal["passage", "query"] = "passage", config: RayEncodeConfig | None = None,
                    encoder_options: dict | None = None, overwrite: bool = False, device: str | None = None,
                    on_batch: Callable[[int], None] | None = None,
                    on_part: Callable[[int], None] | None = None) -> RayEncodeReport:
    """Encode ``input_path`` (a corpus.jsonl, or queries.jsonl with ``kind="query"``) with ``model`` into the Lance
    dataset ``output`` on Ray (see the module docstring). ``device``: each actor's (default: cuda with
    ``num_gpus``, else cpu). ``on_batch(n)`` runs in an actor before its n-th batch, ``on_part(i)`` in the driver
    after part ``i`` is committed (progress; fault injection in tests)."""
    from ..models.encoder import resolve_model_path

    config = config or RayEncodeConfig()
    output = Path(output)
    if output.suffix != ".lance":
        raise ConfigError(f"--output {output}: the Ray engine writes a Lance dataset; name it with .lance, e.g. "
                          f"{output.with_suffix('.lance')}")
    local_model = resolve_model_path(model)
    inputs = {"input": str(input_path), "model": str(local_model)}

    def rows() -> tuple[list[str], list[str]]:
        return _read(str(input_path), kind)

    return _encode(rows, inputs, str(local_model), output, kind, config, encoder_options, overwrite, device,
                   on_batch, on_part)


def encode_documents_with_ray(encoder: Any, texts: Callable[[], list[str]], digest: str, output: Path,
                              config: RayEncodeConfig, device: str | None = None) -> np.ndarray:
    """Passage vectors of ``texts()`` (in their order) encoded on Ray with ``encoder``'s model and settings, through
    the resumable Lance dataset ``output`` (dense mining's corpus embeddings, ``MiningConfig.engine: ray``).
    ``digest`` stands for the texts' content in the record (they are not a file)."""
    import dataclasses

    from ..models.encoder import resolve_model_path

    local_model = resolve_model_path(encoder.source)
    options = dataclasses.asdict(encoder.config)

    def rows() -> tuple[list[str], list[str]]:
        values = texts()
        return [f"{i:012d}" for i in range(len(values))], values  # ids in row order: read back sorted

    _encode(rows, {"model": str(local_model)}, str(local_model), output, "passage", config, options, False, device,
            None, None, extra={"texts": digest})
    return read_vectors(output)[1]


def _encode(rows: Callable[[], tuple[list[str], list[str]]], inputs: dict, model: str, output: Path, kind: str,
            config: RayEncodeConfig, encoder_options: dict | None, overwrite: bool, device: str | None,
            on_batch: Callable[[int], None] | None, on_part: Callable[[int], None] | None,
            extra: dict | None = None) -> RayEncodeReport:
    import lance_ray
    import pyarrow as pa
    import ray.data
    from transformers import AutoConfig

    encoder_options = {k: v for k, v in (encoder_options or {}).items() if v is not None}
    started = time.perf_counter()
    record = Artifact(output, what="Ray-encoded vectors")
    made = fingerprint("encode-ray", {"kind": kind, "options": config, "encoder": encoder_options, **(extra or {})},
                       inputs)
    # a dataset without its record (written by hand, or by an older robustir) is never taken over
    decision = record.decide(made, on_change="refuse", overwrite=overwrite,
                             work=["a Lance dataset"] if output.exists() else [])
    if decision.state == "reuse":
        report = record.report
        return RayEncodeReport(report.get("rows", 0), report.get("parts", 0), 0, 0.0, nothing_to_do=True)
    if decision.state == "fresh":
        record.clear()
        record.start(made)
    ids, texts = rows()
    if not ids:
        raise ConfigError(f"no {kind}s to encode")
    parts = (len(ids) + config.part_rows - 1) // config.part_rows
    done = _committed_parts(output) if decision.state == "resume" else set()
    if done:
        logger.info("%s: parts %s were committed by an earlier run; encoding the other %d", output, sorted(done),
                    parts - len(done))
    _init_ray(config.address)
    ray.data.DataContext.get_current().enable_progress_bars = config.show_progress
    dim = int(AutoConfig.from_pretrained(model).hidden_size)  # Encoder.dim, without loading the weights here
    device = device or ("cuda" if config.num_gpus else "cpu")
    for part in range(parts):
        if part in done:
            continue
        lo, hi = part * config.part_rows, min(len(ids), (part + 1) * config.part_rows)
        bounds = [(a, min(hi, a + config.batch_rows)) for a in range(lo, hi, config.batch_rows)]
        blocks = [pa.table({"id": ids[a:b], "text": texts[a:b], "part": pa.array([part] * (b - a), pa.int32())})
                  for a, b in bounds]
        dataset = ray.data.from_arrow(blocks).map_batches(
            _EncodeBatch, batch_size=config.batch_rows, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=config.concurrency),
            num_gpus=config.num_gpus or None, num_cpus=config.num_cpus,
            fn_constructor_kwargs={"model": model, "kind": kind, "options": encoder_options,
                                   "precision": config.precision, "batch_size": config.batch_size,
                                   "device": device, "on_batch": on_batch})
        # lance-ray's sink (Lance's own): fragments written by parallel tasks, one commit by the driver (Ray's
        # bundled Dataset.write_lance calls a write_fragments argument pylance 14 no longer has)
        # the write tasks ask for no CPU: the encoder actors may hold every CPU of the cluster (Ray Data warns that
        # the job would hang), and writing a fragment is light next to encoding it. Files of a few batches: with
        # min_rows_per_file = part_rows one write task buffered the whole part in the object store (measured: a
        # 100k-row part held the actors back-pressured until it was all encoded); the part is still one commit
        lance_ray.write_lance(dataset, str(output), schema=_schema(dim),
                              mode="append" if output.exists() else "create",
                              min_rows_per_file=min(config.part_rows, 4 * config.batch_rows),
                              ray_remote_args={"num_cpus": 0})
        if on_part is not None:
            on_part(part)
    seconds = time.perf_counter() - started
    record.finish({"rows": len(ids), "parts": parts, "dim": dim, "seconds": round(seconds, 1)}, files=[])
    return RayEncodeReport(len(ids), parts, len(done), seconds)


def read_vectors(output: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """The ids and vectors (float32, ``(n, d)``) of a Ray-encoded Lance dataset, sorted by id."""
    import lance

    table = lance.dataset(str(output)).to_table(columns=["id", "vector"]).sort_by("id")
    vectors = table.column("vector").combine_chunks()
    dim = vectors.type.list_size
    return table.column("id").to_pylist(), np.asarray(vectors.flatten()).reshape(-1, dim)
