"""Where a search index lives: a local folder, or a prefix on S3 (``s3://bucket/prefix``, and S3-compatible stores --
MinIO, Ceph, R2 -- through an endpoint). :class:`SearchIndex <robustir.serving.index.SearchIndex>` does all its
reading and writing of its own files (the manifest, the writer lock, the data folders) through one of these; the
table itself is opened by LanceDB at :meth:`IndexStore.lance_uri` with :attr:`IndexStore.lance_options`.

=====================  =================================  =====================================================
what the index needs   local folder (:class:`LocalStore`)  S3 (:class:`S3Store`)
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

import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = ["IndexStore", "LocalStore", "S3Store", "ObjectPath", "open_store", "is_remote", "parse_storage_options",
           "LEASE_TTL_S"]

#: seconds a writer's lease on an object-store index lasts without renewal (renewed every third of it)
LEASE_TTL_S = 60.0
LOCK = "writer.lock"
_VERSIONS = ("/_versions/", "/_transactions/")  # Lance's own commit files: checked by version and count, not hashed
_MISSING = ("NoSuchKey", "404", "NotFound")  # S3 error codes: the object is not there
_CONFLICT = ("PreconditionFailed", "412", "ConditionalRequestConflict")  # a conditional write lost

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


def open_store(location: "str | os.PathLike | IndexStore", storage_options: Mapping[str, Any] | None = None,
               ) -> "IndexStore":
    """The store for ``location``: a local folder, or ``s3://bucket/prefix``."""
    if isinstance(location, IndexStore):
        if storage_options:
            raise ConfigError("storage options go with an index location, not with an open store")
        return location
    if is_remote(location):
        scheme = str(location).split("://", 1)[0].lower()
        if scheme in ("s3", "s3a"):
            return S3Store(str(location), storage_options)
        raise ConfigError(f"index location {location}: {scheme}:// is not supported; robustir keeps an index on a "
                          "local folder or on S3 (s3://bucket/prefix, or an S3-compatible store through "
                          "--storage-option aws_endpoint=...)")
    if storage_options:
        raise ConfigError(f"--storage-option goes with an object-store index (s3://...), not a local folder "
                          f"({location})")
    return LocalStore(Path(location))


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
        from ..io import atomic_write

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
        out = {}
        for file in sorted((self.path / folder).rglob("*")):
            posix = file.as_posix()
            if file.is_file() and not any(part in posix for part in _VERSIONS):
                out[file.relative_to(self.path).as_posix()] = {"size": file.stat().st_size}
        return out

    def sha256(self, name: str) -> str:
        from ..runs.artifact import file_sha256

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
        from ..io import try_lock

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

