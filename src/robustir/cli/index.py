"""``robustir index``: encode a corpus into a persistent LanceDB search index and maintain it while it is served.

Examples::

    robustir index --model runs/peg/model --corpus corpus.jsonl --output runs/index            # build (resumable)
    robustir index --corpus passages.txt --output runs/index --ann auto                         # ANN from 100k docs
    robustir index --add more.jsonl --output runs/index                                         # add documents
    robustir index --upsert changed.jsonl --output runs/index                                   # insert or replace
    robustir index --delete-id doc17 --delete-id doc18 --output runs/index                      # delete by id
    robustir index --delete ids.txt --output runs/index                                         # ids, one per line
    robustir index --compact --output runs/index                                                # merge small files
    robustir index --check --output runs/index                                                  # verify, summarise
    robustir index --corpus corpus.jsonl --output s3://bucket/indexes/docs                      # on S3 (AWS_* env)

A killed build, add or upsert resumes when the same command is run again (at most one chunk of ``--chunk-size``
documents is encoded twice). A server (``robustir serve --index runs/index``) sees every change on its next query.
"""

from __future__ import annotations

from typing import Annotated, Any

from cyclopts import Parameter

from ..errors import ConfigError
from ..index.store import IndexConfig, SearchIndex, read_id_list
from .common import (CONFIG, EncoderOverrides, Model, StorageOption, encoder_options, given, given_flags,
                     model_or_default, stage_config, storage_options)

ACTIONS = ("--corpus (build), --add, --upsert, --delete/--delete-id, --compact, --check, --discard-unfinished")


def command(*, output: str, corpus: str | None = None, add: str | None = None, upsert: str | None = None,
            delete: str | None = None, delete_id: Annotated[tuple[str, ...], Parameter(consume_multiple=False)] = (),
            compact: bool = False, check: bool = False,
            discard_unfinished: bool = False, overwrite: bool = False, storage_option: StorageOption = (),
            model: Model = None, encoder: Annotated[EncoderOverrides | None, CONFIG] = None,
            config: Annotated[IndexConfig | None, CONFIG] = None) -> int:
    """Encode a corpus into a persistent search index (LanceDB: vectors, full text, metadata); add, upsert and
    delete documents. What to do, one of: --corpus, --add, --upsert, --delete / --delete-id, --compact, --check,
    --discard-unfinished.

    Parameters
    ----------
    output
        the index folder, or s3://bucket/prefix (an S3 or S3-compatible object store; docs/scale.md)
    corpus
        build: documents to index (BEIR folder or corpus.jsonl, passages JSONL, or plain text with one passage per
        line; .gz too)
    add
        add the documents of this corpus (an id already in the index is an error)
    upsert
        insert the documents of this corpus, replacing those whose id is in the index
    delete
        delete the documents whose ids are listed in this file (one per line)
    delete_id
        delete this document (repeatable)
    compact
        merge small data files, fold deletions and new rows into the full-text index, drop old versions
    check
        verify the index (every data file's size and SHA-256 -- on S3 its ETag --, the count) and print a summary;
        repairs nothing
    discard_unfinished
        drop what an interrupted --add / --upsert wrote instead of finishing it (an upsert's replaced documents
        come back)
    overwrite
        with --corpus: rebuild from scratch, beside the index: readers (a running server) keep the old index until
        the new one is complete, then follow it; a killed rebuild resumes when run again
    """
    deleting = bool(delete or delete_id)
    chosen = [name for name, given in (("--corpus", corpus), ("--add", add), ("--upsert", upsert),
                                       ("--delete", deleting), ("--compact", compact), ("--check", check),
                                       ("--discard-unfinished", discard_unfinished)) if given]
    if len(chosen) != 1:
        raise ConfigError(("give one of " if not chosen else f"{' and '.join(chosen)} cannot go together; give one of ")
                          + ACTIONS)
    if overwrite and not corpus:
        raise ConfigError("--overwrite goes with --corpus (a rebuild)")
    config = stage_config(IndexConfig)
    storage = storage_options(storage_option)
    if not corpus:
        fixed = [flag for path, flag in given_flags().items() if path.startswith("ann.")]
        fixed += [f"--{k.replace('_', '-')}" for k, v in encoder_options().items() if v is not None]
        if fixed:
            raise ConfigError(f"{', '.join(fixed)} can only be set when the index is built (--corpus); the index "
                              "keeps its own")
    if corpus:
        from ..runs import Job, execute
        from ..index.store.step import INDEX

        job = Job(output, {"corpus": corpus, "model": model_or_default(model)},
                  settings={"encoder": encoder_options()},
                  runtime={"storage_options": storage, "encoder_pool": ray_pool})
        report = execute(INDEX, config, job, overwrite=overwrite, say=None).report
        print(f"robustir index: {output} is complete; nothing to do (--add / --upsert to add documents, "
              "--overwrite to rebuild)" if report.nothing_to_do else f"robustir index: {report.format()}")
        print(report.summary)
        return 0
    if check:
        with SearchIndex.open(output, model=model or None, device=given().get("device"),
                              storage_options=storage) as index:
            print(f"robustir index: checked {index.check()}")
            print(index.summary())
        return 0
    with SearchIndex.open(output, writable=True, model=model or None, device=given().get("device"),
                          storage_options=storage, encoder_pool=ray_pool) as index:
        if add:
            report = index.add(add, config=config)
        elif upsert:
            report = index.upsert(upsert, config=config)
        elif deleting:
            ids = list(delete_id)
            if delete:
                ids += read_id_list(delete)
            report = index.delete(ids)
        elif compact:
            report = index.compact()
        else:
            job = index.manifest.get("job")
            dropped = index.discard_unfinished()
            back = "; the documents it replaced are back" if job and job["kind"] == "upsert" else ""
            print(f"robustir index: discarded the unfinished {job['kind']} of {job['input']} ({dropped} documents "
                  f"fewer{back})" if job else "robustir index: no unfinished job; nothing to do")
            report = None
        if report is not None:
            print(f"robustir index: {report.format()}")
        print(index.summary())
    return 0


def ray_pool(encoder: Any, config: IndexConfig) -> Any:
    """The encoder pool of ``--engine ray`` (:class:`robustir.scale.ray_encode.RayEncoderPool`), given to the index
    (:data:`robustir.index.store.config.EncoderPoolFactory`), which imports no engine itself."""
    from ..scale.ray_encode import RayEncoderPool

    return RayEncoderPool(encoder, actors=config.ray_actors, num_gpus=config.ray_gpus, address=config.ray_address)
