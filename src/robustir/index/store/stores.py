"""Which store a location names (:func:`open_store`): a local folder (:class:`~.storage.LocalStore`) or
``s3://bucket/prefix`` (:class:`~.s3.S3Store`). Its own module because it names both kinds and ``s3`` builds on
``storage``: kept in ``storage``, the two imported each other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from ...errors import ConfigError
from .s3 import S3Store
from .storage import IndexStore, LocalStore, is_remote

__all__ = ["open_store"]


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
