"""``robustir index``: encode a corpus into a persistent search index (FAISS + sqlite + manifest) and maintain it.

Examples::

    robustir index --model runs/peg/model --corpus corpus.jsonl --output runs/index            # build (resumable)
    robustir index --corpus passages.txt --output runs/index --index hnsw                       # plain text, HNSW
    robustir index --add more.jsonl --output runs/index                                         # add documents
    robustir index --delete-id doc17 --delete-id doc18 --output runs/index                      # delete by id
    robustir index --delete ids.txt --output runs/index                                         # ids, one per line
    robustir index --check --output runs/index                                                  # verify, summarise

A killed build or add resumes when the same command is run again (at most one chunk of ``--chunk-size`` documents
is encoded twice). Serve the index with ``robustir serve --index runs/index``.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..serving.index import IndexConfig, SearchIndex, read_id_list
from .common import (add_config_flags, add_encoder_args, config_from_flags, encoder_options,
                     model_or_default)

# IndexConfig fields with a flag (help from the dataclass); --batch-size, --precision (--bf16) and --device
# are the shared encoder flags


def register(parser: argparse.ArgumentParser) -> None:
    action = parser.add_argument_group("what to do (one of)")
    action.add_argument("--corpus", help="build: documents to index (BEIR folder or corpus.jsonl, passages JSONL, or "
                                         "plain text with one passage per line; .gz too)")
    action.add_argument("--add", metavar="CORPUS", help="add the documents of CORPUS to an existing index")
    action.add_argument("--delete", metavar="IDS_FILE", help="delete the documents whose ids are listed in this file "
                                                              "(one per line)")
    action.add_argument("--delete-id", metavar="ID", action="append", help="delete this document (repeatable)")
    action.add_argument("--compact", action="store_true", help="HNSW: rebuild the graph without deleted documents")
    action.add_argument("--check", action="store_true", help="verify the index (checksums, counts), finish an "
                                                             "interrupted save, and print a summary")
    action.add_argument("--discard-unfinished", action="store_true",
                        help="drop the documents of an interrupted --add instead of finishing it")
    parser.add_argument("--output", required=True, help="the index folder")
    parser.add_argument("--overwrite", action="store_true", help="with --corpus: rebuild from scratch")
    keys = add_config_flags(parser, IndexConfig)
    parser.set_defaults(_flag_keys=keys)
    add_encoder_args(parser)


def index_config(args: argparse.Namespace) -> IndexConfig:
    return config_from_flags(IndexConfig, args)


def run(args: argparse.Namespace) -> int:
    deleting = bool(args.delete or args.delete_id)
    chosen = [name for name, given in (("--corpus", args.corpus), ("--add", args.add), ("--delete", deleting),
                                       ("--compact", args.compact), ("--check", args.check),
                                       ("--discard-unfinished", args.discard_unfinished)) if given]
    if len(chosen) != 1:
        raise ConfigError(("give one of " if not chosen else f"{' and '.join(chosen)} cannot go together; give one of ")
                          + "--corpus (build), --add, --delete/--delete-id, --compact, --check, --discard-unfinished")
    if args.overwrite and not args.corpus:
        raise ConfigError("--overwrite goes with --corpus (a rebuild)")
    config = index_config(args)
    given_options = {k: v for k, v in encoder_options(args).items() if v is not None}
    if not args.corpus:
        fixed = [f"--{dest.replace('_', '-')}" for dest, key in args._flag_keys.items()
                 if key.startswith("index.") and getattr(args, dest, None) is not None]
        fixed += [f"--{k.replace('_', '-')}" for k in given_options]
        if fixed:
            raise ConfigError(f"{', '.join(fixed)} can only be set when the index is built (--corpus); the index "
                              "keeps its own")
    if args.corpus:
        index, report = SearchIndex.build(args.output, model_or_default(args.model), args.corpus, config=config,
                                          encoder_options=encoder_options(args), overwrite=args.overwrite)
        with index:
            print(f"robustir index: {args.output} is complete; nothing to do (--add to add documents, --overwrite to "
                  "rebuild)" if report.nothing_to_do else f"robustir index: {report.format()}")
            print(index.summary())
        return 0
    with SearchIndex.open(args.output, writable=True, model=args.model or None, device=args.device) as index:
        if args.add:
            from dataclasses import replace

            from ..index.dense import DenseIndexConfig

            report = index.add(args.add, config=replace(config, index=DenseIndexConfig(kind=index.kind)))
        elif deleting:
            ids = list(args.delete_id or [])
            if args.delete:
                ids += read_id_list(args.delete)
            report = index.delete(ids)
        elif args.compact:
            report = index.compact()
        elif args.discard_unfinished:
            dropped = index.discard_unfinished()
            print(f"robustir index: dropped {dropped} documents of an unfinished job" if dropped else
                  "robustir index: no unfinished job; nothing to do")
            report = None
        else:
            report = None
        if report is not None:
            print(f"robustir index: {report.format()}")
        print(index.summary())
    if args.check or args.discard_unfinished:
        with SearchIndex.open(args.output):  # the full read-only check a server does
            print("robustir index: checked (checksums, counts, dimension)")
    return 0
