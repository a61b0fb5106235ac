"""Cross-encoders: a sequence-classification model that scores a (query, passage) pair read together.

robustir uses one as a reranker (``robustir serve --rerank-model``: ``POST /v1/rerank``, ``/search`` with
``rerank: true``) and as a teacher (``robustir filter --method teacher``). :class:`CrossEncoder` loads it with
sentence-transformers' own ``CrossEncoder`` (its default activation: a sigmoid for a one-label model), so a score here
is ``sentence_transformers.CrossEncoder.predict``'s.

Folders it takes (:func:`resolve_cross_encoder`):

* the layout the installed sentence-transformers writes (``CrossEncoder.save`` from 6.0 on: ``modules.json`` with
  one ``Transformer`` module, ``config_sentence_transformers.json`` naming ``"model_type": "CrossEncoder"``,
  ``sentence_bert_config.json`` with ``"transformer_task": "sequence-classification"``);
* the older layout of sentence-transformers 3 to 5 and of ``save_pretrained``: ``config.json`` naming a
  ``...ForSequenceClassification`` architecture, the weights and the tokenizer, no ``modules.json``;
* hub-style folders: a snapshot folder of the Hugging Face cache (``.../models--org--name/snapshots/<commit>``), the
  cache's ``models--org--name`` folder itself (its ``refs/main`` snapshot, else its only one), and a hub id
  (``org/name``) found in the local cache (``local_files_only``) -- downloaded only when it is not there and
  ``HF_HUB_OFFLINE`` is unset.

A model with more than one label (an NLI or topic classifier) is refused: its first logit is not a relevance score.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["CrossEncoder", "is_cross_encoder", "resolve_cross_encoder", "cross_encoder_name"]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def is_cross_encoder(path: str | os.PathLike) -> bool:
    """Whether the model folder ``path`` holds a cross-encoder rather than an embedding model.

    A folder saved by sentence-transformers >= 6 says so itself (``config_sentence_transformers.json``:
    ``"model_type": "CrossEncoder"``, or ``sentence_bert_config.json``: ``"transformer_task":
    "sequence-classification"``); another folder with a ``modules.json`` is a sentence-transformers embedding model;
    without one (the layout of sentence-transformers 3 to 5 and of ``save_pretrained``), it is a cross-encoder when
    its ``config.json`` names a ``...ForSequenceClassification`` architecture."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    model_type = _json(path / "config_sentence_transformers.json").get("model_type")
    if model_type is not None:
        return model_type == "CrossEncoder"
    if _json(path / "sentence_bert_config.json").get("transformer_task") == "sequence-classification":
        return True
    if (path / "modules.json").exists():
        return False
    architectures = _json(path / "config.json").get("architectures") or []
    return isinstance(architectures, list) and any(str(a).endswith("ForSequenceClassification")
                                                   for a in architectures)


def _hub_cache_snapshot(folder: Path) -> Path | None:
    """The snapshot a Hugging Face cache folder ``models--org--name`` stands for: its ``refs/main`` commit, else its
    only snapshot; None for any other folder."""
    if not folder.name.startswith("models--") or not (folder / "snapshots").is_dir():
        return None
    ref = folder / "refs" / "main"
    if ref.is_file():
        snapshot = folder / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted(p for p in (folder / "snapshots").iterdir() if p.is_dir())
    if len(snapshots) == 1:
        return snapshots[0]
    raise ConfigError(f"{folder} is a Hugging Face cache folder with {len(snapshots)} snapshots and no refs/main: "
                      "pass the snapshot folder you mean (.../snapshots/<commit>)")


def cross_encoder_name(folder: str | os.PathLike, given: str | None = None) -> str:
    """The name a reranker answers to and reports: ``org/name`` for a hub id or a folder of the Hugging Face cache
    (``models--org--name/snapshots/<commit>``), else the folder's name."""
    path = Path(folder)
    for part in (path.parent.parent.name, path.name):  # a snapshot folder, or the models--org--name folder itself
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    if given and not Path(given).expanduser().exists():
        return given  # a hub id, as the user wrote it
    return path.name or str(folder)