class S3Store(IndexStore):
    """An index under ``s3://bucket/prefix`` (boto3 for the manifest and the lease, LanceDB for the table).

    ``clock`` (seconds, :func:`time.time`) and ``lease_ttl`` are injected by tests; ``heartbeat=False`` makes a lease
    that is never renewed in the background (tests renew it by hand)."""

    remote = True

    def __init__(self, location: str, storage_options: Mapping[str, Any] | None = None, *,
                 clock: Callable[[], float] = time.time, lease_ttl: float = LEASE_TTL_S,
                 heartbeat: bool = True) -> None:
        scheme, _, rest = location.partition("://")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or not prefix:
            raise ConfigError(f"index location {location}: write it as s3://BUCKET/PREFIX (the index is kept under a "
                              "prefix, never at a bucket's root)")
        if any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ConfigError(f"index location {location}: the prefix has an empty, '.' or '..' part")
        options = {str(k): str(v) for k, v in (storage_options or {}).items()}
        _check_keys(options)
        self.bucket, self.prefix = bucket, prefix
        self.path = ObjectPath(f"s3://{bucket}/{prefix}")
        self.options = options
        self.clock, self.lease_ttl, self.heartbeat = clock, float(lease_ttl), heartbeat
        self._client: Any = None

    # ------------------------------------------------------------------ clients
    def _option(self, *names: str) -> str | None:
        for name in names:
            for key, value in self.options.items():
                if key.lower() in (name, "aws_" + name):
                    return value
        return None

    @property
    def client(self) -> Any:
        """A boto3 S3 client: the options given, else boto3's own chain (environment, profile, role); boto3's
        standard retry mode (with its backoff) for throttling and transient errors."""
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                raise ConfigError("an index on S3 needs boto3: pip install 'robustir[scale]'") from exc
            self._client = boto3.client(
                "s3", endpoint_url=self._option("endpoint", "endpoint_url"),
                region_name=self._option("region", "default_region"),
                aws_access_key_id=self._option("access_key_id"),
                aws_secret_access_key=self._option("secret_access_key"),
                aws_session_token=self._option("session_token", "token"),
                config=Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10, read_timeout=60))
        return self._client

    @property
    def lance_options(self) -> dict | None:
        """The options for LanceDB: the ones given, plus the endpoint boto3 found in ``AWS_ENDPOINT_URL`` (LanceDB
        reads the rest of the environment itself) and ``allow_http`` for an ``http://`` endpoint."""
        options = dict(self.options)
        endpoint = self._option("endpoint", "endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and self._option("endpoint", "endpoint_url") is None:
            options["aws_endpoint"] = endpoint
        if endpoint and endpoint.startswith("http://") and self._option("allow_http") is None:
            options["allow_http"] = "true"
        if self._option("region", "default_region") is None and self.client.meta.region_name:
            options["aws_region"] = self.client.meta.region_name
        return options or None

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _call(self, what: str, fn: Callable[..., Any], *, passthrough: tuple[str, ...] = (), **kwargs: Any) -> Any:
        """One S3 request; an error other than the ones the caller handles (``passthrough``: error codes re-raised
        as they are) becomes a :class:`ConfigError` naming the location, the request and the fix."""
        import botocore.exceptions as bex

        try:
            return fn(**kwargs)
        except bex.NoCredentialsError:
            raise ConfigError(f"index {self.path}: no AWS credentials found for {what}; set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or a profile / role), or pass --storage-option "
                              "aws_access_key_id=... --storage-option aws_secret_access_key=...") from None
        except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError) as exc:
            raise ConfigError(f"index {self.path}: cannot reach the object store for {what} ({exc}); check the "
                              "endpoint (AWS_ENDPOINT_URL or --storage-option aws_endpoint=...)") from None
        except bex.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in passthrough:
                raise
            if fn.__name__ == "head_bucket" and code in ("404", "NotFound"):
                code = "NoSuchBucket"
            elif code in ("403", "Forbidden"):
                code = "AccessDenied"
            message = exc.response.get("Error", {}).get("Message", str(exc))
            fix = {"NoSuchBucket": f"create the bucket {self.bucket} first",
                   "AccessDenied": "the credentials may not read or write this bucket and prefix",
                   "InvalidAccessKeyId": "check AWS_ACCESS_KEY_ID / --storage-option aws_access_key_id",
                   "SignatureDoesNotMatch": "check AWS_SECRET_ACCESS_KEY / --storage-option aws_secret_access_key",
                   }.get(code, "check the location, the credentials and the endpoint")
            raise ConfigError(f"index {self.path}: {what} failed ({code}: {message}); {fix}") from None

    @staticmethod
    def _code(exc: Exception) -> str:
        return getattr(exc, "response", {}).get("Error", {}).get("Code", "")

    # ------------------------------------------------------------------ files
    def exists(self, name: str) -> bool:
        return self.token(name) is not None

    def _if_present(self, name: str, fn: Callable[..., Any]) -> Any:
        """``fn`` (``get_object`` / ``head_object``) on the object ``name``; None when it does not exist."""
        import botocore.exceptions as bex

        try:
            return self._call(f"reading {name}", fn, passthrough=_MISSING, Bucket=self.bucket, Key=self.key(name))
        except bex.ClientError as exc:
            if self._code(exc) in _MISSING:
                return None
            raise

    def _get(self, name: str) -> tuple[str, str] | None:
        """The object's text and ETag, None when it does not exist."""
        reply = self._if_present(name, self.client.get_object)
        if reply is None:
            return None
        try:
            return reply["Body"].read().decode("utf-8"), reply["ETag"]
        except UnicodeDecodeError:
            raise DataError(self.where(name), "is not UTF-8 text", fix="rebuild the index with --overwrite") from None

    def read_text(self, name: str) -> str | None:
        got = self._get(name)
        return got[0] if got is not None else None

    def write_text(self, name: str, text: str) -> None:
        self._call(f"writing {name}", self.client.put_object, Bucket=self.bucket, Key=self.key(name),
                   Body=text.encode("utf-8"), ContentType="application/json")

    def delete(self, name: str) -> None:
        self._call(f"deleting {name}", self.client.delete_object, Bucket=self.bucket, Key=self.key(name))

    def token(self, name: str) -> Any:
        head = self._if_present(name, self.client.head_object)
        return head["ETag"] if head is not None else None

    def _objects(self, prefix: str, delimiter: str | None = None) -> Any:
        paginator = self.client.get_paginator("list_objects_v2")
        kwargs = {"Bucket": self.bucket, "Prefix": prefix, **({"Delimiter": delimiter} if delimiter else {})}
        return self._call(f"listing {prefix}", lambda: list(paginator.paginate(**kwargs)))

    def listing(self, folder: str) -> dict[str, dict]:
        out = {}
        root = self.prefix + "/"
        for page in self._objects(self.key(folder.strip("/")) + "/"):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(root):]
                if not any(part in "/" + name for part in _VERSIONS):
                    out[name] = {"size": int(obj["Size"]), "etag": obj["ETag"]}
        return dict(sorted(out.items()))

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        body = self._call(f"reading {name}", self.client.get_object, Bucket=self.bucket, Key=self.key(name))["Body"]
        for chunk in iter(lambda: body.read(1 << 20), b""):
            digest.update(chunk)
        return digest.hexdigest()

    def remove_tree(self, folder: str) -> None:
        keys = [obj["Key"] for page in self._objects(self.key(folder.strip("/")) + "/")
                for obj in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1,000 keys a request
            self._call(f"removing {folder}", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})

    def folders(self) -> list[str]:
        root = self.prefix + "/"
        return sorted(common["Prefix"][len(root):].rstrip("/") for page in self._objects(root, "/")
                      for common in page.get("CommonPrefixes", []))

    def lance_uri(self, folder: str) -> str:
        return f"s3://{self.bucket}/{self.key(folder)}"

    def prepare(self) -> None:
        self._call(f"opening bucket {self.bucket}", self.client.head_bucket, Bucket=self.bucket)

    def holds_index(self) -> bool:
        self.prepare()
        return bool(self._call("listing the index", self.client.list_objects_v2, Bucket=self.bucket,
                               Prefix=self.prefix + "/", MaxKeys=1).get("KeyCount", 0))

    # ------------------------------------------------------------------ the writer lease
    def _lease(self) -> tuple[dict, str] | None:
        got = self._get(LOCK)
        if got is None:
            return None
        try:
            body = json.loads(got[0])
            float(body["expires"])
        except (ValueError, KeyError, TypeError):
            body = {"owner": "?", "expires": 0.0}  # unreadable: treated as expired, so it can be taken over
        return body, got[1]

    def lock(self) -> WriterLock:
        self.prepare()
        lease = _Lease(self)
        lease.acquire()
        return lease

    def writer_running(self) -> bool:
        held = self._lease()
        return held is not None and float(held[0]["expires"]) > self.clock()

    def incoming_dir(self) -> Path:
        base = Path(os.environ.get("ROBUSTIR_CACHE", Path.home() / ".cache" / "robustir"))
        return base / "incoming" / hashlib.sha256(str(self.path).encode()).hexdigest()[:16]


