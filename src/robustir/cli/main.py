"""``robustir <stage>``: one sub-command per pipeline stage, each a thin layer over the Python API.

Each stage lives in ``robustir/cli/<stage>.py`` as a function ``command(...)`` whose signature is its flags
(cyclopts builds them, with the stage config's fields: :mod:`robustir.cli.common`). Modules are imported only for
the command that runs, so ``robustir --help`` stays fast.
"""

from __future__ import annotations

import errno
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

#: older spellings, rewritten before parsing: flag -> the tokens it stands for
ALIASES: dict[str, tuple[str, ...]] = {
    "--bf16": ("--precision", "bf16"),
    "--no-bf16": ("--precision", "fp32"),
    "--fp32": ("--precision", "fp32"),
    "--no-mine": ("--mine", "none"),
}
VERBOSE = ("-v", "--verbose", "--debug")


def build_app():
    """The ``robustir`` application: every stage a lazily imported command (``robustir.cli.<module>:command``)."""
    from cyclopts import App, Parameter

    from .common import record_flags

    app = App(name="robustir", help="Train robust dense retrieval models: one sub-command per pipeline stage. "
                                    "-v / --verbose / --debug before the stage: debug logging and full tracebacks "
                                    "(for bug reports; also ROBUSTIR_DEBUG=1).",
              version_flags=[], help_format="rst", result_action="return_value", config=[record_flags],
              help_formatter=_help_formatter(),
              # a flag given twice: the last one counts (a script's flag overridden by one appended), as argparse did
              default_parameter=Parameter(consume_multiple=True, negative_iterable=(), allow_repeating=True))
    for order, (name, (module, help_text)) in enumerate(STAGES.items()):
        app.command(f"robustir.cli.{module}:command", name=name, help=help_text, sort_key=order)  # pipeline order
    return app


def _help_formatter():
    """cyclopts' help formatter, with the flag column of a parameter panel as wide as its longest flag name (plus
    the two spaces a continued line is indented by) where cyclopts' 35 % of the terminal is narrower, up to half the
    terminal: a name is never cut in two (``--no-gradient-checkpointin`` / ``g`` at 80 columns); the description
    column takes what is left. Command panels are cyclopts' own."""
    from attrs import define, evolve
    from cyclopts.help import DefaultFormatter
    from cyclopts.help.specs import NameRenderer, get_default_parameter_columns

    def columns(console, options, entries) -> tuple:
        longest = max((len(word) for entry in entries
                       for word in " ".join(entry.display_labels_with_metavar).split()), default=0)
        out = []
        for column in get_default_parameter_columns(console, options, entries):
            if isinstance(column.renderer, NameRenderer) and column.max_width is not None \
                    and column.max_width < longest + 2:
                width = min(longest + 2, max(column.max_width, console.width // 2))
                column = evolve(column, renderer=NameRenderer(max_width=width), max_width=width, min_width=width)
            out.append(column)
        return tuple(out)

    @define(kw_only=True)
    class WideNames(DefaultFormatter):
        def __call__(self, console, options, panel) -> None:
            if panel.format != "command" and self.column_specs is None:
                return evolve(self, column_specs=columns)(console, options, panel)
            return super().__call__(console, options, panel)

    return WideNames()


def parse(argv: list[str]):
    """``(command, bound arguments)`` for a command line, the flags layer recorded, without running the command (what
    the tests use to check that flags reach a config)."""
    argv, _, _ = _rewrite(list(argv))
    command, bound, _ = build_app().parse_args(argv, exit_on_error=False, print_error=False)
    return command, bound


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


def _rewrite(argv: list[str]) -> tuple[list[str], bool, str | None]:
    """``argv`` with the leading -v and the older spellings rewritten; whether -v was given; the stage."""
    verbose = False
    while argv and argv[0] in VERBOSE:
        verbose, argv = True, argv[1:]
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":  # the end of options: what follows is passed on as it is
            out += argv[i:]
            break
        out.extend(ALIASES.get(token) or (_bundled(token),))
    stage = out[0] if out and not out[0].startswith("-") else None
    if stage == "filter":  # robustir filter --method llm ...: the method is the sub-command (robustir filter llm)
        out = _method_first(out)
    return out, verbose, stage


def _method_first(argv: list[str]) -> list[str]:
    for i, token in enumerate(argv[1:], 1):
        if token == "--method" and i + 1 < len(argv):
            return [argv[0], argv[i + 1], *argv[1:i], *argv[i + 2:]]
        if token.startswith("--method="):
            return [argv[0], token.split("=", 1)[1], *argv[1:i], *argv[i + 1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    import cyclopts

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv, verbose, stage = _rewrite(argv)
    except RobustIRError as exc:
        print(f"robustir: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not verbose:  # libraries' per-file chatter (checkpoint writes, font cache) is noise at INFO
        for name in ("accelerate", "matplotlib", "httpx", "openai", "urllib3", "faiss", "bm25s"):
            logging.getLogger(name).setLevel(logging.WARNING)
    debug = verbose or os.environ.get("ROBUSTIR_DEBUG", "").lower() in ("1", "true", "yes")
    from ..hardware import configure_torch_threads

    configure_torch_threads()  # the CPUs this process may use (affinity, cgroup quota), not the host's core count
    label = f"robustir {stage}" if stage in STAGES else "robustir"
    try:
        result = build_app()(argv, exit_on_error=False, print_error=False)
    except cyclopts.CycloptsError as exc:
        if debug:
            raise
        print(f"{label}: error: {_cyclopts_message(exc, argv)}", file=sys.stderr)
        return 2
    except RobustIRError as exc:
        if debug:
            raise
        print(f"{label}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # about a path the user gave (a genuine bug, without a file name, keeps its traceback)
        message = path_error(exc)
        if debug or message is None:
            raise
        print(f"{label}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted; finished work is kept, re-run to resume", file=sys.stderr)
        return 130
    return int(result or 0) if isinstance(result, int) else 0


def _cyclopts_message(exc: Exception, argv: list[str]) -> str:
    """cyclopts' message on one line; for a flag of another filter method, which method takes it."""
    import cyclopts

    message = " ".join(str(exc).split())
    token = getattr(getattr(exc, "token", None), "value", None)
    if isinstance(exc, cyclopts.UnknownOptionError) and argv[:1] == ["filter"] and len(argv) > 1 and token:
        from .filter import CONFIGS, flag_owners

        flag = token.split("=", 1)[0]
        owners = [m for m in flag_owners(flag) if m != argv[1]]
        if owners and argv[1] in CONFIGS:
            return (f"--method {argv[1]} does not use {flag} (an option of --method {' / '.join(owners)}); remove it "
                    "or change --method")
    return message


_PATH_FIXES: dict[int, str] = {
    errno.EACCES: "check its permissions, or choose another location",
    errno.EPERM: "check its permissions, or choose another location",
    errno.EROFS: "the file system is read-only: choose another location",
    errno.ENOTDIR: "a part of this path is a file, not a folder: fix the path",
    errno.EISDIR: "this is a folder where a file is expected: name a file",
    errno.ENOENT: "check the path (and that its folder exists)",
    errno.EEXIST: "something is already there: remove it or choose another name",
    errno.ENOSPC: "the disk is full: free space or choose another location",
    errno.EFBIG: "a file-size limit (ulimit -f) or the file system's stopped the write: raise it or choose another "
                 "location (an interrupted index job resumes when run again)",
    errno.EDQUOT: "the disk quota is used up: free space or choose another location",
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
