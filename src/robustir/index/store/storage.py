"""Where a search index lives: a local folder, or a prefix on S3 (``s3://bucket/prefix``, and S3-compatible stores --
MinIO, Ceph, R2 -- through an endpoint). :class:`SearchIndex <robustir.index.store.SearchIndex>` does all its
reading and writing of its own files (the manifest, the writer lock, the data folders) through one of these; the
table itself is opened by LanceDB at :meth:`IndexStore.lance_uri` with :attr:`IndexStore.lance_options`.

=====================  =================================  =====================================================
what the index needs   local folder (:class:`LocalStore`)  S3 (:class:`~.s3.S3Store`)
=====================  =================================  =====================================================
manifest written       temporary file + ``rename``         one ``PutObject`` (S3 writes an object whole or not at
atomically                                                 all; readers see the old or the new one)
"has it changed?"      inode, mtime, ctime, size           the object's ETag (one ``HeadObject`` per query)
one writer at a time   ``flock`` (gone with the process)   a *lease* object ``writer.lock`` made with a
                                                           conditional put (``If-None-Match: *``), renewed every
                                                           ``ttl / 3`` with ``If-Match`` on its ETag, taken over
                                                           (``If-Match``) only once expired, deleted on release
data files verified    size + SHA-256 (read once)          size + ETag from one listing (S3 gives a new ETag to
                                                           any rewritten object; nothing is downloaded)
=====================  =================================  =====================================================

**Credentials** come from the environment as for any AWS tool (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, a profile, an instance role: boto3's and LanceDB's own
chains), or from ``storage_options`` (``--storage-option k=v``): LanceDB's object-store keys (``aws_endpoint``,
``aws_region``, ``allow_http`` ...), given to both clients; an unknown key is refused at once. They are never
written anywhere.

**The lease** answers what ``flock`` answers locally: one robustir writer at a time, and whether an unfinished job
in the manifest has a live writer (a reader then serves the committed rows) or a dead one (a reader refuses it with
the command that finishes it). A writer killed with -9 leaves its lease until it expires (``ttl``, 60 s by default):
until then another writer is refused naming the holder, after it the next writer takes it over and resumes the job.
A writer that could not renew in time (a network partition, a frozen process) finds it lost before its next commit
and stops. The clocks of the machines must agree to well within ``ttl`` (NTP does); the clock is injected for tests.

Only ``s3://`` is taken: ``gs://`` and ``az://`` have the same building blocks (generation / ETag preconditions) but
no client and no test here, so they are refused naming this.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from ...errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = ["IndexStore", "LocalStore", "ObjectPath", "is_remote", "parse_storage_options"]

LOCK = "writer.lock"
_VERSIONS = ("/_versions/", "/_transactions/")  # Lance's own commit files: checked by version and count, not hashed

#: the object-store keys LanceDB (the Rust ``object_store`` crate) takes for S3, without their ``aws_`` prefix
_S3_KEYS = {"access_key_id", "secret_access_key", "session_token", "token", "region", "default_region", "endpoint",
            "endpoint_url", "bucket", "virtual_hosted_style_request", "unsigned_payload", "checksum_algorithm",
            "metadata_endpoint", "container_credentials_relative_uri", "skip_signature", "s3_express",
            "request_payer", "copy_if_not_exists", "conditional_put", "disable_tagging", "server_side_encryption",
            "sse_kms_key_id", "sse_bucket_key_enabled", "imdsv1_fallback"}
_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "connect_timeout", "timeout", "pool_idle_timeout",
                "pool_max_idle_per_host", "proxy_url", "proxy_excludes", "proxy_ca_certificate", "user_agent",
                "http1_only", "http2_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
                "http2_keep_alive_while_idle", "randomize_addresses", "default_content_type"}
_LANCE_KEYS = {"download_retry_count", "max_retries", "retry_timeout", "expires_at_millis", "client_max_retries",
               "client_retry_timeout", "lance_io_threads"}


def is_remote(location: Any) -> bool:
    """Whether ``location`` names an object store (``scheme://``) rather than a local folder."""
    return isinstance(location, (str, ObjectPath)) and "://" in str(location)


def parse_storage_options(pairs: list[str] | None) -> dict[str, str]:
    """``--storage-option k=v`` flags as a dict; a pair without ``=`` or an unknown key is refused."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {pair!r}: write it as KEY=VALUE (e.g. aws_region=eu-west-1)")
        options[key.strip()] = value
    _check_keys(options)
    return options


def _check_keys(options: Mapping[str, Any]) -> None:
    known = _S3_KEYS | _CLIENT_KEYS | _LANCE_KEYS
    for key in options:
        bare = key.lower().removeprefix("aws_")
        if bare not in known and key.lower() not in known:
            raise ConfigError(f"storage option {key!r} is not an S3 object-store option; known: aws_endpoint, "
                              "aws_region, aws_access_key_id, aws_secret_access_key, aws_session_token, allow_http, "
                              "... (LanceDB's object-store keys: https://lancedb.com/docs/storage/)")


class ObjectPath(str):
    """An object's address (``s3://bucket/key``), for messages and errors the way a :class:`~pathlib.Path` is."""

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.rstrip("/") + "/" + str(name).lstrip("/"))

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.rstrip("/").rsplit("/", 1)[0])