class _Lease(WriterLock):
    """The writer lease of an :class:`S3Store` (see the module docstring)."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.etag: str | None = None
        self.expires = 0.0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _body(self) -> tuple[bytes, float]:
        expires = self.store.clock() + self.store.lease_ttl
        return json.dumps({"owner": self.owner, "expires": expires}).encode(), expires

    def acquire(self) -> None:
        import botocore.exceptions as bex

        store = self.store
        body, expires = self._body()
        try:
            reply = store._call("taking the writer lease", store.client.put_object, passthrough=_CONFLICT,
                                Bucket=store.bucket, Key=store.key(LOCK), Body=body, IfNoneMatch="*")
        except bex.ClientError as exc:
            if store._code(exc) not in _CONFLICT:
                raise
            held = store._lease()
            now = store.clock()
            if held is not None and float(held[0]["expires"]) > now:
                raise ConfigError(f"index {store.path} is being changed by another process ({held[0].get('owner')}, "
                                  f"its lease runs {float(held[0]['expires']) - now:.0f} s more): wait for it to "
                                  "finish, then run this again (a writer that died is taken over when its lease "
                                  "expires)") from None
            try:  # expired (its writer died or froze): taken over only if nobody renewed or took it meanwhile
                reply = store._call("taking over an expired writer lease", store.client.put_object,
                                    passthrough=_CONFLICT + _MISSING, Bucket=store.bucket, Key=store.key(LOCK),
                                    Body=body, **({"IfMatch": held[1]} if held is not None else {"IfNoneMatch": "*"}))
            except bex.ClientError as again:
                if store._code(again) not in _CONFLICT + _MISSING:
                    raise
                raise ConfigError(f"index {store.path} is being changed by another process (it took the writer "
                                  "lease a moment ago): wait for it to finish, then run this again") from None
            if held is not None:
                logger.warning("index %s: took over the writer lease of %s, which expired %.0f s ago (that writer "
                               "died or froze)", store.path, held[0].get("owner"), now - float(held[0]["expires"]))
        self.etag, self.expires = reply["ETag"], expires
        if store.heartbeat:
            self._thread = threading.Thread(target=self._beat, name="robustir-lease", daemon=True)
            self._thread.start()

    def renew(self) -> bool:
        """Extend the lease (If-Match on its ETag); False, and :attr:`lost` set, when another writer holds it now."""
        import botocore.exceptions as bex

        store = self.store
        with self._mutex:
            if self.lost is not None or self.etag is None:
                return False
            body, expires = self._body()
            try:
                reply = store._call("renewing the writer lease", store.client.put_object,
                                    passthrough=_CONFLICT + _MISSING, Bucket=store.bucket, Key=store.key(LOCK),
                                    Body=body, IfMatch=self.etag)
            except bex.ClientError as exc:
                if store._code(exc) not in _CONFLICT + _MISSING:
                    raise
                self.lost = "another process took it over after it expired"
                return False
            except ConfigError as exc:  # the store unreachable: kept until it expires, then check() stops the job
                logger.warning("index %s: could not renew the writer lease (%s)", store.path, exc)
                return False
            self.etag, self.expires = reply["ETag"], expires
            return True

    def _beat(self) -> None:
        while not self._stop.wait(self.store.lease_ttl / 3):
            self.renew()

    def check(self) -> None:
        if self.lost is None and self.store.clock() >= self.expires:
            self.lost = "it expired before it could be renewed"
        if self.lost is not None:
            raise ConfigError(f"index {self.store.path}: this process lost its writer lease ({self.lost}); it "
                              "stopped before its next commit. Re-run the command: the job resumes from its last "
                              "commit")

    def release(self) -> None:
        import botocore.exceptions as bex

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._mutex:
            if self.lost is None and self.etag is not None:
                try:  # only our own lease: If-Match on its ETag
                    self.store._call("releasing the writer lease", self.store.client.delete_object,
                                     passthrough=_CONFLICT + _MISSING, Bucket=self.store.bucket,
                                     Key=self.store.key(LOCK), IfMatch=self.etag)
                except (bex.ClientError, ConfigError) as exc:
                    logger.warning("index %s: the writer lease was not released (%s); it expires by itself",
                                   self.store.path, exc)
            self.etag = None
