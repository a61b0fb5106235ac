"""``robustir classify``: zero-shot (nearest class name) or few-shot (nearest prototype) text classification.

    robustir classify --model runs/gur/model --data test.jsonl --labels labels.txt --output runs/classify
    robustir classify --data test.jsonl --labels labels.json --descriptions descriptions.json --prompt "topic: "
    robustir classify --data test.jsonl --labels labels.txt --shots 8 --train train.jsonl --seed 1

``--data`` / ``--train``: JSONL of ``{"text": ..., "label": ...}``; ``--labels``: one class per line (or JSON).
Prints accuracy, macro-F1 and the confusion table; ``--output`` writes report.json, report.md, predictions.jsonl.
"""

from __future__ import annotations

from typing import Annotated

from ..evaluation.classify import ClassifyConfig, classify, confusion_markdown
from .common import CONFIG, ConfigFile, Model, Overrides, model_or_default, stage_config


def command(*overrides: Overrides, data: str, labels: str, model: Model = None, descriptions: str | None = None,
            train: str | None = None, output: str | None = None, config_file: ConfigFile = None,
            config: Annotated[ClassifyConfig | None, CONFIG] = None) -> int:
    """Zero-shot / few-shot classification by nearest label embedding (GUR).

    Parameters
    ----------
    data
        JSONL of {"text": ..., "label": ...} to classify
    labels
        the classes: a text file (one per line, name<TAB>description allowed) or JSON (a list of names, or
        {name: description})
    descriptions
        class descriptions: JSON {name: description} or name<TAB>description lines; a class is then embedded as
        'name: description'
    train
        labelled JSONL the few-shot prototypes are drawn from (with --shots)
    output
        folder for report.json, report.md and predictions.jsonl
    """
    config = build_config(overrides, config_file)
    result = classify(model_or_default(model), data, labels, config, descriptions=descriptions, train=train,
                      output=output)
    report = result.report
    mode = f"few-shot, {config.shots} per class" if config.shots else "zero-shot"
    print(f"{data}: {report['num_examples']} examples, {len(report['labels'])} classes ({mode}): "
          f"accuracy {100 * result.accuracy:.2f}, macro-F1 {100 * result.macro_f1:.2f} ({result.seconds:.1f} s)")
    print(confusion_markdown(report["confusion"]))
    if output:
        print(f"wrote {output}/report.json, report.md and predictions.jsonl")
    return 0


def build_config(overrides=(), config_file: str | None = None) -> ClassifyConfig:
    return stage_config(ClassifyConfig, config_file, overrides)
