"""What a Ray job writes, and who writes it: the output's location (an absolute local path or ``s3://``), its run
record, one driver at a time, and whether every node of the cluster sees the paths the job sends its actors.

* **Locations are absolute.** Ray ships a path to actors as a string and each actor opens it from its own working
  folder (a cluster's, or the ``runtime_env`` working dir), so a relative ``--output`` put the data files there and
  the commit beside the driver. :func:`absolute` makes every local path absolute on the driver (symlinks kept: a
  shared mount seen through a link is seen the same on every node); ``s3://`` stays as it is.
* **Every node sees them.** :func:`check_cluster_sees` runs one zero-CPU task on each live node that checks the
  input and the model exist there and that the output's folder is the driver's (a marker file the driver wrote):
  a node that does not see one is refused with the path named and the fix (a shared mount, or ``s3://``), before
  any work rather than as "Not found" after it.
* **One driver per output.** :class:`OutputJob.lock` takes ``flock`` on ``<output>.lock`` (its holder -- host, pid
  -- written inside, so a second driver is refused naming it); on S3 the index's writer *lease*
  (:class:`~robustir.index.store.s3.S3Store`, a conditional put renewed in the background) on the prefix
  ``<output>.job/``. Mining waits for the holder instead (the shards of a job array share the cache).
* **The record** is :class:`~robustir.runs.Artifact`'s ``<output>.run.json``; on S3 the object
  ``<output>.job/run.json`` (S3 writes an object whole or not at all).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import ConfigError
from ..runs import Artifact

__all__ = ["OutputJob", "absolute", "check_cluster_sees"]

logger = logging.getLogger(__name__)


def absolute(location: str | os.PathLike, what: str) -> str:
    """``location`` as every node of a cluster can read it: a local path made absolute here (``~`` expanded,
    ``..`` folded, symlinks kept), or an ``s3://`` URI as it is; another scheme is refused naming ``what``."""
    text = str(location)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme not in ("s3", "s3a"):
            raise ConfigError(f"{what} {text}: {scheme}:// is not supported by the Ray engine; give an absolute "
                              "path on storage every node mounts, or s3://bucket/prefix/...")
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


def _look(paths: dict[str, str], marker: str | None, token: str) -> tuple[str, list[str]]:
    """On one node: its address and what it does not see (``what=path``)."""
    import ray

    unseen = [f"{what} {path}" for what, path in paths.items() if not os.path.exists(path)]
    if marker is not None:
        try:
            same = Path(marker).read_text(encoding="utf-8") == token
        except OSError:
            same = False
        if not same:
            unseen.append(f"output folder {os.path.dirname(marker)}")
    return ray.util.get_node_ip_address(), unseen


def check_cluster_sees(paths: Mapping[str, str], output: str | None = None) -> None:
    """Refuse (naming the node, the path and the fix) when a live node of the Ray cluster does not see one of
    ``paths`` (local ones; ``s3://`` is skipped) or sees another folder than the driver's where ``output`` goes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    local = {what: path for what, path in paths.items() if "://" not in path}
    marker = token = None
    if output is not None and "://" not in output:
        folder = os.path.dirname(output)
        os.makedirs(folder, exist_ok=True)
        token = uuid.uuid4().hex
        marker = os.path.join(folder, f".robustir-probe-{token}")
        Path(marker).write_text(token, encoding="utf-8")
    if not local and marker is None:
        return
    try:
        look = ray.remote(num_cpus=0, max_retries=1)(_look)
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        answers = ray.get([look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"],
                                                                                            soft=False))
                           .remote(local, marker, token or "") for node in nodes], timeout=300)
    finally:
        if marker is not None:
            Path(marker).unlink(missing_ok=True)
    missing = [(node, unseen) for node, unseen in answers if unseen]
    if missing:
        where = "; ".join(f"node {node} does not see the {', the '.join(unseen)}" for node, unseen in missing)
        raise ConfigError(f"{where}. The Ray actors read and write these paths themselves: put them on storage "
                          "every node mounts at the same path (NFS, a shared volume), or write the output to "
                          "s3://bucket/prefix/NAME.lance")


class _DatasetPath(str):
    """A Lance dataset's URI where :class:`~robustir.runs.Artifact` expects a path (``exists``, ``name``)."""

    def __new__(cls, uri: str, options: dict | None) -> "_DatasetPath":
        made = super().__new__(cls, uri)
        made.options = options
        return made

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def exists(self) -> bool:
        import lance

        try:
            lance.dataset(str(self), storage_options=self.options)
        except (ValueError, OSError, RuntimeError):
            return False
        return True

    is_dir = exists


