"""The audit's human-readable outputs: ``report.md`` and ``audit.png``, both made from ``report.json``'s content."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..io import atomic_write

__all__ = ["write_markdown", "write_plot"]

_READ_ON = 5  # flagged examples shown per kind in the Markdown


def _pct(x: float | None) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{100 * x:.1f} %"


def write_markdown(report: dict, path: Path) -> Path:
    est = report["false_positives"]["estimate"]
    rec = report["recommendation"]
    lines = [f"# Audit of `{report['data']}`", ""]
    lines += [f"{report['records']} records, {report['pairs']} (query, positive) pairs, {report['negatives']} negatives; "
              f"the teacher ({report['teacher']}) scored {report['scored_records']} records"
              + (" (a uniform sample)" if report["sampled"] else "") + f", against a search pool of "
              f"{report['search_pool']['passages']} passages ({report['search_pool']['source']}).", ""]
    if "near_miss" in rec.get("unknown", []):
        lines += ["**False positives that look right (near misses) are not measured**: "
                  f"{(report['false_positives'].get('near_miss') or {}).get('why', 'unknown')}.", ""]
    lines += ["## Recommendation", "", f"**Train with `{rec['loss']}`**: {rec['reason']}.", "", "```bash",
              rec["command"], "```", "", f"Config file: `{rec['config_line']}`; or let the audit choose: "
              f"`robustir train --loss auto --audit {report['config']['output']} ...`", ""]
    for item in rec["also"]:
        lines.append(f"- Also: {item}.")
    for item in rec["warnings"]:
        lines.append(f"- Warning: {item}.")
    lines += ["", "## False positives", "", f"Estimated share of pairs whose positive is not relevant: "
              f"**{_pct(est['rate'])}** (95 % bootstrap interval {_pct(est['low'])} – {_pct(est['high'])}).", "",
              "| part | estimate | 95 % interval | how |", "|---|---:|---|---|",
              f"| random-like | {_pct(est['random_like'])} | {_pct(est['random_like_low'])} – "
              f"{_pct(est['random_like_high'])} | share of positives that half of {est['random_passages']} random "
              "passages outscore, over the share a random passage would (Storey) |",
              f"| hard-like | {_pct(est['hard_like'])} | {_pct(est['hard_like_low'])} – {_pct(est['hard_like_high'])} | "
              "share of positives outranked by a pool passage by more than planted hard nulls' median gap, beyond "
              "what random nulls and " + ("the clean reference put there |" if not est["upper_bound"] else
                                          "(no clean reference: **an upper bound**, the teacher's misses count) |")]
    near = report["false_positives"].get("near_miss") or {}
    if near:
        near_parts = near.get("parts") or {}
        lines += ["", ("**Near misses** (a positive replaced by a passage as near the query as the teacher's own "
                       f"nearest other passage): {near['why']}.")
                  + (f" Terms: near-miss nulls {_pct(near_parts.get('hard_null'))} over the gap threshold "
                     f"{near_parts['threshold']:.3f}, trusted positives {_pct(near_parts.get('reference'))}."
                     if near_parts.get("threshold") is not None else "")]
    parts = est.get("parts") or {}
    if est.get("hard_like") is None:
        lines += ["", "The hard-like part is **not estimated**: no record has negatives to plant hard nulls from "
                  "(mine them first: `robustir mine`), or the teacher scores hard nulls like trusted positives. The "
                  "rate above is the random-like part alone."]
    if parts:
        lines += ["", f"Hard-like terms: gap threshold {parts['threshold']:.3f}; over it: pairs "
                  f"{_pct(parts['observed'])}, hard nulls {_pct(parts['hard_null'])}, random nulls "
                  f"{_pct(parts['random_null'])}, reference {_pct(parts['reference'])}"
                  + (f" ({report['reference'].get('pairs')} pairs of {report['reference'].get('data')} "
                     f"{report['reference'].get('split')})" if report.get("reference") else "") + "."]
    if est.get("check"):
        lines += ["", f"Calibration check: {_pct(est['check']['random_nulls_over_lambda'])} of planted random nulls "
                  f"fall in the random-like region (expected {_pct(est['check']['expected'])})."]
    fn = report["false_negatives"]
    lines += ["", "## Suspected false negatives", "", f"{fn['flagged']} of {fn['negatives_checked']} negatives "
              f"(records with an unsuspected positive) in {fn['records_with_a_flag']} records "
              f"({_pct(fn['share_of_records'])} of the scored records): "
              + (", ".join(f"{k} {v}" for k, v in fn["flagged_by_reason"].items()) or "none") + "."]
    lines += ["", "## Records", "", "| kind | reason | records |", "|---|---|---:|"]
    for kind in ("degenerate", "duplicates", "leakage"):
        for reason, n in (report.get(kind) or {}).items():
            lines.append(f"| {kind} | {reason} | {n} |")
    if not any(report.get(k) for k in ("degenerate", "duplicates", "leakage")):
        lines.append("| – | none found | 0 |")
    lines += ["", "![score distributions and flagged shares](audit.png)", "", "## The most suspicious, to read", ""]
    flagged = Path(path).with_name("flagged.jsonl")
    shown: dict[str, int] = {}
    if flagged.exists():
        with open(flagged, encoding="utf-8") as handle:
            for raw in handle:
                item = json.loads(raw)
                if shown.get(item["kind"], 0) >= _READ_ON:
                    continue
                shown[item["kind"]] = shown.get(item["kind"], 0) + 1
                text = (item.get("text") or "")[:160].replace("\n", " ")
                query = (item.get("query") or "")[:120].replace("\n", " ")
                lines.append(f"- **{item['kind']} / {item['reason']}** `{item['file']}` line {item['line']}: "
                             + (f"query “{query}” – " if query else "") + f"“{text}”"
                             + (f" — {item['why']}" if item.get("why") else ""))
    lines += ["", "Every flag is a line of `flagged.jsonl` (file, line, reason, score); the numbers are in "
              "`report.json`."]
    with atomic_write(path) as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def write_plot(report: dict, path: Path) -> Path | None:
    """Three panels: the gap distributions (pairs, planted nulls, reference), the random p-values, the flagged
    share per reason."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return None
    dist = report["distributions"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    edges = np.asarray(dist["gap_edges"])
    centers = (edges[1:] + edges[:-1]) / 2
    styles = {"pairs": ("the data's pairs", "black"), "hard_nulls": ("planted hard nulls", "tab:orange"),
              "random_nulls": ("planted random nulls", "tab:red"), "reference": ("clean reference", "tab:green")}
    for name, (label, color) in styles.items():
        values = dist["gap"].get(name)
        if values:
            axes[0].plot(centers, values, label=label, color=color, lw=2 if name == "pairs" else 1.2)
    threshold = report["false_positives"]["estimate"].get("parts", {}).get("threshold")
    if threshold is not None and np.isfinite(threshold):
        axes[0].axvline(threshold, color="grey", ls="--", lw=1, label="hard-like threshold")
    axes[0].set_xlabel("gap: best other passage's cosine − positive's")
    axes[0].set_ylabel("share")
    axes[0].set_title("positives against the search pool")
    axes[0].legend(fontsize=8)
    u_edges = np.asarray(dist["u_edges"])
    width = u_edges[1] - u_edges[0]
    axes[1].bar(u_edges[:-1], dist["u"]["pairs"], width=width, align="edge", alpha=0.6, label="the data's pairs",
                color="black")
    axes[1].bar(u_edges[:-1], dist["u"]["random_nulls"], width=width, align="edge", alpha=0.4,
                label="planted random nulls", color="tab:red")
    axes[1].axvline(0.5, color="grey", ls="--", lw=1)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("random p-value: share of random passages above the positive")
    axes[1].set_title("positives against random passages")
    axes[1].legend(fontsize=8)
    shares = report["flagged_share"]
    names = list(shares)[::-1]
    axes[2].barh(range(len(names)), [100 * shares[n] for n in names], color="tab:blue")
    axes[2].set_yticks(range(len(names)), [n.replace(":", ": ") for n in names], fontsize=8)
    axes[2].set_xlabel("flagged share, % (pairs, negatives checked or records)")
    axes[2].set_title("flagged per reason")
    est = report["false_positives"]["estimate"]
    fig.suptitle(f"audit of {Path(report['data']).name}: estimated false positives {_pct(est['rate'])} "
                 f"({_pct(est['low'])} – {_pct(est['high'])})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