def resolve_cross_encoder(name_or_path: str | os.PathLike, what: str = "rerank model") -> Path:
    """The local folder of the cross-encoder ``name_or_path`` (a folder in any layout of the module docstring, a hub
    cache folder, or a hub id), checked to hold a one-model cross-encoder; a clear :class:`ConfigError` otherwise."""
    from .encoder import check_model_folder, looks_local, resolve_model_path

    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        folder = check_model_folder(_hub_cache_snapshot(path) or path, what)
    elif path.exists() or looks_local(name):
        folder = resolve_model_path(name, what)  # the error for a file or a missing local path
    else:
        folder = _cached_hub_folder(name) or resolve_model_path(name, what)
    if not is_cross_encoder(folder):
        raise ConfigError(f"{what} {name} is not a cross-encoder: its config.json names no "
                          "...ForSequenceClassification architecture, or it is a sentence-transformers embedding "
                          "model (its modules.json has no sequence-classification Transformer). Give a cross-encoder "
                          "folder (e.g. one saved by sentence_transformers.CrossEncoder.save)")
    return folder


def _cached_hub_folder(repo_id: str) -> Path | None:
    """The hub id's snapshot in the local Hugging Face cache (no network), or None when it is not there."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception:  # not cached (or not a valid id): the caller tries the hub and names the problem
        return None


class CrossEncoder:
    """A one-label cross-encoder, loaded from a local folder by ``sentence_transformers.CrossEncoder``
    (``local_files_only``: nothing is downloaded here); :meth:`score` gives its relevance scores after the model's
    default activation (a sigmoid for one label), as ``CrossEncoder.predict`` does.

    ``name`` is what the model answers to in the server (:func:`cross_encoder_name`); ``what`` names it in errors
    (``--rerank-model``)."""

    def __init__(self, path: str | os.PathLike, batch_size: int = 32, max_length: int | None = None,
                 precision: str = "auto", device: str | None = "auto", name: str | None = None,
                 what: str = "cross-encoder") -> None:
        from sentence_transformers import CrossEncoder as STCrossEncoder

        from ..device import device_string, resolve_device
        from ..precision import precision_dtype, resolve_precision
        from .encoder import cannot_load, model_load_errors

        folder = resolve_cross_encoder(path, what)
        where = resolve_device(device)
        try:
            self.model = STCrossEncoder(str(folder), max_length=max_length, device=device_string(where),
                                        local_files_only=True)
        except model_load_errors() as exc:
            raise cannot_load(folder, exc, what) from None
        config = self.model.model.config
        labels = int(getattr(config, "num_labels", 1) or 1)
        if labels != 1:  # the score is one relevance logit: a classifier's first class is not relevance
            names = getattr(config, "id2label", None) or {}
            shown = ", ".join(str(names[k]) for k in sorted(names)) if names else f"{labels} classes"
            raise ConfigError(f"{path} is a classifier with {labels} labels ({shown}), not a relevance cross-encoder: "
                              "robustir scores a (query, passage) pair by the model's single relevance logit, and "
                              "the first of several classes is not one. Use a cross-encoder trained for relevance "
                              "with one label (num_labels 1 in its config.json), e.g. "
                              "cross-encoder/ms-marco-MiniLM-L-6-v2")
        resolved = resolve_precision(precision, where)
        if resolved != "fp32":
            self.model.model.to(dtype=precision_dtype(resolved))
        self.batch_size = batch_size
        self.folder = folder
        self.name = name or cross_encoder_name(folder, str(path))

    def score(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """Score each pair ``(queries[i], passages[i])``; higher = more relevant."""
        if not queries:
            return np.zeros(0, dtype=np.float32)
        scores = self.model.predict(list(zip(queries, passages)), batch_size=self.batch_size,
                                    show_progress_bar=False, convert_to_numpy=True)
        return np.asarray(scores, dtype=np.float32).reshape(len(queries), -1)[:, 0]
