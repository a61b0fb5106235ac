"""``robustir <stage>``: one sub-command per pipeline stage, each a thin layer over the Python API.

Each stage lives in ``robustir/cli/<stage>.py`` and exposes ``register(subparsers)`` (adds its parser)
and ``run(args) -> int``. Modules are imported lazily so ``robustir --help`` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import re
import sys

from ..errors import RobustIRError

# sub-command -> (module under robustir.cli, one-line help)
STAGES: dict[str, tuple[str, str]] = {
    "demo": ("demo", "evaluate the bundled model and BM25 on the bundled dataset"),
    "eval": ("evaluate", "evaluate a model (or bm25) on a BEIR folder"),
    "rerank-eval": ("rerank_eval", "MAP/MRR over given candidate lists (C-MTEB reranking style)"),
    "classify": ("classify", "zero-shot / few-shot classification by nearest label embedding (GUR)"),
    "encode": ("encode", "encode a corpus or queries into an embedding file"),
    "chunk": ("chunk", "split raw documents into passages"),
    "generate": ("generate", "generate queries for passages with an LLM"),
    "pairs": ("pairs", "mine (sentence, sentence) pairs by longest common substring (GUR)"),
    "mine": ("mine", "mine hard negatives with BM25 or a dense model"),
    "filter": ("filter", "remove false negatives (llm judge, teacher margin, passage sieve)"),
    "merge": ("merge", "merge the shards of a stage after checking they are all complete"),
    "train": ("train", "contrastive fine-tuning (InfoNCE, PEG, CCR)"),
    "pretrain": ("pretrain", "retrieval-oriented pre-training (RetroMAE, GUR)"),
    "run": ("pipeline", "the whole pipeline from one config"),
    "audit": ("audit", "measure a training set's noise (false positives / negatives, duplicates, leakage); pick the loss"),
    "noise-bench": ("noise_bench", "planted-noise benchmark: each method's NDCG@10 against noise kind and rate"),
    "index": ("index", "encode a corpus into a persistent search index (LanceDB: vectors, full text, metadata), add, upsert and delete documents"),
    "serve": ("serve", "OpenAI-compatible embeddings and search server (FastAPI)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="robustir", description="Train robust dense retrieval models: one sub-command per pipeline stage.")
    parser.add_argument("-v", "--verbose", "--debug", action="store_true",
                        help="debug logging and full tracebacks (for bug reports; also ROBUSTIR_DEBUG=1)")
    sub = parser.add_subparsers(dest="stage", metavar="<stage>")
    for name, (module, help_text) in STAGES.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            mod = importlib.import_module(f"robustir.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"robustir.cli.{module}":
                raise
            continue  # stage not available in this build
        stage_parser = sub.add_parser(name, help=help_text, description=help_text)
        mod.register(stage_parser)
        stage_parser.set_defaults(_module=mod)
    return parser


_BUNDLED = re.compile(r"^(?P<head>(?:--?[\w-]+=|[\w.]+=)?)bundled:(?P<name>[\w.-]+)$")


def _bundled(token: str) -> str:
    """``bundled:NAME`` as a whole argument, a ``--flag=`` value or a ``key=`` override value: the bundled data set's
    folder (``bundled:scifact``), so every command takes it where it takes a path (as ``robustir run`` and
    ``pretrain`` configs do)."""
    match = _BUNDLED.match(token)
    if match is None:
        return token
    from ..resources import dataset_path

    return match["head"] + str(dataset_path(match["name"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = [_bundled(a) for a in argv]
    except RobustIRError as exc:
        print(f"robustir: error: {exc}", file=sys.stderr)
        return 2
    stage = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=stage if stage in STAGES else None)
    args, extra = parser.parse_known_args(argv)
    # ``key=value`` overrides may follow options (``run cfg.yaml --until filter lr=1``), which argparse alone
    # cannot place once the positional list has been consumed: hand them to the stage's overrides.
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in item and not item.startswith("-") for item in extra):
        args.overrides.extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:  # libraries' per-file chatter (checkpoint writes, font cache) is noise at INFO
        for name in ("accelerate", "matplotlib", "httpx", "openai", "urllib3", "faiss", "bm25s"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0 if args.stage is None else 2
    debug = args.verbose or os.environ.get("ROBUSTIR_DEBUG", "").lower() in ("1", "true", "yes")
    from ..hardware import configure_torch_threads

    configure_torch_threads()  # the CPUs this process may use (affinity, cgroup quota), not the host's core count
    try:
        return int(args._module.run(args) or 0)
    except RobustIRError as exc:
        if debug:
            raise
        print(f"robustir {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # about a path the user gave (a genuine bug, without a file name, keeps its traceback)
        message = path_error(exc)
        if debug or message is None:
            raise
        print(f"robustir {args.stage}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"robustir {args.stage}: interrupted; finished work is kept, re-run to resume", file=sys.stderr)
        return 130


_PATH_FIXES: dict[int, str] = {
    errno.EACCES: "check its permissions, or choose another location",
    errno.EPERM: "check its permissions, or choose another location",
    errno.EROFS: "the file system is read-only: choose another location",
    errno.ENOTDIR: "a part of this path is a file, not a folder: fix the path",
    errno.EISDIR: "this is a folder where a file is expected: name a file",
    errno.ENOENT: "check the path (and that its folder exists)",
    errno.EEXIST: "something is already there: remove it or choose another name",
    errno.ENOSPC: "the disk is full: free space or choose another location",
    errno.ENAMETOOLONG: "the name is too long: choose a shorter path",
    errno.ENOTEMPTY: "the folder is not empty: remove it or choose another name",
}


def path_error(exc: OSError) -> str | None:
    """A one-line message for an OS error about a named path (``None``: not about a path -- a bug to report)."""
    if exc.filename is None or exc.errno not in _PATH_FIXES:
        return None
    target = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
    fix = _PATH_FIXES[exc.errno]
    if exc.errno == errno.EEXIST and os.path.isfile(exc.filename):  # a folder was to be made where a file is
        fix = "this is a file, but the path needs a folder here: fix the path"
    return f"{target}: {exc.strerror or type(exc).__name__}; {fix}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
