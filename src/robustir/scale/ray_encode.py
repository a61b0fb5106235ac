"""Corpus (or query) encoding on a Ray cluster, with Lance as the data plane: ``robustir encode --engine ray``.

The corpus is read by Ray tasks (:func:`_stream`: JSONL -- a large file in ranges of whole lines --, parquet, a
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
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping

import numpy as np

from ..errors import ConfigError
from ..precision import Precision
from ..runs import fingerprint, operational
from ..validation import PositiveInt, Range, config_dataclass
from .job import OutputJob, absolute, check_cluster_sees

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


def _parse_rows(batch: Any, kind: str, source: str, held: Any = None) -> Any:
    """A Ray Data task: one block of the input -- JSONL lines (``read_text``'s ``text`` column) or parquet rows --
    as ``(id, text)`` with robustir's own checks (:mod:`robustir.data.beir`: a string id, ``text`` required,
    ``title`` optional, title and text joined by :func:`~robustir.data.beir.encoding_text`, empty documents
    skipped), less the ids in ``held`` (a resumed job's committed rows)."""
    from ..errors import RobustIRError

    try:
        return _checked_rows(batch, kind, source, held)
    except RobustIRError as error:  # robustir's errors do not pickle: their fields cross to the driver
        import json

        fields = {name: getattr(error, name, None) for name in ("path", "problem", "line", "field", "fix")}
        raise _InputError(str(error), json.dumps(fields)) from None


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


class _InputError(Exception):
    """A bad input found by a read task: its message, then its :class:`DataError`'s fields as JSON (path, problem,
    line, field, fix), carried to the driver (Ray pickles a task's error; robustir's do not pickle)."""


def _checked_rows(batch: Any, kind: str, source: str, held: Any) -> Any:
    import json

    import pyarrow as pa
    import pyarrow.compute as pc

    from ..data.beir import _as_id, _as_text, encoding_text
    from ..errors import DataError

    where = Path(source)
    records = batch.to_pylist()
    if "text" in batch.column_names and batch.num_columns == 1:  # lines of a JSONL file
        parsed = []
        for row in records:
            line = row["text"]
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(where, f"not valid JSON ({exc.msg}) in the line {line[:80]!r}",
                                fix="each line must hold one JSON object") from None
            if not isinstance(obj, dict):
                raise DataError(where, f"expected a JSON object, got {type(obj).__name__} in {line[:80]!r}",
                                fix="each line must hold one JSON object")
            parsed.append(obj)
        records = parsed
    ids, texts = [], []
    for obj in records:
        doc_id = _as_id(obj.get("_id", obj.get("id")), where, None, "_id")
        title = _as_text(obj, "title", where, None, required=False) if kind == "passage" else ""
        text = _as_text(obj, "text", where, None, required=True)
        if text.strip() or title.strip():
            ids.append(doc_id)
            texts.append(encoding_text(title, text))
    table = pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())})
    if held is not None and len(held) and table.num_rows:
        table = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=held)))
    return table


def _arrow_filesystem(job_options: dict | None) -> Any:
    """A pyarrow S3 filesystem from Lance's object-store options (``aws_endpoint``, ``aws_region``, keys), for
    Ray Data's readers; None: pyarrow's own (local paths, or S3 from the AWS environment)."""
    if not job_options:
        return None
    from pyarrow import fs

    get = lambda *names: next((v for k, v in job_options.items() if k.lower() in names), None)  # noqa: E731
    endpoint = get("aws_endpoint", "endpoint", "aws_endpoint_url", "endpoint_url")
    scheme = "http" if endpoint and endpoint.startswith("http://") else "https"
    return fs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[-1] if endpoint else None, scheme=scheme,
                           region=get("aws_region", "region") or "us-east-1",
                           access_key=get("aws_access_key_id", "access_key_id"),
                           secret_key=get("aws_secret_access_key", "secret_access_key"),
                           session_token=get("aws_session_token", "session_token", "token"))


