"""Which recipe to train with, from the audit's estimate and the planted-noise benchmark's measured tables.

The rule (docs/audit.md; numbers from docs/robustness.md, SciFact, bundled MiniLM, 3 seeds): random false
positives are the noise that hurts, and the longer a model trains the more it memorises them -- at the GPU preset
(5 epochs) InfoNCE loses 4.81 NDCG@10 at 40 % and PEG alone 2.89. robustir's recipe for noisy data (``loss: peg``
with ``filter_positives: true``: the starting model drops the positives that look random to it, PEG trains on the
rest for the step budget of the data as given) loses 0.85 there and nothing on clean data (71.99 vs 72.01).

* per noise kind (issue 50): *random-like* false positives at 5 % or more (or the interval's top at 10 % or more):
  the recipe (``peg`` + ``filter_positives``), with the measured losses of InfoNCE and the recipe at that rate on the
  CPU proxy (``cpu-long``, linearly interpolated between the measured rates) in the reason;
* only *hard-like / near-miss* false positives (a positive replaced by a passage close to the right one): ``infonce``
  -- no loss protected against them at the GPU preset (40 %: InfoNCE -2.17, PEG -2.12, the recipe about -1.9 on BM25
  near misses; InfoNCE -2.55, PEG -2.97, the recipe -3.31 on dense ones), the recipe's filter does not catch them,
  and the plain loss lost least on the dense ones; the reason says so and points to the LLM judge of positives
  (``robustir filter llm --judge-positives``), which corrects such labels instead;
* under 5 % with the interval's top under 10 %: ``infonce`` (nothing to protect against; the simplest loss) -- and
  when the teacher cannot read near misses (:func:`robustir.audit.estimate.near_miss_reading`), the reason says their
  share is unknown, never that the data is clean;
* in addition, when at least 20 % of the records have a suspected false negative: run the teacher filter on the
  negatives first (``robustir filter --method teacher``; its recall on planted label false negatives was 0.88);
* leakage, duplicates and degenerate records are listed as warnings with what to do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["recommend", "loss_from_audit", "MEASURED", "GPU_AT_40", "CLEAN_RATE", "CLEAN_HIGH",
           "FALSE_NEGATIVE_SHARE"]

#: NDCG@10 lost on SciFact at each planted random false-positive rate: the cpu-long proxy, 3 seeds, on the 2-core
#: box (docs/robustness.md); "robust" is the recipe (peg + filter_positives); InfoNCE at 20 % from the same preset
#: run on the H200
MEASURED = {"rates": [0.0, 0.2, 0.4], "infonce": [0.0, 1.84, 4.71], "robust": [0.0, 0.09, 0.30]}
#: the same at the GPU preset and 40 % (H200, 3 seeds), quoted in the reason
GPU_AT_40 = {"infonce": 4.81, "robust": 0.85}
#: NDCG@10 lost at 40 % near-miss false positives at the GPU preset (docs/robustness.md; dense: issue 50's held-out split)
NEAR_MISS_AT_40 = {"bm25": {"infonce": 2.17, "peg": 2.12, "robust": 1.9}, "dense": {"infonce": 2.55, "peg": 2.97,
                                                                                     "robust": 3.31}}
JUDGE_POSITIVES = ("ask an LLM judge about the positives, which corrects such labels instead of training on them: "
                   "`robustir filter llm --judge-positives --input {data} --output judged.jsonl --base-url URL "
                   "--model NAME`, then train on judged.jsonl")
CLEAN_RATE, CLEAN_HIGH = 0.05, 0.10
FALSE_NEGATIVE_SHARE = 0.20


def measured_loss(method: str, rate: float) -> float:
    """NDCG@10 points the benchmark measured ``method`` losing at this false-positive rate (interpolated; beyond
    40 % extrapolated from the last segment)."""
    rates, losses = MEASURED["rates"], MEASURED[method]
    if rate <= rates[-1]:
        return float(np.interp(rate, rates, losses))
    slope = (losses[-1] - losses[-2]) / (rates[-1] - rates[-2])
    return float(losses[-1] + slope * (rate - rates[-1]))


def recommend(report: dict) -> dict[str, Any]:
    """The recipe for an audit report (``report.json``'s content): loss, options, the command and config line,
    the reason, and warnings."""
    estimate = report["false_positives"]["estimate"]
    near = report["false_positives"].get("near_miss") or {}
    data = report.get("data") or "DATA"
    rate, low, high = (estimate.get(k) for k in ("rate", "low", "high"))
    known = _finite(rate)
    bound = " (an upper bound: no clean reference was given)" if estimate.get("upper_bound") else ""
    unreadable = near.get("readable") is False  # the teacher cannot tell near misses from true positives
    if known:
        said = f"estimated {100 * rate:.0f} % ± {100 * max(rate - low, high - rate):.0f} false positives{bound}"
        if estimate.get("hard_like") is None:
            said += (" (random-like only: hard false positives were not measured, "
                     + ("the records have no negatives)" if not estimate.get("hard_nulls") else
                        "the teacher scores hard nulls like trusted positives)"))
        if unreadable:
            said += f"; {near['why']}"
    else:
        said = "the false-positive rate could not be estimated"
    random_part, hard_part = _part(estimate, "random_like", rate, high), _part(estimate, "hard_like", None, None)
    also: list[str] = []
    if known and not _noisy(*random_part) and _noisy(*hard_part):
        loss = "infonce"
        at = NEAR_MISS_AT_40
        reason = (f"{said}, and what there may be is hard-like (a passage close to the right one given as the "
                  "positive): no loss protected "
                  f"against those at the GPU preset (40 %: InfoNCE -{at['bm25']['infonce']:.2f}, PEG "
                  f"-{at['bm25']['peg']:.2f}, the recipe for noisy data about -{at['bm25']['robust']:.1f} on BM25 near "
                  f"misses; InfoNCE -{at['dense']['infonce']:.2f}, PEG -{at['dense']['peg']:.2f}, the recipe "
                  f"-{at['dense']['robust']:.2f} on dense ones) and the recipe's filter does not catch them, so train "
                  "with the plain loss and fix the labels")
        also.append(JUDGE_POSITIVES.format(data=data))
    elif known and rate < CLEAN_RATE and high < CLEAN_HIGH:
        loss = "infonce"
        reason = (f"{said}: the benchmark measured nothing to gain on clean data (the recipe for noisy data, PEG + "
                  "filter_positives: 71.99 vs InfoNCE 72.01 NDCG@10 at the GPU preset), so the plain loss is enough"
                  + (f"; if near misses are likely (LLM-written queries, clicks, weak labels), the plain loss is also "
                     f"the one that lost least to them at the GPU preset (InfoNCE -{NEAR_MISS_AT_40['dense']['infonce']:.2f}"
                     f" at 40 % dense near misses, the recipe -{NEAR_MISS_AT_40['dense']['robust']:.2f})"
                     if unreadable else ""))
        if unreadable:
            also.append("near-miss false positives are not measured by this teacher: to find them, "
                        + JUDGE_POSITIVES.format(data=data))
    else:
        loss = "peg"
        recipe = "PEG with filter_positives (the starting model drops the positives that look random to it)"
        if known:
            at = min(rate, 0.6)
            reason = (f"{said}: train with {recipe}. At this rate the planted-noise benchmark measured InfoNCE losing "
                      f"{measured_loss('infonce', at):.2f} NDCG@10 and the recipe {measured_loss('robust', at):.2f} "
                      f"(CPU proxy; at the GPU preset and 40 %: {GPU_AT_40['infonce']:.2f} vs "
                      f"{GPU_AT_40['robust']:.2f}); it costs nothing on clean data. False positives that look right "
                      "(a lexical neighbour) are not caught by it: every method lost about 2 points at 40 % of those")
        else:
            reason = f"{said}; train with {recipe}: it costs nothing on clean data and protects against false positives"
    fn = report.get("false_negatives") or {}
    if fn.get("share_of_records", 0) >= FALSE_NEGATIVE_SHARE:
        also.append(f"{100 * fn['share_of_records']:.0f} % of the records have a suspected false negative: remove "
                    f"them first with `robustir filter --method teacher --input {data} --output clean.jsonl` "
                    "(negatives only; on planted label false negatives it found 88 %), then train on clean.jsonl. "
                    "The benchmark measured false negatives costing under 1 point, so this is optional")
    warnings: list[str] = []
    leak = report.get("leakage") or {}
    if leak.get("query_in_eval") or leak.get("near_query_in_eval"):
        warnings.append(f"{leak.get('query_in_eval', 0) + leak.get('near_query_in_eval', 0)} training queries are "
                        "(near-)copies of evaluation queries: remove them (listed in flagged.jsonl, kind leakage) or "
                        "the evaluation overstates the model")
    if leak.get("positive_in_eval"):
        warnings.append(f"{leak['positive_in_eval']} training positives are relevant documents of the evaluation "
                        "split: expected when both share a corpus (BEIR), leakage when the evaluation corpus should "
                        "be unseen")
    dup = report.get("duplicates") or {}
    if dup.get("duplicate_record"):
        warnings.append(f"{dup['duplicate_record']} records repeat an earlier one: they weigh that pair twice; "
                        "deduplicate (flagged.jsonl, reason duplicate_record)")
    if dup.get("positive_reused"):
        warnings.append(f"{dup['positive_reused']} records share a positive with more than "
                        f"{report['config']['max_positive_reuse']} others: in one batch such rows are each other's "
                        "false negatives")
    degenerate = sum((report.get("degenerate") or {}).values())
    if degenerate:
        warnings.append(f"{degenerate} degenerate texts (empty, very short, query equal to its positive, a negative "
                        "equal to a positive): see flagged.jsonl, kind degenerate")
    robust = loss == "peg"  # the recipe for noisy data: the starting model drops random-like positives, then PEG
    command = f"robustir train --train-data {data} --loss {loss}" + (" --filter-positives" if robust else "")
    config_line = f"loss: {loss}" + (", filter_positives: true" if robust else "")
    return {"loss": loss, "loss_options": {}, "filter_positives": robust, "reason": reason, "command": command,
            "config_line": config_line, "also": also, "warnings": warnings,
            "unknown": ["near_miss"] if unreadable else []}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _part(estimate: dict, name: str, rate: Any, high: Any) -> tuple[Any, Any]:
    """``(share, interval top)`` of one part of the estimate; an estimate without parts (older reports) counts as
    all ``random_like`` (``rate``/``high`` given) or none."""
    if name in estimate:
        return estimate.get(name), estimate.get(f"{name}_high")
    return rate, high


def _noisy(share: Any, top: Any) -> bool:
    """A part of the estimate that calls for protection: at least 5 %, or its interval reaching 10 %."""
    return _finite(share) and (share >= CLEAN_RATE or (_finite(top) and top >= CLEAN_HIGH))


def loss_from_audit(folder: str | None, loss: str, train_data: object) -> tuple[str, dict, dict]:
    """The loss, its options and the rest of the recipe (``{"filter_positives": bool}``) an audit folder
    recommends, for ``robustir train --loss auto --audit FOLDER``.

    Refused with a clear error: no folder, a folder without a complete audit, or an audit of other data than
    ``train_data`` (a path; a mixture of sources is checked source by source).
    """
    import json
    from pathlib import Path

    from ..errors import ConfigError
    from ..runs import Artifact

    if not folder:
        raise ConfigError("loss: auto needs audit: the folder of a robustir audit of the training data (robustir audit "
                          "--data TRAIN --output FOLDER), or name the loss (infonce, peg, ccr)")
    path = Path(folder)
    report_path = path / "report.json"
    if not Artifact(path, what="audit", inside=True).complete():  # verifies report.json among its files
        raise ConfigError(f"audit: {folder} holds no complete audit (report.json and its record run.json); run "
                          f"robustir audit --data TRAIN --output {folder} first")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        chosen, options = report["recommendation"]["loss"], dict(report["recommendation"].get("loss_options") or {})
        recipe = {"filter_positives": bool(report["recommendation"].get("filter_positives", False))}
        audited = report["data"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"audit: {report_path} is not an audit report ({exc}); run robustir audit again") from None
    sources = [train_data] if isinstance(train_data, str) else \
        [getattr(s, "path", None) or (s.get("path") if isinstance(s, dict) else None) for s in train_data or []]
    sources = [s for s in sources if s]
    if sources and all(Path(str(s)).expanduser().resolve() != Path(audited).expanduser().resolve() for s in sources):
        raise ConfigError(f"audit: {folder} audited {audited}, not the training data {', '.join(map(str, sources))}; "
                          "audit the data you train on, or name the loss instead of auto")
    # the same path is not the same data: the audit's record holds the content digest it read
    record = Artifact(path, what="audit", inside=True).record() or {}
    audited_digest = ((record.get("fingerprint") or {}).get("inputs") or {}).get("data")
    if audited_digest and len(sources) == 1:
        from ..runs import fingerprint

        if fingerprint("audit", {}, {"data": sources[0]}).inputs.get("data") != audited_digest:
            raise ConfigError(f"audit: {folder} audited {audited} before it changed (its content differs from what "
                              "was audited); run robustir audit on it again, or name the loss instead of auto")
    return chosen, options, recipe
