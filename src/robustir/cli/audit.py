"""``robustir audit``: how noisy a training set is, which records are suspect, and which loss to train with.

    robustir audit --data train.jsonl --output audit/ [--model TEACHER] [--corpus ../shared/data/scifact]
                   [--eval-data ../shared/data/scifact]
    robustir audit --data ../shared/data/scifact --split train --eval-data ../shared/data/scifact --output audit/

Writes ``audit/report.md`` (read this), ``report.json``, ``audit.png`` and ``flagged.jsonl``; then
``robustir train --loss auto --audit audit/ ...`` trains with the recommended loss. Every option of
:class:`~robustir.audit.run.AuditConfig` is a flag, a ``--config`` key or a ``key=value`` override.
"""

from __future__ import annotations

from typing import Annotated

from ..audit.run import AuditConfig
from .common import CONFIG, ConfigFile, Overrides, stage_config


def command(*overrides: Overrides, config_file: ConfigFile = None,
            config: Annotated[AuditConfig | None, CONFIG] = None) -> int:
    """Measure a training set's noise (false positives / negatives, duplicates, leakage); pick the loss.

    Every field is a flag, a --config key or a trailing key=value override (random_passages=500).
    """
    return run(overrides, config_file)


def run(overrides=(), config_file: str | None = None) -> int:
    from ..audit.run import MARKDOWN, audit

    config = stage_config(AuditConfig, config_file, overrides)
    result = audit(config)
    report = result.report
    if result.already_complete:
        print(f"robustir audit: {result.output} already holds this audit (same settings and inputs): nothing to do "
              "(--overwrite redoes it)")
    print(f"false positives: {report['false_positives']['text']}")
    fn = report["false_negatives"]
    print(f"false negatives: {fn['flagged']} of {fn['negatives_checked']} negatives suspected, in "
          f"{fn['records_with_a_flag']} records")
    for kind in ("degenerate", "duplicates", "leakage"):
        if report.get(kind):
            print(f"{kind}: " + ", ".join(f"{reason} {n}" for reason, n in report[kind].items()))
    rec = report["recommendation"]
    print(f"recommendation: --loss {rec['loss']}: {rec['reason']}")
    for line in rec["also"] + rec["warnings"]:
        print(f"  - {line}")
    print(f"report: {result.output / MARKDOWN}")
    return 0