#: a plain JSONL file larger than this is read by several Ray tasks, a range of whole lines each
RANGE_BYTES = 64 << 20


def resolve_input(input_uri: str, kind: str) -> str:
    """(In the driver) what ``--input`` names, as the file or folder the Ray tasks read: ``hf://datasets/ORG/NAME``
    is the dataset's snapshot in the local Hugging Face cache (offline: never downloaded here; every node must see
    the cache), a BEIR folder its ``corpus.jsonl`` (``queries.jsonl``), a ``datasets`` ``save_to_disk`` folder of
    several splits the one split to read; anything else as it is (made absolute)."""
    if input_uri.startswith("hf://"):
        input_uri = _hf_snapshot(input_uri)
    else:
        input_uri = absolute(input_uri, "--input")
    if "://" in input_uri:
        return input_uri
    for name in (("queries.jsonl", "queries.jsonl.gz") if kind == "query" else ("corpus.jsonl", "corpus.jsonl.gz")):
        if os.path.isfile(os.path.join(input_uri, name)):  # a BEIR folder (or a snapshot of one)
            return os.path.join(input_uri, name)
    splits_file = os.path.join(input_uri, "dataset_dict.json")
    if os.path.isfile(splits_file):  # DatasetDict.save_to_disk: one folder per split
        import json

        splits = json.loads(Path(splits_file).read_text(encoding="utf-8")).get("splits", [])
        wanted = [s for s in splits if s == ("queries" if kind == "query" else "corpus")] or \
            (splits if len(splits) == 1 else [])
        if not wanted:
            example = os.path.join(input_uri, splits[0] if splits else "SPLIT")
            raise ConfigError(f"--input {input_uri}: a datasets folder of the splits {', '.join(splits)}; give the "
                              f"split to encode, e.g. --input {example}")
        return os.path.join(input_uri, wanted[0])
    return input_uri


