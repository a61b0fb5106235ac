"""An index on S3 (``s3://bucket/prefix``, and S3-compatible stores -- MinIO, Ceph, R2 -- through an endpoint): the
:class:`~robustir.index.store.storage.IndexStore` of :mod:`robustir.index.store.storage` for an object store, and
its writer lease (see that module's docstring)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from ...errors import ConfigError, DataError
from .storage import _VERSIONS, LOCK, IndexStore, ObjectPath, WriterLock, _check_keys

logger = logging.getLogger(__name__)

__all__ = ["S3Store", "LEASE_TTL_S"]

#: seconds a writer's lease on an object-store index lasts without renewal (renewed every third of it)
LEASE_TTL_S = 60.0
_MISSING = ("NoSuchKey", "404", "NotFound")  # S3 error codes: the object is not there
_CONFLICT = ("PreconditionFailed", "412", "ConditionalRequestConflict")  # a conditional write lost


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