class IndexStore:
    """What an index does with its own files, on a local folder or an object store (see the module docstring).
    Names are relative to the index's root (``manifest.json``, ``lance.1/docs.lance/data/...``)."""

    remote = False
    path: Any  # the index's location, as messages show it (a Path, or an ObjectPath)

    def where(self, name: str) -> Any:
        return self.path / name

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def read_text(self, name: str) -> str | None:
        """The file's text, None when it does not exist."""
        raise NotImplementedError

    def write_text(self, name: str, text: str) -> None:
        """Replace the file atomically: a reader sees the old text or the new, never a part."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def token(self, name: str) -> Any:
        """What changes whenever the file is rewritten (None: it does not exist)."""
        raise NotImplementedError

    def listing(self, folder: str) -> dict[str, dict]:
        """``{name: {"size": bytes, "etag": ... (object stores)}}`` of every data file under ``folder`` (Lance's
        version and transaction files left out)."""
        raise NotImplementedError

    def sha256(self, name: str) -> str:
        raise NotImplementedError

    def remove_tree(self, folder: str) -> None:
        raise NotImplementedError

    def folders(self) -> list[str]:
        """The names of the top-level folders under the index's root."""
        raise NotImplementedError

    def lance_uri(self, folder: str) -> str:
        raise NotImplementedError

    @property
    def lance_options(self) -> dict | None:
        return None

    def prepare(self) -> None:
        """Make sure the location can hold an index (a folder is made; a bucket must exist)."""
        raise NotImplementedError

    def holds_index(self) -> bool:
        """Whether something is at the location at all (``open`` says "no index here" otherwise)."""
        raise NotImplementedError

    def lock(self) -> "WriterLock":
        """Take the writer lock, or raise :class:`ConfigError` naming who holds it."""
        raise NotImplementedError

    def writer_running(self) -> bool:
        raise NotImplementedError

    def incoming_dir(self) -> Path:
        """A local folder for the files of HTTP upserts (``robustir serve``): inside a local index; for an
        object-store index, in this machine's cache (a server restarted on this machine finishes an upsert its
        predecessor left; another machine sees the job and can drop it)."""
        raise NotImplementedError


class WriterLock:
    """A held writer lock: :meth:`check` raises when it was lost (a lease taken over), :meth:`release` lets go."""

    def check(self) -> None:
        return None

    def release(self) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ a local folder

class LocalStore(IndexStore):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    def read_text(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise DataError(self.path / name, "is a folder, not a file", fix="rebuild the index with --overwrite") \
                from None

    def write_text(self, name: str, text: str) -> None:
        from ...io import atomic_write

        with atomic_write(self.path / name) as handle:
            handle.write(text)

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def token(self, name: str) -> Any:
        try:
            st = (self.path / name).stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size  # an atomic rename makes a new inode

    def listing(self, folder: str) -> dict[str, dict]:
        """With ``os.scandir`` (the size from the directory entry's stat): an index of 100k documents holds hundreds of
        files and every job lists them; ``Path.rglob`` + sorting ``Path`` objects cost 4x more (issue 51)."""
        out = {}

        def walk(path: str, relative: str) -> None:
            try:
                entries = list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                return
            for entry in entries:
                name = f"{relative}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, name)
                elif entry.is_file() and not any(part in f"/{name}/" for part in _VERSIONS):
                    out[name] = {"size": entry.stat().st_size}

        walk(str(self.path / folder), folder)
        return dict(sorted(out.items()))

    def sha256(self, name: str) -> str:
        from ...runs.artifact import file_sha256

        return file_sha256(self.path / name)

    def remove_tree(self, folder: str) -> None:
        shutil.rmtree(self.path / folder, ignore_errors=True)

    def folders(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_dir()) if self.path.is_dir() else []

    def lance_uri(self, folder: str) -> str:
        return str(self.path / folder)

    def prepare(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise DataError(self.path, "is a file, not an index folder", fix="choose another --output")
        self.path.mkdir(parents=True, exist_ok=True)

    def holds_index(self) -> bool:
        if self.path.exists() and not self.path.is_dir():
            raise DataError(self.path, "is not a folder",
                            fix=f"build an index with: robustir index --corpus CORPUS --output {self.path}")
        return self.path.is_dir()

    def lock(self) -> WriterLock:
        from ...io import try_lock

        self.prepare()
        fd = try_lock(self.path / LOCK)  # a reader's probe (writer_running) holds the lock for microseconds: retried
        if fd is None:
            raise ConfigError(f"index {self.path} is being changed by another process (a build, --add, --upsert, "
                              "--delete or --compact): wait for it to finish, then run this again")
        return _FlockLock(fd)

    def writer_running(self) -> bool:
        import fcntl

        try:
            fd = os.open(self.path / LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def incoming_dir(self) -> Path:
        return (self.path / "incoming").absolute()  # a job records its input's path: the same from any folder


class _FlockLock(WriterLock):
    """``flock`` on ``writer.lock``: released by closing the descriptor, or when the process dies, even by kill -9."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ------------------------------------------------------------------------------------------------ S3
