"""``robustir <stage>``: one sub-command per pipeline stage, each a thin layer over the Python API.

Each stage lives in ``robustir/cli/<stage>.py`` and exposes ``register(subparsers)`` (adds its parser)
and ``run(args) -> int``. Modules are imported lazily so ``robustir --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import RobustIRError

# sub-command -> (module under robustir.cli, one-line help)
STAGES: dict[str, tuple[str, str]] = {
    "demo": ("demo", "evaluate the bundled model and BM25 on the bundled dataset"),
    "eval": ("evaluate", "evaluate a model (or bm25) on a BEIR folder"),
    "rerank-eval": ("rerank_eval", "MAP/MRR over given candidate lists (C-MTEB reranking style)"),
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
    "noise-bench": ("noise_bench", "planted-noise benchmark: each method's NDCG@10 against noise kind and rate"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="robustir", description="Train robust dense retrieval models: one sub-command per pipeline stage.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    try:
        return int(args._module.run(args) or 0)
    except RobustIRError as exc:
        if args.verbose:
            raise
        print(f"robustir {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"robustir {args.stage}: interrupted; finished work is kept, re-run to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