def _hf_snapshot(uri: str) -> str:
    """``hf://datasets/ORG/NAME[/SUBFOLDER]`` as its snapshot folder in the local Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    parts = uri[len("hf://"):].strip("/").split("/")
    if len(parts) < 3 or parts[0] != "datasets":
        raise ConfigError(f"--input {uri}: a Hugging Face dataset is hf://datasets/ORG/NAME (or .../SUBFOLDER)")
    repo = "/".join(parts[1:3])
    try:
        folder = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except LocalEntryNotFoundError:
        raise ConfigError(f"--input {uri}: the dataset {repo} is not in the local Hugging Face cache (robustir "
                          f"reads it offline); download it first: huggingface-cli download --repo-type dataset "
                          f"{repo}, with HF_HOME on storage every node mounts") from None
    return os.path.join(folder, *parts[3:])


def _stream(input_uri: str, kind: str, options: dict | None) -> Callable[[Any], Any]:
    """The input as a Ray Data dataset of ``(id, text)`` read by Ray tasks (never whole in the driver): JSONL
    (``.jsonl``, ``.json``, ``.gz`` of them) line by line -- a plain file above :data:`RANGE_BYTES` by several tasks,
    a range of whole lines each --, parquet (a file or a folder of them, as a Hugging Face snapshot holds them), or
    a ``datasets`` ``save_to_disk`` folder (its Arrow files, one task each)."""
    import ray.data

    filesystem = _arrow_filesystem(options) if "://" in input_uri else None
    path = input_uri.split("://", 1)[-1] if filesystem is not None else input_uri
    local_folder = "://" not in input_uri and os.path.isdir(input_uri)

    def make(held: Any) -> Any:
        # reading and parsing ask for no CPU, as the writes: the encoder actors may hold every CPU of the cluster
        # (measured: a 1-CPU read task waited forever behind two 1-CPU actors on a 2-CPU session)
        parquet = sorted(str(f) for f in Path(input_uri).rglob("*.parquet")) if local_folder else []
        if local_folder and os.path.isfile(os.path.join(input_uri, "state.json")):  # Dataset.save_to_disk
            files = _arrow_files(input_uri)
            raw = ray.data.from_items([{"path": f} for f in files], override_num_blocks=len(files)).map_batches(
                _read_arrow_files, batch_size=1, batch_format="pyarrow", num_cpus=0, fn_kwargs={"source": input_uri})
        elif input_uri.endswith(".parquet") or parquet:
            # Ray 2.60's parquet reader (V2) lists files in a 1-CPU task that waits forever behind actors holding
            # every CPU (measured: hung on a 2-CPU session); the V1 reader's tasks take num_cpus=0
            context = ray.data.DataContext.get_current()
            was, context.use_datasource_v2 = getattr(context, "use_datasource_v2", None), False
            try:
                raw = ray.data.read_parquet(parquet or path, filesystem=filesystem, num_cpus=0)
            finally:
                if was is not None:
                    context.use_datasource_v2 = was
        elif len(ranges := _jsonl_ranges(path, filesystem, RANGE_BYTES) if not local_folder and input_uri.endswith(
                (".jsonl", ".json")) else []) > 1:  # each range is one block, for one actor at a time
            raw = ray.data.from_items(ranges, override_num_blocks=len(ranges)).map_batches(
                _read_line_ranges, batch_size=1, batch_format="pyarrow", num_cpus=0,
                fn_kwargs={"filesystem": filesystem, "source": input_uri})
        else:  # read_text splits a small file into several blocks itself: the actors share it
            raw = ray.data.read_text(path, filesystem=filesystem, drop_empty_lines=True, num_cpus=0)
        return raw.map_batches(_parse_rows, batch_format="pyarrow", batch_size=None, num_cpus=0,
                               fn_kwargs={"kind": kind, "source": input_uri, "held": held})
    return make


def _arrow_files(folder: str) -> list[str]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder, from its ``state.json``."""
    import json

    try:
        state = json.loads(Path(folder, "state.json").read_text(encoding="utf-8"))
        files = [os.path.join(folder, entry["filename"]) for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        from ..errors import DataError

        raise DataError(Path(folder, "state.json"), f"not a datasets save_to_disk state ({error})",
                        fix="save the dataset with datasets' Dataset.save_to_disk, or give JSONL or parquet") from None
    return files


def _read_arrow_files(batch: Any, source: str) -> Any:
    """A Ray Data task: the rows of one Arrow (IPC stream) file of a ``datasets`` folder, a record batch at a time."""
    import pyarrow as pa

    for path in batch.column("path").to_pylist():
        try:
            with pa.memory_map(path) as handle:
                for record_batch in pa.ipc.open_stream(handle):
                    yield pa.Table.from_batches([record_batch])
        except (OSError, pa.ArrowInvalid) as error:
            raise _input_error(path, f"not a readable datasets Arrow file ({error})",
                               "save the dataset again with datasets' save_to_disk") from None


def _jsonl_ranges(path: str, filesystem: Any, piece: int) -> list[dict]:
    """(In the driver) ``path`` cut into byte ranges of about ``piece`` bytes, each starting on a line: a seek and a
    read to the next newline per cut, never the file."""
    from pyarrow import fs

    filesystem = filesystem or fs.LocalFileSystem()
    size = filesystem.get_file_info(path).size
    starts = [0]
    with filesystem.open_input_file(path) as handle:
        while starts[-1] + piece < size:
            handle.seek(starts[-1] + piece)
            cut = starts[-1] + piece
            while True:
                chunk = handle.read(65536)
                if not chunk:
                    cut = size
                    break
                found = chunk.find(b"\n")
                if found >= 0:
                    cut += found + 1
                    break
                cut += len(chunk)
            if cut >= size:
                break
            starts.append(cut)
    return [{"path": path, "start": a, "stop": b} for a, b in zip(starts, [*starts[1:], size])]


def _read_line_ranges(batch: Any, filesystem: Any, source: str) -> Any:
    """A Ray Data task: the lines of one byte range of a JSONL file (:func:`_jsonl_ranges`), as ``read_text`` gives
    them (split on newlines only: a text may hold other Unicode line breaks)."""
    import pyarrow as pa
    from pyarrow import fs

    filesystem = filesystem or fs.LocalFileSystem()
    for path, start, stop in zip(*(batch.column(name).to_pylist() for name in ("path", "start", "stop"))):
        with filesystem.open_input_file(path) as handle:
            handle.seek(start)
            data = handle.read(stop - start)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise _input_error(source, f"not UTF-8 text (byte {start + error.start})",
                               "save the file as UTF-8") from None
        yield pa.table({"text": pa.array([line for line in text.split("\n") if line.strip()], pa.string())})


def _input_error(path: str, problem: str, fix: str) -> "_InputError":
    """A bad input found by a read task, carried to the driver as :func:`_parse_rows` carries robustir's errors."""
    import json

    fields = {"path": str(path), "problem": problem, "line": None, "field": None, "fix": fix}
    return _InputError(f"{path}: {problem}", json.dumps(fields))


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
    from ..index.store.storage import open_store

    parent, _, name = job.uri.rpartition("/")
    open_store(parent, job.options).remove_tree(name)


def _held_ids(job: OutputJob) -> Any:
    """The ids the dataset holds (a fragment is committed whole or not at all), as one Arrow string array: about
    20 bytes an id in the driver, on resume only (100M committed ids: ~2 GB -- docs/scale.md)."""
    import lance
    import pyarrow as pa

    if not job.exists():
        return pa.array([], pa.string())
    column = lance.dataset(job.uri, storage_options=job.options).to_table(columns=["id"]).column("id")
    return column.combine_chunks()


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


def encode_documents_with_ray(encoder: Any, texts: Callable[[], Iterable[str]], digest: str, output: Path,
                              config: RayEncodeConfig, device: str | None = None, *,
                              then: Callable[[str], Any] | None = None) -> Any:
    """Passage vectors of ``texts()`` encoded on Ray with ``encoder``'s model and settings into the resumable Lance
    dataset ``output`` (dense mining's corpus embeddings, ``MiningConfig.engine: ray``), whose ids are the texts' row
    numbers (``%012d``). ``digest`` stands for the texts' content in the record (they are not a file).

    The texts are read from ``texts()`` a block of ``batch_rows`` at a time and each block is put in Ray's object
    store (spilled to disk when it fills) before the next is read: the driver holds one block and the blocks'
    references, never the corpus's texts.

    ``then(uri)`` runs while this process still holds the output's lock -- after the encoding, or at once when it
    was already complete -- and its result is returned: mining writes its ``.npy`` there
    (:func:`write_in_row_order`), so two miners sharing the cache folder (a job array) encode and write it once:
    the second waits for the first, then finds it done. Without ``then``: the vectors, ``(n, d)`` in row order."""
    import dataclasses

    from ..models.encoder import resolve_model_path

    local_model = absolute(resolve_model_path(encoder.source), "model")
    options = dataclasses.asdict(encoder.config)

    def rows(held: Any) -> Any:  # blocks of batch_rows texts, ids their row numbers, put one at a time
        import itertools

        import pyarrow as pa
        import ray
        import ray.data

        blocks, source, first = [], iter(texts()), 0
        while block := list(itertools.islice(source, config.batch_rows)):
            ids = [f"{i:012d}" for i in range(first, first + len(block))]
            blocks.append(ray.put(_parse_rows(pa.table({"_id": ids, "text": block}), "passage",
                                              "the texts to mine", held)))
            first += len(block)
        return ray.data.from_arrow_refs(blocks)

    job = OutputJob(output)
    result: list[Any] = []
    _encode(rows, {"model": local_model}, local_model, job, "passage", config, options, False, device,
            None, None, extra={"texts": digest}, paths={"model folder": local_model}, wait=True,
            then=lambda: result.append(then(job.uri) if then is not None else read_vectors(job.uri)[1]))
    return result[0]


def write_in_row_order(output: str, file: Any) -> int:
    """Write the vectors of ``output`` (a dataset of :func:`encode_documents_with_ray`: ids are row numbers) into
    the :class:`~robustir.index.dense.EmbeddingFile` ``file`` at their rows, one Lance batch at a time: the driver
    holds one batch, never the corpus's vectors. Returns the rows written."""
    import lance

    written = 0
    for batch in lance.dataset(output).to_batches(columns=["id", "vector"], batch_size=8192):
        rows = np.asarray([int(i) for i in batch.column("id").to_pylist()], dtype=np.int64)
        column = batch.column("vector")
        vectors = np.asarray(column.flatten()).reshape(len(rows), column.type.list_size)
        order = np.argsort(rows, kind="stable")
        rows, vectors = rows[order], vectors[order]
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # runs of consecutive rows: one write each
        for run_rows, run in zip(np.split(rows, breaks), np.split(vectors, breaks)):
            file.write(int(run_rows[0]), run)
        written += len(rows)
    return written


def _encode(source: Callable[[Any], Any], inputs: dict, model: str, job: OutputJob, kind: str,
            config: RayEncodeConfig, encoder_options: dict | None, overwrite: bool, device: str | None,
            on_batch: Callable[[int, list[str]], None] | None, on_part: Callable[[int], None] | None,
            extra: dict | None = None, paths: dict | None = None, wait: bool = False,
            then: Callable[[], Any] | None = None) -> RayEncodeReport:
    """``source(held)``: the Ray Data dataset of ``(id, text)`` to encode, less the ids ``held`` (an Arrow array)."""
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
        held = _held_ids(job) if decision.state == "resume" else None
        if held is not None and len(held):
            logger.info("%s: %d rows were committed by an earlier run; encoding the others", job.uri, len(held))
        dim = int(AutoConfig.from_pretrained(model).hidden_size)  # Encoder.dim, without loading the weights here
        import ray.data

        context = ray.data.DataContext.get_current()  # copied into each dataset when it is made: set before
        raised, context.raise_original_map_exception = context.raise_original_map_exception, True
        try:  # a bad input's own message reaches the driver, not "UDF failed to process a data block"
            parts, encoded = _run(job, source(held), model, kind, dim, config, encoder_options,
                                  device or ("cuda" if config.num_gpus else "cpu"), on_batch, on_part)
        finally:
            context.raise_original_map_exception = raised  # the driver's other Ray Data jobs as they were
        resumed = len(held) if held is not None else 0
        total, stored = resumed + encoded, _count(job)
        if total == 0:
            raise ConfigError(f"no {kind}s to encode in {inputs.get('input', 'the input')}")
        if stored != total:  # the lock keeps other writers out: a mismatch is a bug or a hand edit, never kept quiet
            raise ConfigError(f"{job.uri} holds {stored} rows after the job, {total} were expected; run it again "
                              "with --overwrite")
        _refuse_duplicates(job, inputs.get("input"), total)
        seconds = time.perf_counter() - started
        record.finish({"rows": total, "parts": parts, "dim": dim, "seconds": round(seconds, 1)}, files=[])
        if then is not None:
            then()
    return RayEncodeReport(total, parts, resumed, seconds)


#: up to this many rows the duplicate-id check reads the id column into the driver (Arrow, ~20 bytes an id: 100 MB
#: at 5M); above, a Ray Data group-by finds them (measured 7-10 s of fixed cost a job on 2 busy cores, so not for
#: small jobs)
DISTINCT_IN_DRIVER = 5_000_000


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
    import pyarrow as pa
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
