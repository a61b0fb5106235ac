"""``robustir classify``: zero-shot (nearest class name) or few-shot (nearest prototype) text classification.

    robustir classify --model runs/gur/model --data test.jsonl --labels labels.txt --output runs/classify
    robustir classify --data test.jsonl --labels labels.json --descriptions descriptions.json --prompt "topic: "
    robustir classify --data test.jsonl --labels labels.txt --shots 8 --train train.jsonl --seed 1

``--data`` / ``--train``: JSONL of ``{"text": ..., "label": ...}``; ``--labels``: one class per line (or JSON).
Prints accuracy, macro-F1 and the confusion table; ``--output`` writes report.json, report.md, predictions.jsonl.
"""

from __future__ import annotations

import argparse

from ..config import load_config
from ..evaluation.classify import ClassifyConfig, classify, confusion_markdown
from .common import add_config_flags, add_precision_arg, flags_from_args, model_or_default

# ClassifyConfig fields with a flag (help from the dataclass)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder or Hugging Face hub id (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--data", required=True, help='JSONL of {"text": ..., "label": ...} to classify')
    parser.add_argument("--labels", required=True,
                        help="the classes: a text file (one per line, name<TAB>description allowed) or JSON (a list "
                             "of names, or {name: description})")
    parser.add_argument("--descriptions", default=None,
                        help="class descriptions: JSON {name: description} or name<TAB>description lines; a class is "
                             "then embedded as 'name: description'")
    parser.add_argument("--train", default=None, help="labelled JSONL the few-shot prototypes are drawn from "
                                                      "(with --shots)")
    parser.add_argument("--output", default=None, help="folder for report.json, report.md and predictions.jsonl")
    parser.add_argument("--config", default=None, help="YAML or JSON file with ClassifyConfig fields")
    keys = add_config_flags(parser, ClassifyConfig)
    add_precision_arg(parser, generated=True)
    parser.set_defaults(_flag_keys=keys)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=3")


def build_config(args: argparse.Namespace) -> ClassifyConfig:
    return load_config(ClassifyConfig, args.config, args.overrides, flags_from_args(args, args._flag_keys))


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    result = classify(model_or_default(args.model), args.data, args.labels, config, descriptions=args.descriptions,
                      train=args.train, output=args.output)
    report = result.report
    mode = f"few-shot, {config.shots} per class" if config.shots else "zero-shot"
    print(f"{args.data}: {report['num_examples']} examples, {len(report['labels'])} classes ({mode}): "
          f"accuracy {100 * result.accuracy:.2f}, macro-F1 {100 * result.macro_f1:.2f} ({result.seconds:.1f} s)")
    print(confusion_markdown(report["confusion"]))
    if args.output:
        print(f"wrote {args.output}/report.json, report.md and predictions.jsonl")
    return 0
