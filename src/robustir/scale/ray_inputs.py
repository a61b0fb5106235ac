"""How ``robustir encode --engine ray`` reads its input: Ray Data read tasks over JSONL (a large file in ranges of
whole lines), parquet, a Hugging Face ``datasets`` folder or ``hf://datasets/ORG/NAME`` from the local cache, local or
``s3://``; each block checked as the single-process path checks it (:mod:`robustir.data.beir`), less the ids a resumed
job holds. Bad input is a :class:`~robustir.errors.DataError` naming the file, carried from the task to the driver as
:class:`_InputError`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from .job import absolute

__all__ = ["RANGE_BYTES", "resolve_input"]

def _parse_rows(batch: Any, kind: str, source: str, held: Any = None) -> Any:
    """A Ray Data task: one block of the input -- JSONL lines (``read_text``'s ``text`` column) or parquet rows --
    as ``(id, text)`` with robustir's own checks (:mod:`robustir.data.beir`: a string id, ``text`` required,
    ``title`` optional, title and text joined by :func:`~robustir.data.beir.encoding_text`, empty documents
    skipped), less the ids ``held`` holds (a resumed job's committed rows: their sorted digests, or the reference
    to them in Ray's object store, :func:`robustir.scale.ray_encode._held_ids`)."""
    from ..errors import RobustIRError

    try:
        return _checked_rows(batch, kind, source, held)
    except RobustIRError as error:  # robustir's errors do not pickle: their fields cross to the driver
        import json

        fields = {name: getattr(error, name, None) for name in ("path", "problem", "line", "field", "fix")}
        raise _InputError(str(error), json.dumps(fields)) from None


class _InputError(Exception):
    """A bad input found by a read task: its message, then its :class:`DataError`'s fields as JSON (path, problem,
    line, field, fix), carried to the driver (Ray pickles a task's error; robustir's do not pickle)."""


def _checked_rows(batch: Any, kind: str, source: str, held: Any) -> Any:
    import json

    import pyarrow as pa

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
    if held is not None and table.num_rows:
        keep = ~held_mask(table.column("id").to_pylist(), held)
        if not keep.all():
            table = table.filter(pa.array(keep))
    return table


def held_mask(ids: list[str], held: Any) -> Any:
    """Which of ``ids`` a resumed job holds: their 128-bit digests looked up in ``held``, the sorted digests of the
    ids it holds (``S16``; or the reference to them in Ray's object store, mapped here without a copy) -- a binary
    search each, no hash set of every held id built per block."""
    import numpy as np

    if not isinstance(held, np.ndarray):
        import ray

        held = ray.get(held)
    if not len(held) or not ids:
        return np.zeros(len(ids), dtype=bool)
    wanted = id_digests(ids)
    at = np.minimum(np.searchsorted(held, wanted), len(held) - 1)
    return held[at] == wanted


def id_digests(ids: list[str]) -> Any:
    """The ids' 128-bit BLAKE2b digests (:func:`robustir.io.text_digest`) as a numpy ``S16`` array: how a resumed
    job's held ids are kept and looked up."""
    import numpy as np

    from ..io import text_digest

    return np.array([text_digest(i, 16) for i in ids], dtype="S16")


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

#: read tasks of one job at once: they ask for no CPU (the encoder actors may hold every CPU of the cluster), and
#: 0-CPU tasks are otherwise all started at once, a Python worker each (measured: 80 workers on 2 cores for 5,000
#: small tasks) -- with 64 MiB ranges, memory the cluster does not have
READ_TASKS = 8


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
                _read_arrow_files, batch_size=1, batch_format="pyarrow", num_cpus=0, concurrency=READ_TASKS,
                fn_kwargs={"source": input_uri})
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
                _read_line_ranges, batch_size=1, batch_format="pyarrow", num_cpus=0, concurrency=READ_TASKS,
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