class _RecordPath(str):
    """The object ``run.json`` of a store where :class:`~robustir.runs.Artifact` expects its record's path."""

    name = "run.json"

    def __new__(cls, store: Any) -> "_RecordPath":
        made = super().__new__(cls, str(store.where("run.json")))
        made.store = store
        return made

    def exists(self) -> bool:
        return self.store.exists("run.json")


class _ObjectRecord(Artifact):
    """An :class:`~robustir.runs.Artifact` whose record is the object ``run.json`` of a store (S3)."""

    def __init__(self, uri: str, store: Any, options: dict | None, what: str) -> None:
        super().__init__(Path("."), what=what)
        self.path = _DatasetPath(uri, options)  # type: ignore[assignment]
        self.store = store

    @property
    def record_path(self) -> Any:
        return _RecordPath(self.store)

    def record(self) -> dict | None:
        text = self.store.read_text("run.json")
        try:
            data = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None

    def _write(self, record: dict) -> None:
        self.store.write_text("run.json", json.dumps(record, indent=1))

    def clear(self) -> None:
        from ..index.store.stores import open_store

        parent, _, name = str(self.path).rpartition("/")
        open_store(parent, self.store.options).remove_tree(name)
        self.store.delete("run.json")


class OutputJob:
    """The Lance dataset a Ray job writes: ``uri`` (absolute, or ``s3://``), its record, its lock, Lance's options."""

    def __init__(self, output: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
                 what: str = "Ray-encoded vectors") -> None:
        self.uri = absolute(output, "--output")
        if not self.uri.endswith(".lance"):
            raise ConfigError(f"--output {output}: the Ray engine writes a Lance dataset; name it with .lance, e.g. "
                              f"{str(output).rstrip('/')}.lance")
        self.remote = "://" in self.uri
        if self.remote:
            from ..index.store.s3 import S3Store

            if self.uri.count("/") < 4:
                raise ConfigError(f"--output {self.uri}: write it as s3://BUCKET/PREFIX/NAME.lance (a job keeps its "
                                  "record and lease beside the dataset, under a prefix)")
            self.store = S3Store(self.uri + ".job", storage_options)
            self.options = self.store.lance_options
            self.record = _ObjectRecord(self.uri, self.store, self.options, what)
        else:
            if storage_options:
                raise ConfigError(f"--storage-option goes with an s3:// output, not a local path ({self.uri})")
            self.options = None
            self.record = Artifact(Path(self.uri), what=what)

    def exists(self) -> bool:
        """Whether a Lance dataset was committed there (fragment files written before the first commit do not
        make one)."""
        return _DatasetPath(self.uri, self.options).exists()

    @contextmanager
    def lock(self, *, wait: bool = False) -> Iterator[None]:
        """Hold this output's writer lock for the block; another holder: refused naming it (``wait``: waited for,
        local outputs only)."""
        if self.remote:
            lease = self.store.lock()
            try:
                yield
            finally:
                lease.release()
            return
        import fcntl

        from ..io import try_lock

        file = Path(self.uri + ".lock")
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = try_lock(file)
        if fd is None and wait:
            logger.info("%s is being written by %s: waiting for it", self.uri, _holder(file))
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        if fd is None:
            raise ConfigError(f"{self.uri} is being written by another driver ({_holder(file)}): wait for it to "
                              "finish, or stop it, then run this again (a killed driver's lock goes with its process; "
                              "the next run resumes its work)")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                      "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode(), 0)
            yield
        finally:
            os.close(fd)


def _holder(file: Path) -> str:
    try:
        held = json.loads(file.read_text(encoding="utf-8"))
        return f"pid {held['pid']} on {held['host']}, since {held['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
