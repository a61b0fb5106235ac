"""Serving a trained retriever for retrieval-augmented generation.

* the index it serves is the index library's :class:`robustir.index.store.SearchIndex`: a persistent LanceDB index
  (vectors, BM25 full text, metadata) with a model-identity manifest, built in resumable chunks; add / delete /
  upsert while a server reads it; dense, lexical and hybrid search with JSON filters; integrity checks;
* :func:`create_app` (:mod:`robustir.serving.app`): the FastAPI app of ``robustir serve`` -- OpenAI-compatible
  ``POST /v1/embeddings``, ``POST /search`` over an index, ``GET /v1/models``, ``/info``, ``/health`` and ``/metrics``
  -- with pydantic request models (:mod:`~robustir.serving.schemas`), each request checked and tokenized before it
  joins a batch shared with others (:class:`MicroBatcher`: bounded queue, timeouts, failing batches re-run per
  request);
* :func:`running_server` (:mod:`robustir.serving.server`): run an app with uvicorn in a thread on 127.0.0.1 (tests,
  notebooks).

Loaded lazily, so ``import robustir.serving`` does not import FastAPI or LanceDB.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "create_app": "robustir.serving.app",
    "ServeConfig": "robustir.serving.config",
    "MicroBatcher": "robustir.serving.batcher",
    "running_server": "robustir.serving.server",
    "serve": "robustir.serving.server",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'robustir.serving' has no attribute {name!r}")
