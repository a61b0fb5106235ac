"""``robustir encode``: embed a corpus or a query file into ``.npy`` + ids (Tevatron-style hand-off)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import numpy as np

from ..data.beir import load_corpus, load_queries
from ..errors import ConfigError
from ..io import atomic_write
from ..models.encoder import Encoder
from ..outputs import refuse_overwriting_inputs
from .common import (CONFIG, Device, EncoderOverrides, Model, Precision, StorageOption, encoder_options,
                     model_or_default, storage_options)


def command(*, input: str, output: str, queries: bool = False, model: Model = None, batch_size: int = 64,
            precision: Precision = None, device: Device = None, engine: Literal["process", "ray"] = "process",
            ray_address: str | None = None, concurrency: int | None = None, max_concurrency: int | None = None,
            num_gpus: float | None = None, part_rows: int | None = None, batch_rows: int | None = None, num_cpus: float | None = None,
            max_retries: int | None = None, storage_option: StorageOption = (), overwrite: bool = False,
            encoder: Annotated[EncoderOverrides | None, CONFIG] = None) -> int:
    """Encode a corpus or queries into an embedding file.

    Parameters
    ----------
    input
        corpus.jsonl (passages) or queries.jsonl (with --queries)
    output
        output prefix: writes PREFIX.npy and PREFIX.ids.json (PREFIX.npy given: the same); with --engine ray a Lance
        dataset NAME.lance (a path, made absolute: every Ray node must see it; or s3://bucket/prefix/NAME.lance)
    queries
        encode as queries (query instruction, query length)
    batch_size
        encoding batch size
    engine
        process: this process; ray: Ray Data actors writing a Lance dataset, resumable by part (needs
        robustir[scale]; docs/scale.md)
    ray_address
        --engine ray: the Ray cluster to join (e.g. ray://head:10001, auto); default: a local Ray session
    concurrency
        --engine ray: encoder actors (default: 1); with --max-concurrency, the fewest
    max_concurrency
        --engine ray: autoscaling: Ray Data adds encoder actors up to this many while batches wait (default: exactly
        --concurrency)
    num_gpus
        --engine ray: GPUs per actor (default: 0, CPU actors)
    part_rows
        --engine ray: rows per Lance commit (default: 100000; may change on resume)
    batch_rows
        --engine ray: rows per batch handed to an encoder actor (default: 2048)
    num_cpus
        --engine ray: CPUs per actor (default: 1)
    max_retries
        --engine ray: retries of a batch whose actor died before the job stops naming it (default: 3)
    overwrite
        --engine ray: encode again over an earlier output
    """
    ray = {"ray_address": ray_address, "concurrency": concurrency, "max_concurrency": max_concurrency,
           "num_gpus": num_gpus, "part_rows": part_rows,
           "batch_rows": batch_rows, "num_cpus": num_cpus, "max_retries": max_retries,
           "storage_option": storage_option, "overwrite": overwrite}
    if engine == "ray":
        return _run_ray(input, output, queries, model, batch_size, precision, device, **ray)
    ray_only = [f"--{name.replace('_', '-')}" for name, value in ray.items() if value]
    if ray_only:
        raise ConfigError(f"{', '.join(ray_only)} go with --engine ray")
    if not output.strip() or Path(output).name in ("", ".", "..") or Path(output).is_dir():
        raise ConfigError(f"--output {output!r} is a prefix of two files (PREFIX.npy, PREFIX.ids.json), not a "
                          f"folder: add a name, e.g. {Path(output) / 'corpus'}")
    vectors, id_file = output_files(output)
    refuse_overwriting_inputs(vectors, input, stage="encode")
    refuse_overwriting_inputs(id_file, input, stage="encode")
    loaded = Encoder.from_pretrained(model_or_default(model), device=device or "auto", **encoder_options())
    if queries:
        texts_by_id, _ = load_queries(input)
        ids, texts, kind = list(texts_by_id), list(texts_by_id.values()), "query"
    else:
        corpus, _ = load_corpus(input)
        ids, texts, kind = corpus.ids, corpus.texts_for_encoding(), "passage"
    emb = loaded.encode(texts, kind, batch_size=batch_size, precision=precision or "auto", show_progress=True)
    with atomic_write(vectors, "wb") as handle:
        np.save(handle, emb)
    with atomic_write(id_file) as handle:
        json.dump(ids, handle)
    print(f"encoded {len(ids)} {kind}s -> {vectors} {emb.shape}")
    return 0


def output_files(prefix: str | Path) -> tuple[Path, Path]:
    """``PREFIX.npy`` and ``PREFIX.ids.json``: the suffixes are added, never substituted (``emb.corpus`` and
    ``emb.queries`` are two outputs); a prefix given as ``X.npy`` means ``X``."""
    name = str(prefix)
    name = name[:-len(".npy")] if name.endswith(".npy") else name
    return Path(name + ".npy"), Path(name + ".ids.json")


def _run_ray(input: str, output: str, queries: bool, model: str | None, batch_size: int, precision: str | None,
             device: str | None, *, ray_address: str | None, concurrency: int | None,
             max_concurrency: int | None, num_gpus: float | None,
             part_rows: int | None, batch_rows: int | None, num_cpus: float | None, max_retries: int | None,
             storage_option: tuple[str, ...], overwrite: bool) -> int:
    from ..scale.ray_encode import RayEncodeConfig, encode_with_ray, require_scale_extra

    require_scale_extra("--engine ray")
    if "://" not in output:
        refuse_overwriting_inputs(Path(output), input, stage="encode")
    given = {"concurrency": concurrency, "max_concurrency": max_concurrency, "num_gpus": num_gpus, "part_rows": part_rows, "address": ray_address,
             "batch_size": batch_size, "precision": precision, "batch_rows": batch_rows, "num_cpus": num_cpus,
             "max_retries": max_retries}
    config = RayEncodeConfig(**{k: v for k, v in given.items() if v is not None})
    report = encode_with_ray(input, model_or_default(model), output, kind="query" if queries else "passage",
                             config=config, encoder_options=encoder_options(), overwrite=overwrite,
                             device=None if device in (None, "auto") else device,
                             storage_options=storage_options(storage_option))
    print(f"robustir encode (ray): {output}: {report.format()}")
    return 0
